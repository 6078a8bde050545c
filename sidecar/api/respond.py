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
from sidecar.api.wire import ApiError, ClientGone, client_gone, while_connected
from sidecar.config.entries import PairEntry
from sidecar.errors import BadGateway, ClientError, ServerError, Unavailable
from sidecar.observability import metrics
from sidecar.runtime.contract import Delta, Job, Logprob, Outcome, TokenLogprob
from sidecar.runtime.generation import ShuttingDown

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

    def whole(self, parts: list[Delta], o: Outcome) -> web.Response:
        """The answer to a request that did not stream (its Deltas concatenated), or only loaded a model."""


def logprobs_json(lps: tuple[Logprob, ...] | list[Logprob]) -> list[dict[str, Any]]:
    """Ollama's api.Logprob list (the same objects OpenAI's logprobs.content holds)."""

    def one(t: TokenLogprob) -> dict[str, Any]:
        out: dict[str, Any] = {"token": t.token, "logprob": t.logprob}
        if t.bytes:
            out["bytes"] = list(t.bytes)
        return out

    return [{**one(lp.token), **({"top_logprobs": [one(t) for t in lp.top]} if lp.top else {})} for lp in lps]


def joined(parts: list[Delta]) -> Delta:
    """A whole answer's Deltas as one: texts concatenated, tool calls and logprobs gathered."""
    return Delta("".join(d.content for d in parts), tuple(c for d in parts for c in d.tool_calls),
                 "".join(d.thinking for d in parts), tuple(lp for d in parts for lp in d.logprobs))


def api_error(e: BaseException, unknown: str = RUNNING_THE_MODEL) -> ApiError:
    """The status and message a failure of this kind gets (Ollama's, where Ollama has one)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ClientError):
        return ApiError(400, str(e))
    if isinstance(e, Unavailable):
        return ApiError(503, str(e))
    if isinstance(e, BadGateway):
        return ApiError(502, str(e))
    if isinstance(e, ServerError):
        return ApiError(500, str(e))
    return ApiError(500, f"{unknown}: {e}")


async def respond(request: web.Request, entry: PairEntry, job: Job, framing: Framing,
                  stream: bool) -> web.StreamResponse:
    clock = metrics.TokenClock()  # started before queueing and loading: both count towards TTFT
    events = runtime_of(request).generate(entry, job)
    try:
        first = await while_connected(request, events.__anext__())
    except ClientGone:
        return await _gone(request, entry, events, clock)
    except Exception as e:
        err = api_error(e)
        log_request(request, entry, None, f"error {err.status}", clock)
        raise err from e
    if isinstance(first, Outcome) and first.load_only:
        return framing.whole([], first)
    if not stream:
        return await _whole(request, entry, framing, events, first, clock)
    return await _stream(request, entry, framing, events, first, clock)


async def _gone(request: web.Request, entry: PairEntry, events: AsyncIterator[Delta | Outcome],
                clock: metrics.TokenClock) -> web.StreamResponse:
    log.info("client went away; generation stopped")
    metrics.observe_client_disconnect(request, request.path, entry.name)
    log_request(request, entry, None, "aborted", clock)
    await events.aclose()  # type: ignore[attr-defined]
    return web.Response(status=499)  # nobody is listening; nginx's "client closed request"


async def _whole(request: web.Request, entry: PairEntry, framing: Framing, events: AsyncIterator[Delta | Outcome],
                 ev: Delta | Outcome, clock: metrics.TokenClock) -> web.StreamResponse:
    parts: list[Delta] = []

    async def collect(ev: Delta | Outcome) -> Outcome:
        while isinstance(ev, Delta):
            clock.mark()
            parts.append(ev)
            ev = await events.__anext__()
        return ev

    try:
        outcome = await while_connected(request, collect(ev))
    except ClientGone:
        return await _gone(request, entry, events, clock)
    except Exception as e:
        err = api_error(e)
        log_request(request, entry, None, f"error {err.status}", clock)
        raise err from e
    _finished(request, entry, outcome, clock)
    return framing.whole(parts, outcome)


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
        await _gone(request, entry, events, clock)
        return resp
    except Exception as e:  # after the first byte: one last error chunk, no normal ending
        err = _failed_mid_stream(e)
        log_request(request, entry, None, f"error {err.status}", clock)
        await resp.write(framing.encode(framing.error(err.message)))
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
    log_request(request, entry, o, "ok", clock)
    metrics.observe_generation(request, entry.name, o, clock.ttft, clock.itl, clock.elapsed())


def log_request(request: web.Request, entry: PairEntry, o: Outcome | None, status: str,
                clock: metrics.TokenClock) -> None:
    """The one summary line per generation request, whatever its end: what it cost and whether
    speculation paid (ok), or how far it got (aborted, error)."""
    if o is None:
        requests_log.info("request", path=request.path, model=entry.name, status=status,
                          pieces=len(clock.itl) + (clock.first is not None), seconds=round(clock.elapsed(), 3))
        return
    requests_log.info(
        "request", path=request.path, model=entry.name, status=status, done_reason=o.done_reason,
        prompt_tokens=o.prompt_tokens, tokens=o.eval_count,
        tok_s=round(o.eval_count / o.eval_seconds, 1) if o.eval_seconds > 0 else 0.0,
        drafter=o.drafter, draft_tokens=o.draft_tokens, draft_accepted_tokens=o.draft_accepted_tokens,
        draft_rounds=o.draft_rounds, draft_sources={k: list(v) for k, v in o.drafts_by_source.items()},
        acceptance=round(o.draft_accepted_tokens / o.draft_tokens, 3) if o.draft_tokens else None,
        fallback=o.fallback,
    )
