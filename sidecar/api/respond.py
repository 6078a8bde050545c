"""One generation answered over HTTP, the same way for every API flavour.

The runtime turns a Job into Deltas and an Outcome. What is left is HTTP: wait for the first
event before sending anything (so a failure while loading, rendering or queueing keeps its own
status code), then either collect the whole answer or stream it, stop when the client goes away,
end a stream with the flavour's closing chunk, or with one error chunk when generation fails
after the first byte, and account for the request (its log line and metrics). How chunks look is
the `Framing`'s job: Ollama's NDJSON (api.ollama) and OpenAI's SSE (api.openai).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import structlog
from aiohttp import web

from sidecar.api.pairs import runtime_of
from sidecar.api.wire import ApiError, client_gone
from sidecar.config.entries import PairEntry
from sidecar.errors import ClientError, Unavailable
from sidecar.observability import metrics
from sidecar.runtime.contract import Delta, Job, Outcome
from sidecar.runtime.manager import ShuttingDown

log = logging.getLogger("sidecar.api")
requests_log = structlog.get_logger("sidecar.request")

RUNNING_THE_MODEL = "an error was encountered while running the model"


class Framing(Protocol):
    """How one API flavour writes a generation. A framing is made per request: it may keep state
    (OpenAI's first delta carries the role, a stream with tool calls finishes as `tool_calls`)."""

    content_type: str  # of a streamed answer

    def encode(self, chunk: dict[str, Any]) -> bytes:
        """One chunk as the stream carries it (an NDJSON line, an SSE event)."""

    def delta(self, d: Delta) -> list[dict[str, Any]]:
        """The chunks that stream one Delta."""

    def final(self, o: Outcome) -> list[dict[str, Any]]:
        """The chunks that end a stream."""

    def end(self) -> bytes:
        """What follows the last chunk (OpenAI's `data: [DONE]`)."""

    def error(self, message: str) -> dict[str, Any]:
        """The chunk that ends a stream that failed after its first byte."""

    def whole(self, content: str, tool_calls: list[dict[str, Any]], o: Outcome) -> web.Response:
        """The answer to a request that did not stream (and to one that only loaded a model)."""


def api_error(e: BaseException, unknown: str = RUNNING_THE_MODEL) -> ApiError:
    """The status and message a failure of this kind gets (Ollama's, where Ollama has one)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ClientError):
        return ApiError(400, str(e))
    if isinstance(e, Unavailable):
        return ApiError(503, str(e))
    return ApiError(500, f"{unknown}: {e}")


async def respond(request: web.Request, entry: PairEntry, job: Job, framing: Framing,
                  stream: bool) -> web.StreamResponse:
    clock = metrics.TokenClock()  # started before queueing and loading: both count towards TTFT
    events = runtime_of(request).generate(entry, job)
    try:
        first = await events.__anext__()
    except Exception as e:
        raise api_error(e) from e
    if isinstance(first, Outcome) and first.load_only:
        return framing.whole("", [], first)
    if not stream:
        return await _whole(request, entry, framing, events, first, clock)
    return await _stream(request, entry, framing, events, first, clock)


async def _whole(request: web.Request, entry: PairEntry, framing: Framing, events: AsyncIterator[Delta | Outcome],
                 ev: Delta | Outcome, clock: metrics.TokenClock) -> web.Response:
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    try:
        while isinstance(ev, Delta):
            clock.mark()
            content.append(ev.content)
            calls += ev.tool_calls
            ev = await events.__anext__()
    except Exception as e:
        raise api_error(e) from e
    _finished(request, entry, ev, clock)
    return framing.whole("".join(content), calls, ev)


async def _stream(request: web.Request, entry: PairEntry, framing: Framing, events: AsyncIterator[Delta | Outcome],
                  ev: Delta | Outcome, clock: metrics.TokenClock) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": framing.content_type})
    await resp.prepare(request)
    try:
        while isinstance(ev, Delta):
            if client_gone(request):
                raise ConnectionResetError("client went away")
            for chunk in framing.delta(ev):
                await resp.write(framing.encode(chunk))
            clock.mark()
            ev = await events.__anext__()
        for chunk in framing.final(ev):
            await resp.write(framing.encode(chunk))
        await resp.write(framing.end())
        _finished(request, entry, ev, clock)
    except (ConnectionResetError, ConnectionError):
        log.info("client went away; generation stopped")
        metrics.observe_client_disconnect(request, request.path, entry.name)
        await events.aclose()  # the worker keeps going until the runtime's stream is closed
        return resp
    except Exception as e:  # after the first byte: one last error chunk, no normal ending
        await resp.write(framing.encode(framing.error(_failed_mid_stream(e).message)))
    await resp.write_eof()
    return resp


def _failed_mid_stream(e: BaseException) -> ApiError:
    """Log a failure after the first byte (a shutdown's cut is expected, no traceback) and map it."""
    if isinstance(e, ShuttingDown):
        log.warning("generation stopped: %s", e)
    else:
        log.error("generation failed mid-stream", exc_info=e)
    return api_error(e)


def _finished(request: web.Request, entry: PairEntry, o: Outcome, clock: metrics.TokenClock) -> None:
    """Account a completed generation: the request's log line and its metrics."""
    log_request(request, entry, o, "ok")
    metrics.set_model(request, entry.name)
    metrics.observe_generation(request, entry.name, o.result, clock.ttft, clock.itl, clock.elapsed())


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
