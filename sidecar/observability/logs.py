"""Logging: human-readable on a terminal, JSON lines otherwise (journald, files, CI)."""

from __future__ import annotations

import logging
import sys

import structlog


def setup_logging(level: int = logging.INFO) -> None:
    """Route stdlib logging (ours, aiohttp's, llama.cpp's) through one structlog renderer."""
    tty = sys.stderr.isatty()
    # A JSON line gets the traceback as structured data (the console renderer prints it itself);
    # without it an exception logs as the repr of a traceback object.
    renderers = [structlog.dev.ConsoleRenderer(colors=True)] if tty else [
        structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    shared = [
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
