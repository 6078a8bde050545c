"""The upstream: the real Ollama (or LM Studio), moved to another port, behind the sidecar.

The sidecar takes 127.0.0.1:11434, so everything it does not serve itself must reach the real
server unchanged, or clients that pull, embed or chat with ordinary models break. Forwarding is a
byte pipe: method, path, query, headers (minus hop-by-hop ones and Host) and body go up, and the
upstream's status, headers and body come back, streamed both ways chunk by chunk. A model pull or
a first load takes minutes, so there is a connect timeout but no total one; a client that goes
away closes the upstream request, so the real server stops working for nobody.

LM Studio speaks only the OpenAI-compatible /v1 API. Against it, /v1 is forwarded and native
/api calls for models that are not pairs get a clear error instead of LM Studio's "Unexpected
endpoint" answered with status 200.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, get_args

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict
from yarl import URL

from sidecar.api.pairs import runtime_of
from sidecar.api.wire import ApiError, ClientGone, error_for, while_connected
from sidecar.config.entries import PairEntry
from sidecar.config.schema import UpstreamKind
from sidecar.models.resolve import ModelNotFound, is_ollama_name, parse_ollama_name
from sidecar.observability import metrics

log = logging.getLogger("sidecar.api.proxy")

KINDS: tuple[str, ...] = get_args(UpstreamKind)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CONNECT_TIMEOUT = 10.0  # seconds to open a connection; a response may take as long as a model load
LIST_TIMEOUT = 5.0  # listings and /api/version: a stuck upstream must not hang `ollama list`
CHUNK = 64 * 1024

# RFC 9110 §7.6.1 connection-specific fields, plus Proxy-Connection; Expect is answered by aiohttp itself.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "expect"})
# Marks requests this process forwarded: meeting its own mark again means the upstream is itself.
VIA = "X-Spec-Sidecar-Forwarded"


def resolve_upstream(flag: str | None, env: dict[str, str] | os._Environ[str] | None,
                     config: str | None) -> str | None:
    """The upstream URL: `--upstream`, else SIDECAR_UPSTREAM, else the config's `upstream:`.

    An empty value at a higher level switches forwarding off. A bare host:port gets http://."""
    env = os.environ if env is None else env
    for value in (flag, env.get("SIDECAR_UPSTREAM"), config):
        if value is None:
            continue
        value = value.strip()
        if not value:
            return None
        return value if "://" in value else f"http://{value}"
    return None


def resolve_kind(flag: str | None, env: dict[str, str] | os._Environ[str] | None, config: str | None
                 ) -> UpstreamKind:
    """`--upstream-kind`, else SIDECAR_UPSTREAM_KIND, else the config's `upstream_kind:`, else auto."""
    env = os.environ if env is None else env
    for value in (flag, env.get("SIDECAR_UPSTREAM_KIND"), config):
        if value:
            v = value.strip().lower()
            if v not in KINDS:
                raise ValueError(f"upstream kind must be one of {', '.join(KINDS)}, not {value!r}")
            return v  # type: ignore[return-value]
    return "auto"


