"""Hostile-input guards in front of every route: CORS and the DNS-rebinding Host check, as Ollama.

A web page the user happens to visit can send requests to 127.0.0.1:11434. Ollama answers that
with two gin middlewares, in this order, and so do we (ollama-api.md §13):

1. CORS (gin-contrib/cors v1.7 with Ollama's config): requests whose `Origin` is not allowed get
   403 with an empty body; allowed preflights get 204; allowed origins are echoed back in
   `Access-Control-Allow-Origin` (or `*` when OLLAMA_ORIGINS contains `*`).
2. The Host check, only when listening on loopback: a DNS-rebinding page reaches 127.0.0.1
   under its own name (`Host: evil.example`), so only local names and local/private IPs pass.

Matching reproduces gin-contrib/cors exactly, quirks included (one `*` per origin, prefix/suffix
matching, `http://localhost:*` matching any origin that starts with `http://localhost:`), so a
browser app that works against Ollama works against the sidecar, and nothing more does.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import hdrs, web

log = logging.getLogger("sidecar.api.guard")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# gin-contrib/cors DefaultConfig().AllowMethods (v1.7.x) and Ollama's AllowHeaders, in order.
ALLOW_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
ALLOW_HEADERS = (
    "Authorization", "Content-Type", "User-Agent", "Accept", "X-Requested-With",
    "OpenAI-Beta", "x-stainless-arch", "x-stainless-async", "x-stainless-custom-poll-interval",
    "x-stainless-helper-method", "x-stainless-lang", "x-stainless-os", "x-stainless-package-version",
    "x-stainless-poll-helper", "x-stainless-retry-count", "x-stainless-runtime",
    "x-stainless-runtime-version", "x-stainless-timeout",
)
MAX_AGE = 12 * 3600
# gin-contrib/cors accepts an origin without '*' only with one of these schemes (browser extensions on).
ALLOWED_SCHEMES = ("http://", "https://", "chrome-extension://", "safari-extension://", "moz-extension://",
                   "ms-browser-extension://")

# Request key for the headers an allowed cross-origin request gets (RequestKey: aiohttp >= 3.12).
CORS_HEADERS: Any = web.RequestKey("sidecar_cors_headers", list) if hasattr(web, "RequestKey") else "sidecar.cors"


def _canonical(name: str) -> str:
    """Go's http.CanonicalHeaderKey: 'x-stainless-os' -> 'X-Stainless-Os', 'OpenAI-Beta' -> 'Openai-Beta'."""
    return "-".join(p[:1].upper() + p[1:].lower() for p in name.split("-"))


def _dedup_lower(values: Iterable[str]) -> list[str]:
    out: list[str] = []
    for v in values:
        v = v.strip().lower()
        if v not in out:
            out.append(v)
    return out


def default_origins(env: Mapping[str, str] | None = None) -> list[str]:
    """envconfig.AllowedOrigins(): OLLAMA_ORIGINS, then the local and app origins Ollama always allows."""
    env = os.environ if env is None else env
    raw = env.get("OLLAMA_ORIGINS", "").strip().strip("\"'")
    origins = [o.strip() for o in raw.split(",") if o.strip()] if raw else []
    for host in ("localhost", "127.0.0.1", "0.0.0.0"):
        origins += [f"http://{host}", f"https://{host}", f"http://{host}:*", f"https://{host}:*"]
    origins += ["app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*"]
    return origins


@dataclass
class CorsPolicy:
    """Origin matching and response headers, computed once from the origin list."""

    origins: list[str]
    allow_all: bool = False
    exact: list[str] = field(default_factory=list)
    wildcards: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def from_origins(cls, origins: Iterable[str]) -> CorsPolicy:
        kept: list[str] = []
        for o in origins:
            # Ollama panics at start on these; a daemon that refuses one bad entry is kinder.
            if "*" not in o and not o.startswith(ALLOWED_SCHEMES):
                log.warning("OLLAMA_ORIGINS: ignoring %r: an origin needs a '*' or one of %s", o,
                            ", ".join(ALLOWED_SCHEMES))
                continue
            if o.count("*") > 1:
                log.warning("OLLAMA_ORIGINS: ignoring %r: only one '*' is allowed", o)
                continue
            kept.append(o)
        p = cls(kept, allow_all="*" in kept, exact=_dedup_lower(kept))
        for o in kept:
            i = o.find("*")
            if i < 0:
                continue
            if i == 0:
                p.wildcards.append(("*", o[1:]))
            elif i == len(o) - 1:
                p.wildcards.append((o[:i], "*"))
            else:
                p.wildcards.append((o[:i], o[i + 1 :]))
        return p

    def allows(self, origin: str) -> bool:
        if self.allow_all or origin in self.exact:
            return True
        for pre, suf in self.wildcards:
            if pre == "*" and origin.endswith(suf):
                return True
            if suf == "*" and origin.startswith(pre):
                return True
            if origin.startswith(pre) and origin.endswith(suf):
                return True
        return False

    def preflight_headers(self, origin: str) -> list[tuple[str, str]]:
        h = [
            ("Access-Control-Allow-Methods", ",".join(m.upper() for m in _dedup_lower(ALLOW_METHODS))),
            ("Access-Control-Allow-Headers", ",".join(_canonical(x) for x in _dedup_lower(ALLOW_HEADERS))),
            ("Access-Control-Max-Age", str(MAX_AGE)),
        ]
        if self.allow_all:
            return [*h, ("Access-Control-Allow-Origin", "*")]
        return [*h, ("Vary", "Origin"), ("Vary", "Access-Control-Request-Method"),
                ("Vary", "Access-Control-Request-Headers"), ("Access-Control-Allow-Origin", origin)]

    def normal_headers(self, origin: str) -> list[tuple[str, str]]:
        if self.allow_all:
            return [("Access-Control-Allow-Origin", "*")]
        return [("Vary", "Origin"), ("Access-Control-Allow-Origin", origin)]


