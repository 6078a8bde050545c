"""What every request passes first: its id in every log line, and the door that closes at shutdown.

Request ids: each request gets one (a client's own `X-Request-Id` when it looks like an id, else a
fresh one), bound in structlog's contextvars so every log line written while serving it carries
`request_id` (worker threads inherit it, see runtime.llamacpp.worker), and echoed in the response's
`X-Request-Id` so a client can quote it.

Draining: on SIGTERM/SIGINT the daemon stops taking work: every request that arrives from then on
gets 503 in the API's error shape, while the ones already running finish, up to a deadline
(cli.py's --drain-timeout). `Drain` counts the running requests so shutdown knows when they are done.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from sidecar.api.wire import error_for

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

HEADER = "X-Request-Id"
# Ids clients and proxies send (UUIDs, trace ids, nginx's $request_id); anything else is replaced,
# because the id lands in log lines and headers.
SANE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+=-]{0,127}")
REQUEST_ID = web.RequestKey("sidecar_request_id", str) if hasattr(web, "RequestKey") else "sidecar.request_id"


def request_id_of(request: web.Request) -> str | None:
    return request.get(REQUEST_ID)  # type: ignore[call-overload, no-any-return]


@web.middleware
async def request_id(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bind the request's id for its log lines; on_response_prepare puts it on the response."""
    given = request.headers.get(HEADER, "")
    rid = given if SANE_ID.fullmatch(given) else uuid.uuid4().hex
    request[REQUEST_ID] = rid  # type: ignore[index]
    structlog.contextvars.clear_contextvars()  # a kept-alive connection must not inherit the last id
    structlog.contextvars.bind_contextvars(request_id=rid)
    try:
        return await handler(request)
    finally:
        structlog.contextvars.unbind_contextvars("request_id")


async def on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every response, streamed or not and errors included, names its request."""
    rid = request_id_of(request)
    if rid is not None:
        response.headers[HEADER] = rid


class Drain:
    """Counts running requests and, once closed, turns new ones away with 503."""

    def __init__(self) -> None:
        self.closed = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def close(self) -> None:
        self.closed = True

    async def wait(self, timeout: float) -> bool:
        """Wait until no request runs, at most `timeout` seconds; whether they all finished."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.closed:
            resp = error_for(request, 503, "server shutting down")
            resp.headers["Connection"] = "close"
            return resp
        self.active += 1
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()


DRAIN = web.AppKey("sidecar_drain", Drain)
