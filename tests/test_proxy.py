"""The upstream: what is not a pair reaches the real Ollama unchanged, streamed both ways.

Real processes: one `sidecar serve` with a different tiny model plays the upstream Ollama for
model routes (generate, chat, show, /v1), and the sidecar under test points at it. Routes a
sidecar does not have (pull, unknown streaming paths, blob uploads) go to a small aiohttp stub
running on a thread of this process, which records what it saw, disconnects included. LM Studio
and the no-upstream answers are checked in-process against the same app the daemon runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sidecar.api import ollama as ollama_api
from sidecar.api import proxy
from sidecar.api.app import create_app
from sidecar.config.entries import build_entry
from sidecar.config.schema import Pair, UpstreamKind
from sidecar.runtime.llamacpp import LlamaEngine
from sidecar.runtime.manager import Runtime
from tests.conftest import Daemon, free_port, write_config
from tests.models import write_tiny_llama

pytestmark = pytest.mark.daemon

GREEDY = {"temperature": 0, "num_predict": 12}
T = 120  # generous: the test machine is small and shared (and pairs run on one thread: tiny models, busy CPUs)


# -- the stub upstream ------------------------------------------------------------------------------
class Stub:
    """An aiohttp server on its own thread and event loop, so it outlives any one test's loop."""

    def __init__(self, app: web.Application) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._app = app
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        # handler_cancellation: a handler learns that its client (the sidecar) hung up.
        runner = web.AppRunner(self._app, handler_cancellation=True, access_log=None)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


PULL_STEPS = ["pulling manifest", "pulling 1", "pulling 2", "verifying sha256 digest", "success"]
PULL_GAP = 0.4


def ollama_stub(seen: dict[str, Any]) -> web.Application:
    """Ollama's management and listing routes, plus paths that stream or hang on purpose."""

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.99.1"})

    async def tags(_: web.Request) -> web.Response:
        details = {"format": "gguf", "family": "llama"}
        return web.json_response({"models": [
            {"name": "stubbed:latest", "model": "stubbed:latest", "size": 1, "digest": "ab", "details": details},
            {"name": "tiny:test", "model": "tiny:test", "size": 2, "digest": "cd", "details": details},
        ]})

    async def pull(request: web.Request) -> web.StreamResponse:
        seen["pull_body"] = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for i, status in enumerate(PULL_STEPS):
            if i:
                await asyncio.sleep(PULL_GAP)
            await resp.write(json.dumps({"status": status}).encode() + b"\n")
        return resp

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({
            "method": request.method, "path_qs": request.path_qs, "headers": list(request.headers.items()),
            "body": (await request.read()).decode(),
        }, status=207, headers={"X-Stub": "yes"})

    async def upload(request: web.Request) -> web.Response:
        h, n = hashlib.sha256(), 0
        async for chunk in request.content.iter_chunked(1 << 16):
            h.update(chunk)
            n += len(chunk)
        return web.json_response({"sha256": h.hexdigest(), "size": n,
                                  "transfer_encoding": request.headers.get("Transfer-Encoding"),
                                  "content_length": request.headers.get("Content-Length")}, status=201)

    async def slow(request: web.Request) -> web.StreamResponse:
        """Streams a line every 50 ms for a minute, unless the client leaves."""
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        try:
            for i in range(1200):
                await resp.write(json.dumps({"status": f"tick {i}"}).encode() + b"\n")
                await asyncio.sleep(0.05)
        except (ConnectionResetError, asyncio.CancelledError):
            seen["slow_gone"].set()
            raise
        return resp

    async def hold(request: web.Request) -> web.Response:
        """Answers nothing for a minute (a model loading), unless the client leaves."""
        seen["hold_started"].set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen["hold_gone"].set()
            raise
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/api/version", version)
    app.router.add_get("/api/tags", tags)
    app.router.add_post("/api/pull", pull)
    app.router.add_route("*", "/custom/{tail:.*}", echo)
    app.router.add_post("/api/blobs/{digest}", upload)
    app.router.add_post("/api/slow", slow)
    app.router.add_post("/api/hold", hold)
    return app


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def upstream_model(model_dir: Path) -> Path:
    return write_tiny_llama(model_dir / "upstream.gguf", seed=7)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory, upstream_model: Path) -> Iterator[Daemon]:
    """A second sidecar playing Ollama: models up:test and shadow:test (a name the pair shadows)."""
    d = tmp_path_factory.mktemp("upstream")
    cfg = write_config(d / "pairs.yaml", f"""
pairs:
  up:test:
    from: {upstream_model}
    parameters: {{temperature: 0, num_ctx: 256}}
    runtime: {{num_thread: 1}}
  shadow:test:
    from: {upstream_model}
    parameters: {{num_ctx: 256}}
    runtime: {{num_thread: 1}}
""")
    daemon = Daemon(cfg)
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory, tiny: Path, upstream: Daemon) -> Iterator[Daemon]:
    """The sidecar under test, its upstream set in pairs.yaml."""
    d = tmp_path_factory.mktemp("sidecar")
    cfg = write_config(d / "pairs.yaml", f"""
upstream: {upstream.url}
pairs:
  tiny:test:
    from: {tiny}
    parameters: {{temperature: 0, num_ctx: 256}}
    runtime: {{num_thread: 1}}
  shadow:test:
    from: {tiny}
    parameters: {{num_ctx: 256}}
    runtime: {{num_thread: 1}}
""")
    daemon = Daemon(cfg)
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    return {"slow_gone": threading.Event(), "hold_started": threading.Event(), "hold_gone": threading.Event()}


