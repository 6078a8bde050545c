"""CORS and the DNS-rebinding Host check behave as Ollama's gin middlewares (ollama-api.md §13)."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable, Mapping

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from sidecar.api import guard

pytestmark = pytest.mark.pure

Factory = Callable[..., Awaitable[TestClient]]

ALLOWED_HEADERS = (
    "Authorization,Content-Type,User-Agent,Accept,X-Requested-With,Openai-Beta,X-Stainless-Arch,"
    "X-Stainless-Async,X-Stainless-Custom-Poll-Interval,X-Stainless-Helper-Method,X-Stainless-Lang,"
    "X-Stainless-Os,X-Stainless-Package-Version,X-Stainless-Poll-Helper,X-Stainless-Retry-Count,"
    "X-Stainless-Runtime,X-Stainless-Runtime-Version,X-Stainless-Timeout"
)


def make_app(bind_host: str = "127.0.0.1", env: Mapping[str, str] | None = None) -> web.Application:
    app = web.Application(middlewares=guard.middlewares(bind_host, env or {}))
    app.on_response_prepare.append(guard.on_response_prepare)

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await resp.write(b'{"done":true}\n')
        return resp

    async def missing(_: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    app.router.add_get("/", hello)
    app.router.add_post("/api/chat", stream)
    app.router.add_get("/gone", missing)
    return app


@pytest.fixture
async def client(aiohttp_client: Factory) -> TestClient:
    return await aiohttp_client(make_app())


# -- CORS -------------------------------------------------------------------------------------------
async def test_no_origin_passes_without_cors_headers(client: TestClient) -> None:
    r = await client.get("/")
    assert r.status == 200
    assert "Access-Control-Allow-Origin" not in r.headers


@pytest.mark.parametrize("origin", [
    "http://localhost", "https://localhost", "http://localhost:3000", "https://127.0.0.1:8080",
    "http://0.0.0.0:5173", "app://obsidian.md", "file://", "tauri://localhost", "vscode-webview://abc",
    "vscode-file://vscode-app",
])
async def test_default_origins_are_echoed(client: TestClient, origin: str) -> None:
    r = await client.get("/", headers={"Origin": origin})
    assert r.status == 200
    assert r.headers["Access-Control-Allow-Origin"] == origin
    assert r.headers.getall("Vary") == ["Origin"]


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "chrome-extension://abc", "http://127.0.0.2"])
async def test_foreign_origin_is_403_with_empty_body(client: TestClient, origin: str) -> None:
    for method, path in (("GET", "/"), ("POST", "/api/chat"), ("OPTIONS", "/api/chat")):
        r = await client.request(method, path, headers={"Origin": origin})
        assert r.status == 403, (method, origin)
        assert await r.read() == b""
        assert "Access-Control-Allow-Origin" not in r.headers


async def test_same_origin_fetch_is_not_cors(client: TestClient) -> None:
    host = f"{client.host}:{client.port}"
    # Not on the list, but equal to http://<Host>: a page served by the daemon itself.
    r = await client.get("/", headers={"Origin": f"http://{host}", "Host": host})
    assert r.status == 200
    assert "Access-Control-Allow-Origin" not in r.headers


async def test_preflight_is_204_with_ollamas_headers(client: TestClient) -> None:
    r = await client.options("/api/chat", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert r.status == 204
    assert await r.read() == b""
    h = r.headers
    assert h["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert h["Access-Control-Allow-Methods"] == "GET,POST,PUT,PATCH,DELETE,HEAD,OPTIONS"
    assert h["Access-Control-Allow-Headers"] == ALLOWED_HEADERS
    assert h["Access-Control-Max-Age"] == "43200"
    assert h.getall("Vary") == ["Origin", "Access-Control-Request-Method", "Access-Control-Request-Headers"]


async def test_streamed_and_error_responses_carry_cors_headers(client: TestClient) -> None:
    r = await client.post("/api/chat", headers={"Origin": "http://localhost:5173"}, data=b"{}")
    assert r.status == 200
    assert r.headers["Access-Control-Allow-Origin"] == "http://localhost:5173"
    assert await r.read() == b'{"done":true}\n'
    r = await client.get("/gone", headers={"Origin": "http://localhost:5173"})
    assert r.status == 404
    assert r.headers["Access-Control-Allow-Origin"] == "http://localhost:5173"


async def test_ollama_origins_adds_origins(aiohttp_client: Factory) -> None:
    env = {"OLLAMA_ORIGINS": "'https://app.example.com, chrome-extension://*,bad-origin'"}
    c = await aiohttp_client(make_app(env=env))
    for origin in ("https://app.example.com", "chrome-extension://abcdef", "http://localhost"):
        r = await c.get("/", headers={"Origin": origin})
        assert r.status == 200, origin
        assert r.headers["Access-Control-Allow-Origin"] == origin
    for origin in ("https://app.example.com.evil", "moz-extension://x", "bad-origin"):
        assert (await c.get("/", headers={"Origin": origin})).status == 403, origin


async def test_star_allows_every_origin(aiohttp_client: Factory) -> None:
    c = await aiohttp_client(make_app(env={"OLLAMA_ORIGINS": "*"}))
    r = await c.get("/", headers={"Origin": "https://anything.example"})
    assert r.status == 200
    assert r.headers["Access-Control-Allow-Origin"] == "*"
    assert "Vary" not in r.headers
    r = await c.options("/api/chat", headers={"Origin": "https://anything.example"})
    assert r.status == 204
    assert r.headers["Access-Control-Allow-Origin"] == "*"


def test_wildcard_matching_has_gins_semantics() -> None:
    p = guard.CorsPolicy.from_origins(["http://localhost:*", "*.example.org", "https://a.*.example.net",
                                       "https://UPPER.example", "two*stars*"])
    assert p.allows("http://localhost:1")
    assert p.allows("http://localhost:anything")  # gin-contrib/cors: a plain prefix match
    assert not p.allows("http://localhost.evil.com")
    assert p.allows("https://x.example.org")
    assert p.allows("https://a.b.example.net")
    assert p.allows("https://upper.example")  # the list is lower-cased, the Origin is not
    assert not p.allows("https://UPPER.example")
    assert not p.allows("twoXstarsY")  # refused entry


# -- Host header ------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", [
    "", "localhost", "localhost:11434", "LOCALHOST", "127.0.0.1", "127.0.0.1:11434", "[::1]:11434", "[::1]",
    "0.0.0.0", "10.1.2.3", "172.20.0.1:80", "192.168.1.10", "[fd00::1]:11434", "[::ffff:127.0.0.1]:1",
    "app.localhost", "printer.local", "svc.cluster.internal", socket.gethostname(),
])
async def test_local_hosts_pass(client: TestClient, host: str) -> None:
    r = await client.get("/", headers={"Host": host})
    assert r.status == 200, host


@pytest.mark.parametrize("host", ["evil.example", "evil.example:11434", "localhost.evil.com", "8.8.8.8", "224.0.0.1",
                                  "[2001:4860:4860::8888]:11434", "local", "internal.evil"])
async def test_foreign_hosts_are_403_on_loopback(client: TestClient, host: str) -> None:
    r = await client.get("/", headers={"Host": host})
    assert r.status == 403, host
    assert await r.read() == b""


async def test_options_to_a_named_local_host_is_204(client: TestClient) -> None:
    r = await client.options("/api/chat", headers={"Host": "localhost:11434"})
    assert r.status == 204
    r = await client.options("/api/chat", headers={"Host": "evil.example"})
    assert r.status == 403


@pytest.mark.parametrize("bind", ["", "0.0.0.0", "::", "192.168.1.10"])
async def test_non_loopback_listener_accepts_every_host(aiohttp_client: Factory, bind: str) -> None:
    c = await aiohttp_client(make_app(bind))
    r = await c.get("/", headers={"Host": "evil.example"})
    assert r.status == 200


def test_loopback_detection() -> None:
    assert guard.is_loopback_bind("127.0.0.1")
    assert guard.is_loopback_bind("127.1.2.3")
    assert guard.is_loopback_bind("::1")
    assert guard.is_loopback_bind("[::1]")
    assert guard.is_loopback_bind("localhost")
    assert not guard.is_loopback_bind("")
    assert not guard.is_loopback_bind("0.0.0.0")
    assert not guard.is_loopback_bind("::")


async def test_a_local_interface_address_is_allowed(client: TestClient) -> None:
    # 8.8.8.8 is not ours; an address this machine routes from is (when it has a non-private one).
    assert (await client.get("/", headers={"Host": "8.8.8.8"})).status == 403
    assert (await client.get("/", headers={"Host": "127.0.0.1:1"})).status == 200
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 53))  # no packet is sent; it only picks the outgoing address
            mine = s.getsockname()[0]
        except OSError:
            pytest.skip("no IPv4 route on this machine")
    assert guard.is_local_ip(guard._ip(mine))  # type: ignore[arg-type]
    assert (await client.get("/", headers={"Host": f"{mine}:11434"})).status == 200


async def test_cors_runs_before_the_host_check(client: TestClient) -> None:
    # Ollama's order: an allowed preflight is answered by CORS even for a foreign Host,
    # a foreign origin is refused before the Host is looked at.
    r = await client.options("/api/chat", headers={"Origin": "http://localhost:3000", "Host": "evil.example"})
    assert r.status == 204
    r = await client.get("/", headers={"Origin": "http://localhost:3000", "Host": "evil.example"})
    assert r.status == 403
