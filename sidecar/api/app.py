"""The aiohttp application: routes, the one error envelope per route, and what every request passes."""

from __future__ import annotations

import logging

from aiohttp import web

from sidecar.api import admin, guard, lifecycle, ollama, openai, proxy
from sidecar.api.pairs import RUNTIME
from sidecar.api.respond import api_error
from sidecar.api.wire import error_for
from sidecar.config.schema import UpstreamKind
from sidecar.observability import metrics
from sidecar.runtime.manager import Runtime

log = logging.getLogger("sidecar.api")

MAX_BODY = 64 * 1024 * 1024  # generous for long prompts and images, small enough to refuse abuse


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
        if err.status == 500:
            log.exception("unhandled error on %s %s", request.method, request.path)
        return error_for(request, err.status, err.message)


def create_app(runtime: Runtime, *, bind_host: str = "127.0.0.1", upstream: str | None = None,
               upstream_kind: UpstreamKind = "auto") -> web.Application:
    """`bind_host` is the listen address: on loopback the Host-header (DNS-rebinding) check is on.
    `upstream`: the real Ollama (or LM Studio) that serves everything that is not a pair."""
    drain = lifecycle.Drain()
    app = web.Application(middlewares=[lifecycle.request_id, metrics.middleware, *guard.middlewares(bind_host),
                                       drain.middleware, errors],
                          client_max_size=MAX_BODY)
    app[lifecycle.DRAIN] = drain
    app.on_response_prepare.append(guard.on_response_prepare)
    app.on_response_prepare.append(lifecycle.on_response_prepare)
    app[RUNTIME] = runtime
    metrics.setup(app, runtime)
    proxy.setup(app, upstream, upstream_kind)
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
    admin.setup(app)  # /sidecar/status, outside /api/
    proxy.add_catch_all(app)  # everything else goes to the upstream (or gin's 404 without one)

    async def unload(_: web.Application) -> None:
        # On cleanup, after aiohttp has cancelled what handlers were left: a handler stuck on a
        # client that stopped reading would otherwise hold its worker thread while we join it.
        await runtime.unload_all()

    app.on_cleanup.append(unload)
    return app