@pytest.fixture(scope="module")
def stub(seen: dict[str, Any]) -> Iterator[Stub]:
    s = Stub(ollama_stub(seen))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fronted(tmp_path_factory: pytest.TempPathFactory, tiny: Path, stub: Stub) -> Iterator[Daemon]:
    """A sidecar in front of the stub, its upstream set by SIDECAR_UPSTREAM (no scheme: http is implied)."""
    d = tmp_path_factory.mktemp("fronted")
    cfg = write_config(d / "pairs.yaml", f"""
upstream: http://127.0.0.1:9   # SIDECAR_UPSTREAM wins over this
pairs:
  tiny:test:
    from: {tiny}
    parameters: {{temperature: 0, num_ctx: 256}}
    runtime: {{num_thread: 1}}
""")
    daemon = Daemon(cfg, env={"SIDECAR_UPSTREAM": f"127.0.0.1:{stub.port}"})
    yield daemon
    daemon.stop()


# prompt_eval_count too: a repeated prompt is served from the prefix cache, which it does not count.
_VOLATILE = re.compile(
    rb'"(created_at|total_duration|load_duration|prompt_eval_count|prompt_eval_duration|eval_duration)":("[^"]*"|\d+)')


def normalised(body: bytes) -> list[bytes]:
    """NDJSON lines with timestamps, durations and evaluated prompt tokens blanked: what may differ
    between two runs."""
    assert body.endswith(b"\n")
    return [_VOLATILE.sub(rb'"\1":0', ln) for ln in body.split(b"\n")[:-1]]


# -- settings ----------------------------------------------------------------------------------------
def test_upstream_setting_precedence() -> None:
    env = {"SIDECAR_UPSTREAM": "http://env:1"}
    assert proxy.resolve_upstream("http://flag:1", env, "http://config:1") == "http://flag:1"
    assert proxy.resolve_upstream(None, env, "http://config:1") == "http://env:1"
    assert proxy.resolve_upstream(None, {}, "http://config:1") == "http://config:1"
    assert proxy.resolve_upstream(None, {}, None) is None
    assert proxy.resolve_upstream("", env, "http://config:1") is None  # an empty flag switches it off
    assert proxy.resolve_upstream(None, {}, "127.0.0.1:11435") == "http://127.0.0.1:11435"
    assert proxy.resolve_kind(None, {"SIDECAR_UPSTREAM_KIND": "LMStudio"}, None) == "lmstudio"
    assert proxy.resolve_kind("ollama", {"SIDECAR_UPSTREAM_KIND": "lmstudio"}, None) == "ollama"
    assert proxy.resolve_kind(None, {}, None) == "auto"
    with pytest.raises(ValueError, match="upstream kind"):
        proxy.resolve_kind("vllm", {}, None)
    with pytest.raises(ValueError, match="own address"):
        proxy.check_not_self("http://localhost:11434", "127.0.0.1", 11434)
    proxy.check_not_self("http://127.0.0.1:11435", "127.0.0.1", 11434)


