"""Logging: human-readable on a terminal, JSON lines otherwise (journald, files, CI).

Tracebacks carry no local variables: a frame's locals hold the request being served, prompts and
messages included, and a user's text must not reach the log because something failed while it was
being served. Set SIDECAR_LOG_LOCALS=1 to debug with them (every frame's locals, shortened, in the
JSON line's `exception` or on the terminal), knowing that prompts then land in the log.

aiohttp logs a request it cannot parse (a NUL byte in a header, a garbled request line: what
scanners send) as an error with a traceback, once per probe. It answers 400 either way; here that
is one warning line, without the traceback or the offending bytes.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog
from aiohttp.http_exceptions import BadHttpMessage

LOCALS_ENV = "SIDECAR_LOG_LOCALS"


def show_locals() -> bool:
    """Whether SIDECAR_LOG_LOCALS asks for local variables in tracebacks (1, true, yes or on)."""
    return os.environ.get(LOCALS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _renderers(tty: bool, with_locals: bool) -> list[structlog.types.Processor]:
    """The terminal's coloured lines, or JSON lines with a logged exception as structured data."""
    if tty:
        # ConsoleRenderer's default formatter shows locals (rich's; better-exceptions' values); plain has none.
        formatter = structlog.dev.RichTracebackFormatter(show_locals=with_locals) \
            if structlog.dev.rich is not None else structlog.dev.plain_traceback
        return [structlog.dev.ConsoleRenderer(colors=True, exception_formatter=formatter)]
    # Without the transformer an exception logs as the repr of a traceback object.
    tracebacks = structlog.tracebacks.ExceptionDictTransformer(show_locals=with_locals)
    return [structlog.processors.ExceptionRenderer(tracebacks), structlog.processors.JSONRenderer()]


def quiet_bad_requests(record: logging.LogRecord) -> bool:
    """A filter for aiohttp.server: a request aiohttp could not parse becomes one warning line.

    The client still gets aiohttp's 400. The exception's first line says what was wrong; the rest
    (the raw header or request line, which may hold a token or a cookie) and the traceback go."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, BadHttpMessage) and record.levelno > logging.WARNING:
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        reason = exc.message.strip().splitlines()[0].rstrip(":") if exc.message.strip() else type(exc).__name__
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        record.msg, record.args = "malformed request from %s answered %d: %s", (remote, exc.code, reason)
        record.exc_info = record.exc_text = None
    return True


def setup_logging(level: int = logging.INFO) -> None:
    """Route stdlib logging (ours, aiohttp's, llama.cpp's) through one structlog renderer."""
    renderers = _renderers(sys.stderr.isatty(), show_locals())
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderers],
        foreign_pre_chain=shared,
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.server").addFilter(quiet_bad_requests)  # added once however often this runs
