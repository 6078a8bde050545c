"""One generation answered over HTTP, the same way for every API flavour.

The runtime turns a Job into Deltas and an Outcome. What is left is HTTP: wait for the first
event before sending anything (so a failure while loading, rendering or queueing keeps its own
status code), then either collect the whole answer or stream it, stop when the client goes away,
end a stream with the flavour's closing chunk, or with one error chunk when generation fails
after the first byte, and account for the request (its log line and metrics). How chunks look is
the `Framing`'s job: Ollama's NDJSON (api.ollama) and OpenAI's SSE (api.openai).

A client that leaves mid-generation is not cut off blindly: the request's own stop, handed to the
runtime with the job, stops the engine at its next step, and the `cancel` Outcome that ends the
generation then is accounted like any other, so the tokens of aborted requests count too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
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
ABORT_GRACE = 5.0  # seconds an aborted generation may take to reach its engine's next step and end
# Seconds a stream waits for its first event before a framing that can keep it alive (Anthropic's
# pings) opens it: Node's fetch (undici), which Claude Code runs on, gives up on a response whose
# headers have not come in 300 s, and a long agent prompt can take longer to prefill on a CPU.
KEEPALIVE = 15.0
# Set once a request's summary line is written, so the app's middleware writes none of its own.
LOGGED = web.RequestKey("sidecar_request_logged", bool) if hasattr(web, "RequestKey") else "sidecar.request_logged"


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
    stop = threading.Event()  # set on the event loop when the client leaves; read by the engine at each step
    # A streamed answer has someone watching it: it waits for a slot ahead of those nobody watches.
    events = runtime_of(request).generate(entry, replace(job, interactive=stream), stop.is_set)
    waiting = getattr(framing, "waiting", None) if stream else None  # Callable[[], list[dict]] | None
    task = asyncio.ensure_future(events.__anext__())
    resp: web.StreamResponse | None = None
    try:
        while True:
            try:
                first = await while_connected(request, asyncio.wait_for(asyncio.shield(task),
                                                                        KEEPALIVE if waiting else None))
                break
            except TimeoutError:  # (only with `waiting`) the stream opens, and its framing keeps it alive
                assert waiting is not None
                if resp is None:
                    resp = web.StreamResponse(headers={"Content-Type": framing.content_type})
                    await resp.prepare(request)
                for chunk in waiting():
                    await resp.write(framing.encode(chunk))
    except (ClientGone, ConnectionResetError, ConnectionError):
        task.cancel()  # stops the generation where it is (queued, loading, prefilling)
        with contextlib.suppress(BaseException):
            await task
        await _gone(request, entry, events, clock, stop, None)
        return resp if resp is not None else web.Response(status=499)
    except Exception as e:
        if resp is not None:  # opened already: the failure ends the stream, as one after the first byte
            err = _failed_mid_stream(e)
            log_request(request, entry.name, None, f"error {err.status}", clock, reason=err.message)
            await resp.write(framing.encode(framing.error(err.message)))
            await resp.write_eof()
            return resp
        err = api_error(e)
        log_request(request, entry.name, None, f"error {err.status}", clock, reason=err.message)
        raise err from e
    if isinstance(first, Outcome) and first.load_only:
        return framing.whole([], first)
    if not stream:
        return await _whole(request, entry, framing, events, first, clock, stop)
    return await _stream(request, entry, framing, events, first, clock, stop, resp)


async def _gone(request: web.Request, entry: PairEntry, events: AsyncIterator[Delta | Outcome],
                clock: metrics.TokenClock, stop: threading.Event,
                rest: Outcome | asyncio.Future[Outcome] | None) -> web.StreamResponse:
    """The client went away: stop the generation and account for what it did.

    `rest` is what is left of a generation that got going: its Outcome if that already came, else
    the task that waits for it. None: the client left before the first event (while queued or
    loading), so nothing was generated and the stream is just closed."""
    log.info("client went away; generation stopped")
    metrics.observe_client_disconnect(request, request.path, entry.name)
    try:
        outcome = await _stopped(stop, rest) if isinstance(rest, asyncio.Future) else rest
        if outcome is not None:
            metrics.observe_generation(request, entry.name, outcome, clock.ttft, clock.itl)  # no final chunk: no e2e
        log_request(request, entry.name, outcome, "aborted", clock)
    finally:
        if isinstance(rest, asyncio.Future):
            rest.cancel()  # a no-op once it is done
            with contextlib.suppress(BaseException):
                await rest
        await events.aclose()  # type: ignore[attr-defined]
    return web.Response(status=499)  # nobody is listening; nginx's "client closed request"


async def _stopped(stop: threading.Event, rest: asyncio.Future[Outcome]) -> Outcome | None:
    """Stop a generation through its stop and wait for the Outcome that ends it, which counts what
    it generated. None where that cannot be had: one that does not end within ABORT_GRACE, or one
    that fails (closing the stream then stops it)."""
    stop.set()
    try:
        return await asyncio.wait_for(rest, ABORT_GRACE)
    except TimeoutError:
        log.warning("generation did not stop within %gs of its client leaving; closing it", ABORT_GRACE)
    except Exception as e:
        log.info("generation failed after its client went away: %s", e)
    return None


async def _outcome(events: AsyncIterator[Delta | Outcome]) -> Outcome:
    """The rest of a generation nobody reads any more, dropped: only its Outcome counts."""
    while not isinstance(ev := await events.__anext__(), Outcome):
        pass
    return ev


async def _whole(request: web.Request, entry: PairEntry, framing: Framing, events: AsyncIterator[Delta | Outcome],
                 ev: Delta | Outcome, clock: metrics.TokenClock, stop: threading.Event) -> web.StreamResponse:
    parts: list[Delta] = []

    async def collect(ev: Delta | Outcome) -> Outcome:
        while isinstance(ev, Delta):
            clock.mark()
            parts.append(ev)
            ev = await events.__anext__()
        return ev

    # Shielded: when the client leaves, the collecting goes on until the aborted generation's Outcome.
    task = asyncio.ensure_future(collect(ev))
    try:
        outcome = await while_connected(request, asyncio.shield(task))
    except ClientGone:
        return await _gone(request, entry, events, clock, stop, task)
    except Exception as e:
        err = api_error(e)
        log_request(request, entry.name, None, f"error {err.status}", clock, reason=err.message)
        raise err from e
    finally:
        task.cancel()  # a no-op once it is done; else (the handler itself was cancelled) it stops the generation
    _finished(request, entry, outcome, clock)
    return framing.whole(parts, outcome)


async def _stream(request: web.Request, entry: PairEntry, framing: Framing, events: AsyncIterator[Delta | Outcome],
                  ev: Delta | Outcome, clock: metrics.TokenClock, stop: threading.Event,
                  resp: web.StreamResponse | None = None) -> web.StreamResponse:
    """`resp`: the response already opened while the first event was awaited (KEEPALIVE)."""
    if resp is None:
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
        await _gone(request, entry, events, clock, stop,
                    ev if isinstance(ev, Outcome) else asyncio.ensure_future(_outcome(events)))
        return resp
    except Exception as e:  # after the first byte: one last error chunk, no normal ending
        err = _failed_mid_stream(e)
        log_request(request, entry.name, None, f"error {err.status}", clock, reason=err.message)
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
    log_request(request, entry.name, o, "ok", clock)
    metrics.observe_generation(request, entry.name, o, clock.ttft, clock.itl, clock.elapsed())


def log_request(request: web.Request, model: str | None, o: Outcome | None, status: str,
                clock: metrics.TokenClock, reason: str | None = None) -> None:
    """The one summary line per generation request, whatever its end: what it cost and whether
    speculation paid (ok, or aborted with the Outcome its abort ended it with), or how far it got
    (aborted, error, with the `reason` the client was told). The app's middleware writes it for
    every other error answer, on any route."""
    request[LOGGED] = True  # type: ignore[index]
    if o is None:
        requests_log.info("request", path=request.path, model=model, status=status, reason=reason,
                          pieces=len(clock.itl) + (clock.first is not None), seconds=round(clock.elapsed(), 3))
        return
    requests_log.info(
        "request", path=request.path, model=model, status=status, done_reason=o.done_reason,
        prompt_tokens=o.prompt_tokens, tokens=o.eval_count,
        tok_s=round(o.eval_count / o.eval_seconds, 1) if o.eval_seconds > 0 else 0.0,
        drafter=o.drafter, draft_tokens=o.draft_tokens, draft_accepted_tokens=o.draft_accepted_tokens,
        draft_rounds=o.draft_rounds, draft_sources={k: list(v) for k, v in o.drafts_by_source.items()},
        acceptance=round(o.draft_accepted_tokens / o.draft_tokens, 3) if o.draft_tokens else None,
        fallback=o.fallback, withdrawn=o.withdrawn,
    )


def request_logged(request: web.Request) -> bool:
    """Whether the request's summary line was written (log_request)."""
    return bool(request.get(LOGGED))  # type: ignore[call-overload]