def test_hop_by_hop_headers_are_dropped() -> None:
    h = proxy.forward_headers([("Host", "x"), ("Connection", "keep-alive, X-Private"), ("Keep-Alive", "5"),
                               ("X-Private", "1"), ("Transfer-Encoding", "chunked"), ("Authorization", "Bearer k"),
                               ("X-Custom", "a"), ("X-Custom", "b")])
    assert list(h.items()) == [("Authorization", "Bearer k"), ("X-Custom", "a"), ("X-Custom", "b")]


# -- model routes against a real sidecar upstream ----------------------------------------------------
@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_model_routes_forwarded_byte_for_byte(sidecar: Daemon, upstream: Daemon, path: str) -> None:
    body: dict[str, Any] = {"model": "up:test", "options": GREEDY}
    body.update({"prompt": "hello there"} if path == "/api/generate" else
                {"messages": [{"role": "user", "content": "hello there"}]})
    direct = httpx.post(upstream.url + path, json=body, timeout=T)
    via = httpx.post(sidecar.url + path, json=body, timeout=T)
    assert direct.status_code == via.status_code == 200
    assert via.headers["content-type"] == direct.headers["content-type"] == "application/x-ndjson"
    assert normalised(via.content) == normalised(direct.content)
    assert len(normalised(via.content)) > 2  # several chunks, then the final one
    for stream in (False,):
        one = httpx.post(sidecar.url + path, json={**body, "stream": stream}, timeout=T)
        ref = httpx.post(upstream.url + path, json={**body, "stream": stream}, timeout=T)
        assert normalised(one.content + b"\n") == normalised(ref.content + b"\n")


def test_show_and_errors_forwarded(sidecar: Daemon, upstream: Daemon) -> None:
    direct = httpx.post(upstream.url + "/api/show", json={"model": "up:test"}, timeout=T)
    via = httpx.post(sidecar.url + "/api/show", json={"name": "up:test"}, timeout=T)
    assert via.status_code == 200 and via.content == direct.content
    # The upstream's own errors come back as they are.
    for path, body in (("/api/generate", {"model": "nowhere:1", "prompt": "x"}),
                       ("/api/embed", {"model": "up:test", "input": "x"})):
        d = httpx.post(upstream.url + path, json=body, timeout=T)
        v = httpx.post(sidecar.url + path, json=body, timeout=T)
        assert (v.status_code, v.content) == (d.status_code, d.content) and v.status_code >= 400


def test_pairs_stay_local(sidecar: Daemon, tiny: Path) -> None:
    """shadow:test exists on both: the pair answers, and the upstream's model is not reachable by that name."""
    show = httpx.post(sidecar.url + "/api/show", json={"model": "shadow:test"}, timeout=T).json()
    assert show["details"]["speculative"]["target"] == str(tiny)
    a = httpx.post(sidecar.url + "/api/generate", json={"model": "shadow:test", "prompt": "p", "stream": False,
                                                        "options": GREEDY}, timeout=T).json()
    b = httpx.post(sidecar.url + "/api/generate", json={"model": "tiny:test", "prompt": "p", "stream": False,
                                                        "options": GREEDY}, timeout=T).json()
    assert a["response"] == b["response"]  # same file, same answer: served here