def _apply(headers: list[tuple[str, str]], target: web.StreamResponse | web.HTTPException) -> None:
    out = target.headers
    for k, _ in headers:
        out.popall(k, None)
    for k, v in headers:
        out.add(k, v)


def cors_middleware(policy: CorsPolicy) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    @web.middleware
    async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get(hdrs.ORIGIN, "")
        if not origin:
            return await handler(request)
        host = request.headers.get(hdrs.HOST, "")
        if origin in (f"http://{host}", f"https://{host}"):  # same-origin fetch(): not CORS
            return await handler(request)
        if not policy.allows(origin):
            return web.Response(status=403)
        if request.method == hdrs.METH_OPTIONS:
            preflight = web.Response(status=204)
            _apply(policy.preflight_headers(origin), preflight)
            return preflight
        headers = policy.normal_headers(origin)
        request[CORS_HEADERS] = headers  # for streamed responses, see on_response_prepare
        try:
            resp = await handler(request)
        except web.HTTPException as e:
            _apply(headers, e)
            raise
        if not resp.prepared:
            _apply(headers, resp)
        return resp

    return cors


async def on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Put the CORS headers on responses a handler streams (prepared before the middleware sees them)."""
    headers = request.get(CORS_HEADERS)
    if headers:
        _apply(headers, response)


# -- Host header --------------------------------------------------------------------------------
_GO_PRIVATE = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"))


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # Go's netip unmaps ::ffff:a.b.c.d for these checks
    return ip


def is_local_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Is the address assigned to an interface of this machine? Binding to it succeeds only then.

    (Ollama walks net.Interfaces(); a bind needs no netlink, which RestrictAddressFamilies may forbid.)"""
    if ip.is_multicast:
        return False  # Linux lets UDP sockets bind to group addresses; they are no interface's
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))
        return True
    except OSError:
        return False


def _host_only(host_header: str) -> str:
    """net.SplitHostPort's host, else the whole value. One leniency: a bare "[::1]" (no port) is ::1,
    where Ollama would refuse it; it is a loopback address either way."""
    h = host_header
    if h.startswith("["):
        end = h.find("]")
        if end > 0 and (end == len(h) - 1 or h[end + 1] == ":"):
            return h[1:end]
        return h
    if h.count(":") == 1:
        return h.split(":", 1)[0]
    return h


def allowed_host(host: str, hostname: str | None = None) -> bool:
    """Ollama's allowedHost(): empty, localhost, this machine's name, *.localhost, *.local, *.internal."""
    host = host.lower()
    if host in ("", "localhost"):
        return True
    name = socket.gethostname() if hostname is None else hostname
    if name and host == name.lower():
        return True
    return host.endswith((".localhost", ".local", ".internal"))


def _ip_allowed(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Go's netip IsLoopback || IsPrivate || IsUnspecified, or an address of this machine."""
    return ip.is_loopback or ip.is_unspecified or any(ip in n for n in _GO_PRIVATE) or is_local_ip(ip)


def is_loopback_bind(bind_host: str) -> bool:
    """Is the listener on a loopback address? ("" and "0.0.0.0" are every interface: no.)"""
    h = bind_host.strip("[]")
    ip = _ip(h)
    if ip is not None:
        return ip.is_loopback
    if not h:
        return False
    try:
        infos = socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return h.lower() == "localhost"
    return any((a := _ip(str(info[4][0]).split("%", 1)[0])) is not None and a.is_loopback for info in infos)


def host_middleware(hostname: str | None = None) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """Ollama's allowedHostsMiddleware for a loopback listener: 403 for foreign Host names."""

    @web.middleware
    async def host_check(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = _host_only(request.headers.get(hdrs.HOST, ""))
        ip = _ip(host.split("%", 1)[0])
        if ip is not None and _ip_allowed(ip):
            return await handler(request)
        if allowed_host(host, hostname):
            if request.method == hdrs.METH_OPTIONS:
                return web.Response(status=204)
            return await handler(request)
        return web.Response(status=403)

    return host_check


def middlewares(bind_host: str, env: Mapping[str, str] | None = None) -> list:
    """CORS first, then (only when bound to loopback) the Host check, as Ollama orders them.

    Register `on_response_prepare` on the app too, so streamed responses carry the CORS headers."""
    out: list = [cors_middleware(CorsPolicy.from_origins(default_origins(env)))]
    if is_loopback_bind(bind_host):
        out.append(host_middleware())
    return out
