"""The aiohttp application: routes, Ollama-shaped errors, and the pieces every request passes."""

from __future__ import annotations

import logging

from aiohttp import web

from sidecar.api import ollama
from sidecar.api.wire import ApiError, error_response
from sidecar.runtime.manager import Runtime

log = logging.getLogger("sidecar.api")

MAX_BODY = 64 * 1024 * 1024  # generous for long prompts and images, small enough to refuse abuse


@web.middleware
async def ollama_errors(request: web.Request, handler):  # type: ignore[no-untyped-def]
    """Every failure becomes Ollama's `{"error": ...}`; nothing escapes as a traceback page."""
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.status, e.message)
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, f"request body too large (limit {MAX_BODY} bytes)")
    except web.HTTPException as e:
        if e.status in (404, 405) and not request.path.startswith("/api/"):
            raise
        if e.status == 404:
            return web.Response(status=404, text="404 page not found", content_type="text/plain")
        if e.status == 405:
            return web.Response(status=405, text="405 method not allowed", content_type="text/plain")
        raise
    except Exception as e:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, f"internal error: {e}")


def create_app(runtime: Runtime) -> web.Application:
    app = web.Application(middlewares=[ollama_errors], client_max_size=MAX_BODY)
    app["runtime"] = runtime
    r = app.router
    r.add_get("/", ollama.root)  # add_get answers HEAD too, as Ollama does
    r.add_get("/api/version", ollama.version)
    r.add_get("/api/tags", ollama.tags)
    r.add_get("/api/ps", ollama.ps)
    r.add_post("/api/show", ollama.show)
    r.add_post("/api/generate", ollama.generate)
    r.add_post("/api/chat", ollama.chat)

    async def shutdown(_: web.Application) -> None:
        await runtime.unload_all()

    app.on_shutdown.append(shutdown)
    return app