def test_merged_listings(sidecar: Daemon, upstream: Daemon, tiny: Path) -> None:
    httpx.post(upstream.url + "/api/generate", json={"model": "up:test", "prompt": "", "keep_alive": -1}, timeout=T)
    httpx.post(sidecar.url + "/api/generate", json={"model": "tiny:test", "prompt": "", "keep_alive": -1}, timeout=T)
    models = httpx.get(sidecar.url + "/api/tags", timeout=T).json()["models"]
    names = [m["name"] for m in models]
    assert sorted(names) == ["shadow:test", "tiny:test", "up:test"]  # shadow:test once: the pair
    shadow = next(m for m in models if m["name"] == "shadow:test")
    assert shadow["details"]["speculative"]["target"] == str(tiny)
    ps = [m["name"] for m in httpx.get(sidecar.url + "/api/ps", timeout=T).json()["models"]]
    assert "tiny:test" in ps and "up:test" in ps
    ids = [m["id"] for m in httpx.get(sidecar.url + "/v1/models", timeout=T).json()["data"]]
    assert sorted(ids) == ["shadow:test", "tiny:test", "up:test"]
    assert httpx.get(sidecar.url + "/api/version", timeout=T).json()["version"]


def test_openai_client_for_an_upstream_model(sidecar: Daemon, upstream: Daemon) -> None:
    """/v1 for a model that is not a pair goes up; the answer is the upstream's greedy text."""
    client = openai.OpenAI(base_url=sidecar.url + "/v1", api_key="unused", timeout=T)
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="up:test", messages=msgs, max_tokens=8, temperature=0)
    native = httpx.post(upstream.url + "/api/chat", timeout=T, json={
        "model": "up:test", "messages": msgs, "stream": False, "options": {"temperature": 0, "num_predict": 8}}).json()
    assert r.choices[0].message.content == native["message"]["content"]
    assert client.models.retrieve("up:test").id == "up:test"
    streamed = client.completions.create(model="up:test", prompt="hi", max_tokens=4, temperature=0, stream=True)
    assert len([c for c in streamed if c.choices]) >= 2


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/api/pull", {"model": "tiny:test"}),
    ("POST", "/api/push", {"name": "TINY:test"}),
    ("POST", "/api/create", {"model": "Shadow:Test", "from": "x"}),
    ("POST", "/api/copy", {"source": "up:test", "destination": "tiny:test"}),
    ("DELETE", "/api/delete", {"model": "shadow:test"}),
])
def test_model_management_of_a_pair_is_refused(sidecar: Daemon, method: str, path: str, body: dict) -> None:
    r = httpx.request(method, sidecar.url + path, json=body, timeout=T)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert "is a spec-sidecar pair; edit pairs.yaml" in r.json()["error"]


# -- other routes, against the stub --------------------------------------------------------------
def test_pull_streams_line_by_line(fronted: Daemon, seen: dict[str, Any]) -> None:
    arrivals: list[tuple[float, dict]] = []
    t0 = time.monotonic()
    with httpx.stream("POST", fronted.url + "/api/pull", json={"model": "llama3.2", "stream": True}, timeout=T) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        for ln in r.iter_lines():
            arrivals.append((time.monotonic() - t0, json.loads(ln)))
    assert [a[1]["status"] for a in arrivals] == PULL_STEPS
    assert seen["pull_body"] == {"model": "llama3.2", "stream": True}
    # Each line came when the upstream wrote it, not all at the end.
    assert arrivals[-1][0] - arrivals[0][0] >= (len(PULL_STEPS) - 1) * PULL_GAP * 0.8