def forward_headers(headers: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """Headers minus hop-by-hop ones, those the Connection header names, and Host."""
    pairs = list(headers)
    named = {t.strip().lower() for k, v in pairs if k.lower() == "connection" for t in v.split(",")}
    return CIMultiDict((k, v) for k, v in pairs
                       if k.lower() not in HOP_BY_HOP and k.lower() not in named and k.lower() != "host")


class Upstream:
    """One upstream server, with the app's single ClientSession (created on first use)."""

    def __init__(self, url: str, kind: UpstreamKind = "auto", *, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.url = url.rstrip("/")
        self.kind: UpstreamKind = kind
        self.connect_timeout = connect_timeout
        self.ident = uuid.uuid4().hex[:12]
        self._session: aiohttp.ClientSession | None = None
        self._detected: Literal["ollama", "lmstudio"] | None = None
        self._detect_lock = asyncio.Lock()
        self.running: Counter[str] = Counter()  # requests forwarded and not answered, per model

    @contextmanager
    def forwarding(self, name: str) -> Iterator[None]:
        """Count a request forwarded for the model while it runs (Ollama's /api/ps cannot tell)."""
        key = tagged(name)
        self.running[key] += 1
        try:
            yield
        finally:
            self.running[key] -= 1
            if self.running[key] <= 0:
                del self.running[key]

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                # No total timeout: a first load or a pull may take many minutes to answer.
                timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout,
                                              sock_connect=self.connect_timeout),
                connector=aiohttp.TCPConnector(limit=0),  # streams are long; never queue behind them
                auto_decompress=False,  # bytes pass through as sent, Content-Encoding and all
                trust_env=False,  # HTTP_PROXY must not capture a loopback upstream
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # -- what kind of server is up there ---------------------------------------------------------
    async def flavour(self) -> Literal["ollama", "lmstudio"]:
        """The configured kind, or the detected one: Ollama answers /api/version with a version;
        LM Studio answers 404, or 200 with {"error": "Unexpected endpoint or method..."}."""
        if self.kind != "auto":
            return self.kind
        if self._detected is not None:
            return self._detected
        async with self._detect_lock:
            if self._detected is not None:
                return self._detected
            try:
                timeout = aiohttp.ClientTimeout(total=LIST_TIMEOUT, connect=self.connect_timeout)
                async with self.session().get(self.url + "/api/version", timeout=timeout) as r:
                    body = await r.read()
                    status = r.status
            except (aiohttp.ClientError, TimeoutError, OSError):
                return "ollama"  # unknown for now: forwarding answers 502 anyway; ask again next time
            if status == 200 and isinstance(_json(body).get("version"), str):
                self._detected = "ollama"
            elif status == 404 or status == 200:
                self._detected = "lmstudio"
                log.info("upstream %s does not answer /api/version: treating it as LM Studio (/v1 only)", self.url)
            else:
                return "ollama"
            return self._detected

    def lmstudio_error(self, model: str) -> ApiError:
        return ApiError(501, f"model '{model}' is not a spec-sidecar pair, and the upstream at {self.url} is "
                             "LM Studio, which serves only the OpenAI-compatible /v1 API: use /v1/chat/completions")

    # -- small requests the sidecar makes itself (listings, version) -----------------------------
    async def get_json(self, request: web.Request, path: str) -> Any | None:
        """GET a JSON document from the upstream, or None (logged, counted) if it cannot be had."""
        try:
            timeout = aiohttp.ClientTimeout(total=LIST_TIMEOUT, connect=self.connect_timeout)
            async with self.session().get(self.url + path, timeout=timeout,
                                          headers={VIA: self.ident}) as r:
                if r.status != 200:
                    metrics.observe_upstream_error(request, "status")
                    log.warning("upstream %s%s answered %d", self.url, path, r.status)
                    return None
                return json.loads(await r.read())
        except TimeoutError:
            metrics.observe_upstream_error(request, "timeout")
            log.warning("upstream %s%s timed out", self.url, path)
        except (aiohttp.ClientError, OSError) as e:
            metrics.observe_upstream_error(request, _error_kind(e))
            log.warning("upstream %s%s unreachable: %s", self.url, path, e)
        except ValueError as e:
            metrics.observe_upstream_error(request, "other")
            log.warning("upstream %s%s sent bad JSON: %s", self.url, path, e)
        return None

    # -- forwarding ------------------------------------------------------------------------------
    async def forward(self, request: web.Request, body: bytes | None = None,
                      rewrite: Callable[[bytes], bytes] | None = None) -> web.StreamResponse:
        """Pass the request through and stream the answer back. `body`: the bytes, when a route
        already read them to find the model; otherwise the body is streamed up as it arrives.
        `rewrite`: edit the answer line by line (it then goes up uncompressed)."""
        seen = ",".join(request.headers.getall(VIA, []))
        if self.ident in seen:
            return error_for(request, 508, f"upstream {self.url} points back at this spec-sidecar; "
                                           "set upstream to the real Ollama's address")
        headers = forward_headers(request.headers.items())
        headers.add(VIA, self.ident)
        skip_auto = {h for h in (hdrs.USER_AGENT, hdrs.ACCEPT, hdrs.ACCEPT_ENCODING, hdrs.CONTENT_TYPE)
                     if h not in request.headers}
        if rewrite is not None:
            headers.popall(hdrs.ACCEPT_ENCODING, None)
            skip_auto.add(hdrs.ACCEPT_ENCODING)
        data: Any = None
        if body is not None:
            headers.popall(hdrs.CONTENT_LENGTH, None)  # aiohttp sets it from the bytes
            data = body
        elif request.body_exists:
            data = request.content.iter_chunked(CHUNK)
        url = URL(self.url + request.raw_path, encoded=True)
        try:
            up = await while_connected(request, self.session().request(
                request.method, url, headers=headers, data=data, allow_redirects=False,
                skip_auto_headers=skip_auto))
        except ClientGone:
            metrics.observe_client_disconnect(request, "proxy", None)
            return web.Response(status=499)  # nobody is listening; nginx's "client closed request"
        except TimeoutError:
            metrics.observe_upstream_error(request, "timeout")
            return error_for(request, 502, f"upstream {self.url} did not accept the connection in time")
        except (aiohttp.ClientError, OSError) as e:
            metrics.observe_upstream_error(request, _error_kind(e))
            return error_for(request, 502, f"upstream {self.url} is unreachable: {e}")
        try:
            return await self._relay(request, up, rewrite)
        finally:
            up.close()  # no-op after a full read; otherwise it drops the upstream connection

    async def _relay(self, request: web.Request, up: aiohttp.ClientResponse,
                     rewrite: Callable[[bytes], bytes] | None = None) -> web.StreamResponse:
        """Stream the upstream's answer back; `rewrite` edits it line by line (NDJSON, SSE)."""
        resp = web.StreamResponse(status=up.status, reason=up.reason)
        for k, v in forward_headers(up.headers.items()).items():
            resp.headers.add(k, v)
        if rewrite is not None:
            resp.headers.popall(hdrs.CONTENT_LENGTH, None)
        pending = b""
        try:
            await resp.prepare(request)
            while True:
                chunk = await while_connected(request, up.content.readany())
                if not chunk:
                    break
                if rewrite is not None:
                    *lines, pending = (pending + chunk).split(b"\n")
                    chunk = b"".join(rewrite(ln) + b"\n" for ln in lines)
                await resp.write(chunk)
            if rewrite is not None and pending:
                await resp.write(rewrite(pending))
            await resp.write_eof()
        except (ClientGone, ConnectionResetError):
            log.info("client went away; closing the upstream request %s %s", request.method, request.path)
            metrics.observe_client_disconnect(request, "proxy", None)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            # The upstream broke off mid-body: break off too, so the client sees a truncated
            # response rather than a complete-looking one.
            metrics.observe_upstream_error(request, _error_kind(e))
            log.warning("upstream %s broke off %s %s: %s", self.url, request.method, request.path, e)
            if request.transport is not None:
                request.transport.close()
        return resp


def tagged(name: str) -> str:
    """An Ollama name with its tag (`llama3` is `llama3:latest`), lowercased, for counting."""
    name = name.strip().lower()
    return name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"


def _json(raw: bytes) -> dict[str, Any]:
    """The body's object for routing, or {} (the handler, or the upstream, answers a bad body)."""
    try:
        v = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
        return {}
    return v if isinstance(v, dict) else {}


def _error_kind(e: BaseException) -> str:
    if isinstance(e, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return "connect"
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | ConnectionResetError):
        return "reset"
    return "other"


# -- app wiring ---------------------------------------------------------------------------------
UPSTREAM = web.AppKey("sidecar_upstream", Upstream)


def setup(app: web.Application, url: str | None, kind: UpstreamKind = "auto") -> None:
    if not url:
        return
    upstream = Upstream(url, kind)
    app[UPSTREAM] = upstream

    async def close(_: web.Application) -> None:
        await upstream.close()

    app.on_cleanup.append(close)
    log.info("forwarding what is not a pair to %s (%s)", upstream.url, kind)


def upstream_of(request: web.Request) -> Upstream | None:
    return request.app.get(UPSTREAM)


async def peek(request: web.Request) -> tuple[bytes, dict[str, Any]]:
    """The body's bytes (aiohttp keeps them for the handler) and its JSON object, or {}."""
    raw = await request.read()
    return raw, _json(raw)


def name_in(body: dict[str, Any], *keys: str) -> str | None:
    """The first of `keys` that holds a non-blank string in a request body."""
    for k in keys:
        v = body.get(k)
        if isinstance(v, str) and v.strip():
            return v
    return None


# -- routes ----------------------------------------------------------------------------------------
def pair_or_forward(handler: Handler, *keys: str) -> Handler:
    """Serve a model route locally for pairs (and when there is no upstream); forward otherwise.

    Requests without a usable model name stay local, so they get the sidecar's own validation
    errors, which are Ollama's."""
    keys = keys or ("model",)

    async def route(request: web.Request) -> web.StreamResponse:
        up = upstream_of(request)
        if up is None:
            return await handler(request)
        raw, body = await peek(request)
        name = name_in(body, *keys)
        if name is None or runtime_of(request).find(name) is not None:
            return await handler(request)
        if not request.path.startswith("/v1/") and await up.flavour() == "lmstudio":
            raise up.lmstudio_error(name)
        with up.forwarding(name):  # busy upstream: never unloaded to make room (api.neighbour)
            return await up.forward(request, raw)

    route.__name__ = route.__qualname__ = getattr(handler, "__name__", "route")
    return route


# The name fields of each model-management request (copy names two models).
MANAGED: dict[str, tuple[str, ...]] = {
    "/api/pull": ("model", "name"), "/api/push": ("model", "name"), "/api/create": ("model", "name"),
    "/api/copy": ("source", "destination"), "/api/delete": ("model", "name"),
}


async def manage(request: web.Request) -> web.StreamResponse:
    """pull/push/create/copy/delete: never for a pair (it lives in pairs.yaml), else forwarded."""
    raw, body = await peek(request)
    rt = runtime_of(request)
    keys = MANAGED[request.path]
    for k in keys:
        name = name_in(body, k)
        entry = rt.find(name) if name else None
        if entry is not None:
            raise ApiError(400, f"{entry.name} is a spec-sidecar pair; edit pairs.yaml")
    up = upstream_of(request)
    if up is None:
        name = name_in(body, keys[0]) or ""
        if request.path == "/api/delete":
            raise ApiError(404, f"model '{name}' not found")
        if request.path == "/api/copy":
            raise ApiError(404, f'model "{name}" not found')
        raise ApiError(501, f"{request.path} needs the real Ollama, and no upstream is configured "
                            "(set upstream: in pairs.yaml, --upstream or SIDECAR_UPSTREAM)")
    if await up.flavour() == "lmstudio":
        raise ApiError(501, f"the upstream at {up.url} is LM Studio, which has no {request.path}")
    return await up.forward(request, raw)


async def embeddings(request: web.Request) -> web.StreamResponse:
    """/api/embed, /api/embeddings, /v1/embeddings: pairs generate text only; the rest is forwarded."""
    raw, body = await peek(request)
    name = name_in(body, "model")
    if name is None:
        return error_for(request, 400, "model is required")
    entry = runtime_of(request).find(name)
    if entry is not None:
        return error_for(request, 400, f'"{entry.name}" does not support embeddings')
    up = upstream_of(request)
    if up is None:
        return error_for(request, 404, f'model "{name}" not found, try pulling it first')
    if not request.path.startswith("/v1/") and await up.flavour() == "lmstudio":
        return error_for(request, up.lmstudio_error(name).status, up.lmstudio_error(name).message)
    return await up.forward(request, raw)


def upstream_target(entry: PairEntry) -> str | None:
    """The pair's target as the upstream Ollama names it, if the target is an Ollama model (not a
    path, pkg: or lmstudio: reference)."""
    ref = entry.config.from_
    return ref if entry.config.engine == "llama.cpp" and is_ollama_name(ref) else None


def _same_model(a: str, b: str) -> bool:
    try:
        return [p.lower() for p in parse_ollama_name(a)] == [p.lower() for p in parse_ollama_name(b)]
    except ModelNotFound:
        return False


def _renamed(name: str, fallback: str) -> Callable[[bytes], bytes]:
    """An answer line (an NDJSON chunk, or an SSE `data:` line) under the pair's name; Ollama's
    final chunk also says why the pair did not run it (`fallback`)."""

    def rewrite(line: bytes) -> bytes:
        sse = line.startswith(b"data: ")
        text = line[6:] if sse else line
        if not text.strip().startswith(b"{"):
            return line
        obj = _json(text)
        if not obj:
            return line
        if "model" in obj:
            obj["model"] = name
        if not sse and obj.get("done") is True:
            obj["fallback"] = fallback
        out = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
        return b"data: " + out if sse else out

    return rewrite


async def images_upstream(request: web.Request, entry: PairEntry) -> web.StreamResponse | None:
    """A request with images for a pair whose target is one of the upstream Ollama's models: it
    runs there, without speculation (this daemon runs no vision model), and comes back under the
    pair's name with `fallback: "images"`. None where there is no such upstream model (the
    caller answers Ollama's 400). An unreachable upstream is the usual 502."""
    up = upstream_of(request)
    target = upstream_target(entry)
    if up is None or target is None or await up.flavour() != "ollama":
        return None
    tags = await up.get_json(request, "/api/tags")
    if tags is not None:
        names = [m.get("name", "") for m in tags.get("models", []) if isinstance(m, dict)]
        if not any(_same_model(target, n) for n in names):
            return None
    body = _json(await request.read())
    body["model"] = target
    log.info("%s: images go to the upstream's %s (no speculation)", entry.name, target)
    return await up.forward(request, json.dumps(body).encode(), _renamed(entry.name, "images"))


async def catch_all(request: web.Request) -> web.StreamResponse:
    """Every route the sidecar does not serve: forwarded, or gin's 404/405 without an upstream."""
    up = upstream_of(request)
    if up is None:
        raise await _miss(request)
    if request.path.startswith("/api/") and await up.flavour() == "lmstudio":
        raise ApiError(501, f"the upstream at {up.url} is LM Studio, which serves only the OpenAI-compatible "
                            f"/v1 API, not {request.path}")
    return await up.forward(request)


async def _miss(request: web.Request) -> web.HTTPException:
    """What the router would have said without the catch-all: 405 if another method fits."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource.canonical == CATCH_ALL:
            continue
        match, methods = await resource.resolve(request)
        if match is None:
            allowed |= methods
    if allowed:
        return web.HTTPMethodNotAllowed(request.method, allowed)
    return web.HTTPNotFound()


CATCH_ALL = "/{tail}"


def add_catch_all(app: web.Application) -> None:
    """Register last: aiohttp tries routes in order, and a method mismatch falls through to it."""
    app.router.add_route("*", "/{tail:.*}", catch_all)


def check_not_self(url: str | None, host: str, port: int) -> None:
    """Refuse an upstream that is the sidecar's own listen address (one exported OLLAMA_HOST away)."""
    if not url:
        return
    u = URL(url)
    if u.port != port:
        return
    local = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "::", ""}
    if u.host == host or (u.host in local and host in local):
        raise ValueError(f"upstream {url} is this sidecar's own address ({host or '*'}:{port}); "
                         "point it at the real Ollama (e.g. http://127.0.0.1:11435)")
