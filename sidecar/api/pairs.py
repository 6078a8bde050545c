"""The runtime as the app holds it, and the one way a route finds the pair a request names."""

from __future__ import annotations

from aiohttp import web

from sidecar.api.wire import ApiError
from sidecar.config.entries import PairEntry
from sidecar.observability import metrics
from sidecar.runtime.manager import Runtime

RUNTIME = web.AppKey("sidecar_runtime", Runtime)


def runtime_of(request: web.Request) -> Runtime:
    return request.app[RUNTIME]


def find_pair(request: web.Request, name: str) -> PairEntry:
    """The pair a request names, or Ollama's 404 (`model 'x' not found`).

    From here on the request's metrics carry the pair's name, whatever its end (an error, an
    unload, an abort); a name that is no pair stays unlabelled, since clients can send anything."""
    entry = runtime_of(request).find(name) if name else None
    if entry is None:
        raise ApiError(404, f"model '{name}' not found")
    metrics.set_model(request, entry.name)
    return entry