def test_request_and_response_pass_through(fronted: Daemon, stub: Stub) -> None:
    r = httpx.put(fronted.url + "/custom/thing?x=1&y=a%20b", content=b"raw body \x00 bytes", timeout=T,
                  headers={"X-Custom": "one", "Authorization": "Bearer secret", "Content-Type": "text/weird",
                           "Connection": "keep-alive, X-Private", "X-Private": "hop", "Keep-Alive": "timeout=5"})
    assert r.status_code == 207 and r.headers["x-stub"] == "yes"
    echo = r.json()
    headers = {k.lower(): v for k, v in echo["headers"]}
    assert echo["method"] == "PUT" and echo["path_qs"] == "/custom/thing?x=1&y=a%20b"
    assert echo["body"] == "raw body \x00 bytes"
    assert headers["x-custom"] == "one" and headers["authorization"] == "Bearer secret"
    assert headers["content-type"] == "text/weird"
    assert headers["host"] == f"127.0.0.1:{stub.port}"
    assert "x-private" not in headers and "keep-alive" not in headers


def test_upload_streams_up(fronted: Daemon) -> None:
    blob = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MB

    def pieces() -> Iterator[bytes]:
        for i in range(0, len(blob), 100_000):
            yield blob[i:i + 100_000]

    want = hashlib.sha256(blob).hexdigest()
    r = httpx.post(fronted.url + f"/api/blobs/sha256:{want}", content=pieces(), timeout=T)  # chunked
    assert r.status_code == 201
    assert r.json() == {"sha256": want, "size": len(blob), "transfer_encoding": "chunked", "content_length": None}
    r = httpx.post(fronted.url + f"/api/blobs/sha256:{want}", content=blob, timeout=T)  # with a length
    assert r.json()["content_length"] == str(len(blob)) and r.json()["sha256"] == want


def test_version_and_tags_from_the_stub(fronted: Daemon) -> None:
    assert httpx.get(fronted.url + "/api/version", timeout=T).json() == {"version": "0.99.1"}
    names = [m["name"] for m in httpx.get(fronted.url + "/api/tags", timeout=T).json()["models"]]
    assert names == ["tiny:test", "stubbed:latest"]


def test_client_disconnect_closes_the_upstream_stream(fronted: Daemon, seen: dict[str, Any]) -> None:
    with httpx.stream("POST", fronted.url + "/api/slow", json={}, timeout=T) as r:
        lines = r.iter_lines()
        assert json.loads(next(lines))["status"] == "tick 0"
        next(lines)
    assert seen["slow_gone"].wait(10), "the upstream kept streaming to nobody"


def test_client_disconnect_before_the_upstream_answers(fronted: Daemon, seen: dict[str, Any]) -> None:
    with socket.create_connection(("127.0.0.1", fronted.port), timeout=T) as s:
        s.sendall(b"POST /api/hold HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}")
        assert seen["hold_started"].wait(30)
    assert seen["hold_gone"].wait(10), "the upstream request outlived its client"


def test_upstream_down(tmp_path: Path, tiny: Path) -> None:
    cfg = write_config(tmp_path / "pairs.yaml", f"""
upstream: http://127.0.0.1:{free_port()}
pairs:
  tiny:test:
    from: {tiny}
    parameters: {{temperature: 0, num_ctx: 256}}
    runtime: {{num_thread: 1}}
""")
    d = Daemon(cfg)
    try:
        r = httpx.post(d.url + "/api/chat", json={"model": "llama3.2", "messages": []}, timeout=T)
        assert r.status_code == 502 and r.headers["content-type"].startswith("application/json")
        assert "unreachable" in r.json()["error"]
        r = httpx.post(d.url + "/v1/chat/completions", timeout=T,
                       json={"model": "llama3.2", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 502 and r.json()["error"]["type"] == "api_error"
        assert httpx.get(d.url + "/api/other", timeout=T).status_code == 502
        # What the sidecar serves itself keeps working.
        assert [m["name"] for m in httpx.get(d.url + "/api/tags", timeout=T).json()["models"]] == ["tiny:test"]
        assert httpx.get(d.url + "/api/version", timeout=T).json()["version"]
        ok = httpx.post(d.url + "/api/generate", json={"model": "tiny:test", "prompt": "x", "stream": False,
                                                       "options": {"num_predict": 2}}, timeout=T)
        assert ok.status_code == 200 and ok.json()["done"]
    finally:
        d.stop()


# -- in-process: LM Studio upstream, and no upstream at all ----------------------------------------
Factory = Callable[..., Awaitable[TestClient]]


def app_with(tiny: Path, upstream: str | None = None, kind: UpstreamKind = "auto") -> web.Application:
    rt = Runtime(LlamaEngine())
    rt.set_entries({"tiny:test": build_entry("tiny:test", Pair.model_validate({"from": str(tiny)}))})
    return create_app(rt, upstream=upstream, upstream_kind=kind)


def lmstudio_stub() -> web.Application:
    """LM Studio: /v1 only, and 200 {"error": "Unexpected endpoint..."} for everything else."""

    async def unexpected(request: web.Request) -> web.Response:
        return web.json_response({"error": f"Unexpected endpoint or method. ({request.method} {request.path})"})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "qwen2.5-coder-7b-instruct", "object": "model", "owned_by": "organization_owner"}]})

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"id": "chatcmpl-lms", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "from lms"},
                                               "finish_reason": "stop"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_route("*", "/{tail:.*}", unexpected)
    return app


