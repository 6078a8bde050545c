"""The aiohttp application: routes, the one error envelope per route, and what every request passes."""

from __future__ import annotations

import json
import logging

from aiohttp import web

from sidecar.api import admin, anthropic, guard, lifecycle, neighbour, ollama, openai, proxy, responses
from sidecar.api.pairs import RUNTIME, runtime_of
from sidecar.api.respond import api_error, log_request, request_logged
from sidecar.api.wire import ApiError, error_for
from sidecar.config.schema import UpstreamKind
from sidecar.observability import metrics
from sidecar.runtime.manager import Runtime

log = logging.getLogger("sidecar.api")

MAX_BODY = 64 * 1024 * 1024  # generous for long prompts and images, small enough to refuse abuse
MAX_LOGGED_NAME = 128  # a model name a client sent, as far as a summary line quotes it
MAX_LOGGED_REASON = 300  # an error message, as far as a summary line quotes it


@web.middleware
async def refusals(request: web.Request, handler: lifecycle.Handler) -> web.StreamResponse:
    """Account a request that ended in an error before a generation could account for it.

    Such a request may have been refused before its pair was looked up (a bad field, images or
    embeddings for a pair): if its body names a pair, its sidecar_requests_total sample gets the
    pair's name. And every error answer that respond() did not log (refused before it ran, by the
    guards, the drain, the handler, the router, or an upstream that is down or said no; on any
    route, forwarded or not) gets its one summary line here, with the reason the client was given:
    before, a 502 from a dead upstream showed only in /metrics.

    Inside the metrics middleware, which reads the label afterwards, and outside the guards and
    the drain, whose refusals are requests too."""
    clock = metrics.TokenClock()
    try:
        resp = await handler(request)
    except web.HTTPException as e:
        await _refused(request, e.status, clock, e.text or e.reason)
        raise
    await _refused(request, resp.status, clock, _reason(resp))
    return resp


async def _refused(request: web.Request, status: int, clock: metrics.TokenClock, reason: str | None) -> None:
    """Label an error's sample with the pair the body names; log the summary line respond() did not."""
    if status < 400:
        return
    pair = metrics.model_of(request)
    needs_line = not request_logged(request)
    if pair is not None and not needs_line:
        return
    name = pair or await _body_model(request)
    if pair is None and name is not None and (entry := runtime_of(request).find(name)) is not None:
        pair = entry.name
        metrics.set_model(request, pair)
    if needs_line:
        log_request(request, pair or (name[:MAX_LOGGED_NAME] if name else None), None,
                    "aborted" if status == 499 else f"error {status}", clock, reason=reason)


def _reason(resp: web.StreamResponse) -> str | None:
    """What an error answer told the client: the message of Ollama's `{"error": "..."}` or OpenAI's
    `{"error": {"message": ...}}`, a plain-text body, or, for a streamed answer (an upstream's,
    passed through), that the upstream gave this status."""
    if resp.status < 400:
        return None
    body = resp.body if isinstance(resp, web.Response) else None
    if not isinstance(body, bytes):
        return f"upstream answered {resp.status}" if resp.prepared else None
    text = body[:MAX_LOGGED_REASON * 4].decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text.strip()[:MAX_LOGGED_REASON] or None
    if isinstance(err, dict):
        err = err.get("message")
    return str(err)[:MAX_LOGGED_REASON] if err is not None else None


async def _body_model(request: web.Request) -> str | None:
    """The model the request's JSON body names, if the handler read the body: one nobody read
    stays unread here (it may be large, or still arriving)."""
    if not request.body_exists or not request.content.at_eof():
        return None
    _, body = await proxy.peek(request)  # the bytes the handler read, kept by aiohttp
    return proxy.name_in(body, "model", "name")  # /api/show and Ollama's older clients name it `name`


@web.middleware
async def errors(request: web.Request, handler):  # type: ignore[no-untyped-def]
    """Every failure in the route's error shape (OpenAI's under /v1, Ollama's elsewhere); nothing
    escapes as a traceback page."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return error_for(request, 413, f"request body too large (limit {MAX_BODY} bytes)")
    except web.HTTPException as e:
        if e.status in (404, 405) and not request.path.startswith("/api/"):
            raise
        if e.status == 404:
            return web.Response(status=404, text="404 page not found", content_type="text/plain")
        if e.status == 405:
            return web.Response(status=405, text="405 method not allowed", content_type="text/plain")
        raise
    except Exception as e:
        err = api_error(e, unknown="internal error")
        # The responder passes a failure on as an ApiError raised from it.
        if not getattr(e.__cause__ if isinstance(e, ApiError) else e, "traced", True):
            log.warning("%s %s: %s", request.method, request.path, err.message)
        elif err.status == 500:
            log.exception("unhandled error on %s %s", request.method, request.path)
        return error_for(request, err.status, err.message)


def create_app(runtime: Runtime, *, bind_host: str = "127.0.0.1", upstream: str | None = None,
               upstream_kind: UpstreamKind = "auto") -> web.Application:
    """`bind_host` is the listen address: on loopback the Host-header (DNS-rebinding) check is on.
    `upstream`: the real Ollama (or LM Studio) that serves everything that is not a pair."""
    drain = lifecycle.Drain()
    app = web.Application(middlewares=[lifecycle.request_id, metrics.middleware, refusals,
                                       *guard.middlewares(bind_host), drain.middleware, errors],
                          client_max_size=MAX_BODY)
    app[lifecycle.DRAIN] = drain
    app.on_response_prepare.append(guard.on_response_prepare)
    app.on_response_prepare.append(lifecycle.on_response_prepare)
    app[RUNTIME] = runtime
    metrics.setup(app, runtime)
    proxy.setup(app, upstream, upstream_kind)
    neighbour.setup(app)
    r = app.router
    r.add_get("/", ollama.root)  # add_get answers HEAD too, as Ollama does
    r.add_get("/api/version", ollama.version)
    r.add_get("/api/tags", ollama.tags)
    r.add_get("/api/ps", ollama.ps)
    # Model routes: pairs here, other models forwarded to the upstream.
    r.add_post("/api/show", proxy.pair_or_forward(ollama.show, "model", "name"))
    r.add_post("/api/generate", proxy.pair_or_forward(ollama.generate))
    r.add_post("/api/chat", proxy.pair_or_forward(ollama.chat))
    r.add_post("/api/embed", proxy.embeddings)
    r.add_post("/api/embeddings", proxy.embeddings)
    for path in ("/api/pull", "/api/push", "/api/create", "/api/copy"):
        r.add_post(path, proxy.manage)
    r.add_delete("/api/delete", proxy.manage)
    openai.setup(app)  # /v1: pairs here, other models forwarded
    responses.setup(app)  # /v1/responses: the same, with its store for previous_response_id
    anthropic.setup(app)  # /v1/messages: the same, in Anthropic's shapes
    admin.setup(app)  # /sidecar/status, outside /api/
    proxy.add_catch_all(app)  # everything else goes to the upstream (or gin's 404 without one)

    async def unload(_: web.Application) -> None:
        # On cleanup, after aiohttp has cancelled what handlers were left: a handler stuck on a
        # client that stopped reading would otherwise hold its worker thread while we join it.
        await runtime.unload_all()

    app.on_cleanup.append(unload)
    return app
