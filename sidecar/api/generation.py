"""One generation as every API flavour runs it: options, the runtime's event stream, errors, logging.

Ollama's native routes (ollama.py) and the OpenAI-compatible ones (openai.py) differ only in how
they frame requests and chunks. How a generation starts, fails, ends and is logged lives here, so
a fix to any of it applies to both.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog
from aiohttp import web

from sidecar.api.wire import ApiError
from sidecar.engine.decoder import InvalidToken, PromptTooLong
from sidecar.engine.grammar import GrammarError
from sidecar.observability import metrics
from sidecar.runtime.manager import Loaded, Outcome, PairEntry, Runtime, ServerBusy, ShuttingDown
from sidecar.runtime.options import Effective, OptionError, coerce, effective
from sidecar.templates.chat import FALLBACK_TEMPLATE, TemplateError
from sidecar.templates.tools import ToolCallParser

log = logging.getLogger("sidecar.api")
requests_log = structlog.get_logger("sidecar.request")

Render = Callable[[Loaded], tuple[str, list[int] | None]]
"""Builds the prompt once the target is loaded: (prompt text, token ids to put before it)."""


def options(entry: PairEntry, request_options: Any) -> Effective:
    """The pair's defaults under the request's options; a bad value is the client's 400."""
    try:
        return effective(entry.params, coerce(request_options))
    except OptionError as e:
        raise ApiError(400, str(e)) from None


def render(fn: Render, lm: Loaded) -> tuple[str, list[int] | None]:
    try:
        return fn(lm)
    except TemplateError as e:
        raise ApiError(400, f"template error: {e}") from None


def api_error(e: BaseException) -> ApiError:
    """The status and message Ollama would give a failure of this kind."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, PromptTooLong | InvalidToken | GrammarError):
        return ApiError(400, str(e))
    if isinstance(e, ServerBusy | ShuttingDown):
        return ApiError(503, str(e))
    return ApiError(500, f"an error was encountered while running the model: {e}")


def failed_mid_stream(e: BaseException) -> ApiError:
    """Log a failure after the first byte (a shutdown's cut is expected, no traceback) and map it."""
    if isinstance(e, ShuttingDown):
        log.warning("generation stopped: %s", e)
    else:
        log.error("generation failed mid-stream", exc_info=e)
    return api_error(e)


def client_gone(request: web.Request) -> bool:
    """aiohttp does not cancel handlers when the client leaves; streams look before each write."""
    return request.transport is None or request.transport.is_closing()


class Generation:
    """A generation whose first event has arrived.

    `start` waits for it, so a failure while loading, rendering or queueing still gets its own
    status code: nothing has been sent yet. Iterate `pieces()` for the text, then read `outcome`."""

    def __init__(self, events: AsyncIterator[str | Outcome], first: str | Outcome,
                 clock: metrics.TokenClock) -> None:
        self._events = events
        self._first = first
        self.clock = clock  # started before queueing and loading: both count towards TTFT
        self.outcome: Outcome | None = None

    @classmethod
    async def start(cls, rt: Runtime, entry: PairEntry, fn: Render, opts: Effective,
                    keep_alive: float | None, format: str | dict[str, Any] | None = None) -> Generation:
        def prompt_of(lm: Loaded) -> tuple[str, list[int] | None]:
            return render(fn, lm)

        clock = metrics.TokenClock()
        events = rt.generate(entry, prompt_of, opts, keep_alive, format)
        try:
            first = await events.__anext__()  # type: ignore[attr-defined]
        except Exception as e:
            raise api_error(e) from e
        return cls(events, first, clock)

    async def pieces(self) -> AsyncIterator[str]:
        """The text pieces; raises what the runtime raised (map it with api_error)."""
        ev = self._first
        while not isinstance(ev, Outcome):
            yield ev
            self.clock.mark()
            ev = await self._events.__anext__()
        self.outcome = ev

    async def text(self, parser: ToolCallParser | None = None) -> tuple[str, list[dict[str, Any]], Outcome]:
        """The whole text, the tool calls `parser` finds in it, and the Outcome (non-streaming answers)."""
        try:
            parts = [p async for p in self.pieces()]
        except Exception as e:
            raise api_error(e) from e
        assert self.outcome is not None
        text = "".join(parts)
        if parser is None:
            return text, [], self.outcome
        content, calls = parser.feed(text)
        rest, more = parser.flush()
        return content + rest, calls + more, self.outcome

    def finish(self, request: web.Request, entry: PairEntry) -> None:
        """Account a completed generation: the request's log line and its metrics."""
        assert self.outcome is not None
        log_request(request, entry, self.outcome, "ok")
        metrics.set_model(request, entry.name)
        c = self.clock
        metrics.observe_generation(request, entry.name, self.outcome.result, c.ttft, c.itl, c.elapsed())

    def disconnected(self, request: web.Request, entry: PairEntry) -> None:
        log.info("client went away; generation stopped")
        metrics.observe_client_disconnect(request, request.path, entry.name)

    async def aclose(self) -> None:
        """Stop generating now: the worker keeps going until the runtime's stream is closed."""
        await self._events.aclose()  # type: ignore[attr-defined]


def log_request(request: web.Request, entry: PairEntry, o: Outcome, status: str) -> None:
    """The one summary line per request: what it cost and whether speculation paid."""
    r = o.result
    requests_log.info(
        "request", path=request.path, model=entry.name, status=status, done_reason=r.done_reason,
        prompt_tokens=r.prompt_tokens, tokens=len(r.tokens),
        tok_s=round(len(r.tokens) / r.eval_seconds, 1) if r.eval_seconds > 0 else 0.0,
        drafter=r.drafter, draft_tokens=r.draft_tokens, draft_accepted_tokens=r.draft_accepted_tokens,
        draft_rounds=r.draft_rounds,
        acceptance=round(r.draft_accepted_tokens / r.draft_tokens, 3) if r.draft_tokens else None,
        fallback=r.fallback,
    )


# -- prompts: what a pair's declaration adds around the request's own text ------------------------
def history(entry: PairEntry) -> list[dict[str, Any]]:
    """The pair's MESSAGE lines (its own, else the Ollama layer's)."""
    return [m.model_dump() for m in entry.config.messages] or list(entry.target.messages)


def completion_messages(entry: PairEntry, prompt: str, system: str | None = None, *,
                        with_history: bool = True) -> list[dict[str, Any]]:
    """/api/generate's messages: system (the request's, else the pair's), history, the prompt."""
    messages: list[dict[str, Any]] = []
    sys_text = system if system is not None else (entry.config.system or entry.target.system)
    if sys_text:
        messages.append({"role": "system", "content": sys_text})
    if with_history:
        messages += history(entry)
    messages.append({"role": "user", "content": prompt})
    return messages


def chat_messages(entry: PairEntry, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """/api/chat's messages: the pair's history, then the request's; the pair's system prompt
    unless the request starts with its own."""
    full = history(entry) + messages
    sys_text = entry.config.system or entry.target.system
    if sys_text and messages and messages[0]["role"] != "system":
        full = [{"role": "system", "content": sys_text}, *full]
    return full


def template_source(entry: PairEntry) -> str:
    """The pair's chat template source by Ollama's precedence (what Runtime.template renders)."""
    gguf = entry.metadata.get("tokenizer.chat_template")
    return entry.config.template or entry.target.template or (gguf if isinstance(gguf, str) else FALLBACK_TEMPLATE)