async def test_lmstudio_upstream(aiohttp_client: Factory, tiny: Path) -> None:
    lms = TestServer(lmstudio_stub())
    await lms.start_server()
    try:
        client = await aiohttp_client(app_with(tiny, str(lms.make_url(""))))
        r = await client.get("/v1/models")
        assert [m["id"] for m in (await r.json())["data"]] == ["tiny:test", "qwen2.5-coder-7b-instruct"]
        r = await client.post("/v1/chat/completions", json={
            "model": "qwen2.5-coder-7b-instruct", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "from lms"
        r = await client.post("/api/chat", json={"model": "qwen2.5-coder-7b-instruct", "messages": []})
        assert r.status == 501 and "LM Studio" in (await r.json())["error"] and "/v1" in (await r.json())["error"]
        r = await client.get("/api/tags")
        assert [m["name"] for m in (await r.json())["models"]] == ["tiny:test"]
        r = await client.get("/api/version")
        assert (await r.json())["version"] == ollama_api.OLLAMA_VERSION  # LM Studio has none: ours
    finally:
        await lms.close()


async def test_no_upstream(aiohttp_client: Factory, tiny: Path) -> None:
    client = await aiohttp_client(app_with(tiny))
    r = await client.post("/api/generate", json={"model": "llama3.2", "prompt": "x"})
    assert r.status == 404 and (await r.json())["error"] == "model 'llama3.2' not found"
    r = await client.get("/api/nothing-here")
    assert r.status == 404 and await r.text() == "404 page not found"
    r = await client.get("/api/generate")
    assert r.status == 405 and await r.text() == "405 method not allowed"
    r = await client.post("/v1/chat/completions", json={"model": "x:1", "messages": [{"role": "user", "content": ""}]})
    assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
    r = await client.post("/api/pull", json={"model": "tiny:test"})
    assert r.status == 400 and "spec-sidecar pair" in (await r.json())["error"]
    r = await client.post("/api/pull", json={"model": "llama3.2"})
    assert r.status == 501 and "upstream" in (await r.json())["error"]
    r = await client.delete("/api/delete", json={"model": "llama3.2"})
    assert r.status == 404 and (await r.json())["error"] == "model 'llama3.2' not found"
    r = await client.post("/api/embed", json={"model": "tiny:test", "input": "x"})
    assert r.status == 400 and "does not support embeddings" in (await r.json())["error"]


async def test_forwarding_loop_is_refused(aiohttp_client: Factory, tiny: Path) -> None:
    """A request this sidecar already forwarded once has come back: the upstream is the sidecar itself."""
    app = app_with(tiny, "http://127.0.0.1:9")
    client = await aiohttp_client(app)
    r = await client.get("/api/whatever", headers={proxy.VIA: f"other,{app[proxy.UPSTREAM].ident}"})
    assert r.status == 508 and "points back at this spec-sidecar" in (await r.json())["error"]
