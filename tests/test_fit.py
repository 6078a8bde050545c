"""Fitting the machine with real parts: a pair too big is refused at once, every num_ctx a client
can send works, and a load that needs room evicts idle models (the daemon's own, then the upstream
Ollama's, as an Ollama-shaped stub records) but never a busy one."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sidecar.api.app import create_app
from sidecar.config.entries import build_entry
from sidecar.config.schema import Pair
from sidecar.runtime.llamacpp import LlamaEngine
from sidecar.runtime.manager import Runtime
from sidecar.runtime.memory import GIB, human, ram_available
from tests.conftest import REPO, SMOLLM2_REF, Daemon, write_config
from tests.models import write_tiny_llama
from tests.sparse import LLAMA_8B, LLAMA_70B, write_model

pytestmark = pytest.mark.daemon

Factory = Callable[..., Awaitable[TestClient]]


@pytest.fixture(scope="module")
def seed_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The seed's pair as sparse files: Llama-3.1-70B Q4_K_M and Llama-3.1-8B Q4_K_M shapes."""
    d = tmp_path_factory.mktemp("seed")
    return write_model(d / "llama70b.gguf", LLAMA_70B, "70b"), write_model(d / "llama8b.gguf", LLAMA_8B, "8b")


def seed_config(d: Path, seed_pair: tuple[Path, Path]) -> Path:
    return write_config(d / "pairs.yaml", f"""
pairs:
  smollm2:135m:
    from: {SMOLLM2_REF}
    draft: ngram
    parameters: {{temperature: 0, num_ctx: 512, num_predict: 4}}
    runtime: {{num_thread: 1}}
  llama3.1:70b-spec:
    from: {seed_pair[0]}
    draft:
      from: {seed_pair[1]}
    parameters: {{num_ctx: 4096}}
""")


# -- refusing what cannot fit ------------------------------------------------------------------
@pytest.fixture(scope="module")
def seed_daemon(tmp_path_factory: pytest.TempPathFactory, seed_pair: tuple[Path, Path]) -> Iterator[Daemon]:
    daemon = Daemon(seed_config(tmp_path_factory.mktemp("refuse"), seed_pair))
    yield daemon
    daemon.stop()


@pytest.mark.skipif(ram_available() > 50 * GIB, reason="this machine could hold the 70B's plan in RAM")
def test_a_pair_too_big_is_refused_at_once(seed_daemon: Daemon) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for path, body in (("/api/generate", {"prompt": "hi"}), ("/api/chat", chat)):
        for stream in (False, True):
            t0 = time.monotonic()
            r = httpx.post(seed_daemon.url + path, json={"model": "llama3.1:70b-spec", "stream": stream, **body},
                           timeout=30)
            took = time.monotonic() - t0
            assert r.status_code == 500, r.text  # Ollama's status for a model it cannot load
            error = r.json()["error"]
            assert error.startswith("model requires more system memory (") and ") than is available (" in error
            assert took < 1.0, took
    # ... and everything else is still served
    r = httpx.post(seed_daemon.url + "/api/generate", timeout=120,
                   json={"model": "smollm2:135m", "prompt": "Hello", "stream": False})
    assert r.status_code == 200 and r.json()["done"]
    assert "model requires more system memory" in seed_daemon.log()
    assert not seed_daemon.traces()


def test_check_prints_the_plan_for_a_24_gib_card(tmp_path: Path, seed_pair: tuple[Path, Path]) -> None:
    cfg = seed_config(tmp_path, seed_pair)
    run = subprocess.run([sys.executable, "-m", "sidecar.cli", "check", "--config", str(cfg), "--gpu-memory", "24GiB"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    out = run.stdout
    assert "memory plan: GPU0 24.0 GiB free of 24.0 GiB (--gpu-memory); RAM " in out, out + run.stderr
    assert "draft  llama8b.gguf: 33/33 layers on GPU (33 on GPU0)" in out
    assert "target llama70b.gguf: " in out and "/81 layers on GPU" in out
    as_json = subprocess.run([sys.executable, "-m", "sidecar.cli", "check", "--config", str(cfg), "--gpu-memory",
                              "24GiB", "--json"], capture_output=True, text=True, timeout=120, cwd=REPO)
    plans = json.loads(as_json.stdout)
    big = plans["llama3.1:70b-spec"]
    assert big["draft"]["gpu_layers"] == big["draft"]["layers"] == 33
    assert 0 < big["target"]["gpu_layers"] < big["target"]["layers"] == 81
    assert big["target"]["vram_bytes"] + big["draft"]["vram_bytes"] <= 23 * GIB
    assert isinstance(big["fits"], bool) and (big["fits"] or big["reason"].startswith("model requires more system"))
    small = plans["smollm2:135m"]
    assert small["fits"] and small["draft"] is None and small["target"]["gpu_layers"] == small["target"]["layers"]


# -- every num_ctx -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The daemon on the bundled pairs.yaml, as `sidecar serve` runs it out of the box."""
    d = tmp_path_factory.mktemp("bundled")
    cfg = write_config(d / "pairs.yaml", (REPO / "sidecar" / "pairs.yaml").read_text())
    daemon = Daemon(cfg)
    yield daemon
    daemon.stop()


@pytest.mark.parametrize("num_ctx", [0, 1, 32, 64])
def test_every_num_ctx_works(bundled: Daemon, num_ctx: int) -> None:
    """0 is the pair's default (Ollama's); a window too small to run is raised to the minimum."""
    for path, body in (("/api/generate", {"prompt": "Say hi"}),
                       ("/api/chat", {"messages": [{"role": "user", "content": "Say hi"}]})):
        for stream in (False, True):
            r = httpx.post(bundled.url + path, timeout=120, json={
                "model": "smollm2:135m", "stream": stream, "options": {"num_ctx": num_ctx, "num_predict": 3}, **body})
            assert r.status_code == 200, (path, stream, r.text)
            last = json.loads(r.text.strip().splitlines()[-1])
            assert last["done"] and "error" not in last
    ps = httpx.get(bundled.url + "/api/ps").json()["models"]
    assert ps[0]["context_length"] == (4096 if num_ctx == 0 else 256)
    if num_ctx:
        assert f"num_ctx {num_ctx} is too small to run; raised to 256" in bundled.log()
    assert not bundled.traces()


# -- eviction --------------------------------------------------------------------------------------
class Upstream:
    """An Ollama-shaped upstream: /api/ps lists what it holds, /api/generate with keep_alive 0
    unloads (recorded), a generate for `busy` holds its answer until released."""

    def __init__(self) -> None:
        now = time.time()
        soon = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(now + 60))
        later = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(now + 300))
        self.loaded: dict[str, dict[str, Any]] = {
            "busy:latest": {"name": "busy:latest", "model": "busy:latest", "size": 9 * GIB, "size_vram": 9 * GIB,
                            "expires_at": soon},  # soonest expiry: first in line, but a request runs on it
            "idle:latest": {"name": "idle:latest", "model": "idle:latest", "size": 8 * GIB, "size_vram": 8 * GIB,
                            "expires_at": later},
            "pinned:latest": {"name": "pinned:latest", "model": "pinned:latest", "size": 7 * GIB, "size_vram": 7 * GIB,
                              "expires_at": "2318-08-27T00:00:00.000000+00:00"},
        }
        self.calls: list[tuple[str, str]] = []
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    def app(self) -> web.Application:
        async def version(_: web.Request) -> web.Response:
            return web.json_response({"version": "0.12.0"})

        async def ps(_: web.Request) -> web.Response:
            self.calls.append(("ps", ""))
            return web.json_response({"models": list(self.loaded.values())})

        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            name = body["model"] if ":" in body["model"] else body["model"] + ":latest"
            if body.get("keep_alive") == 0 and not body.get("prompt"):
                self.calls.append(("unload", name))
                self.loaded.pop(name, None)
                return web.json_response({"model": name, "done": True, "done_reason": "unload"})
            self.started.set()
            await self.release.wait()
            return web.json_response({"model": name, "response": "ok", "done": True})

        app = web.Application()
        app.router.add_get("/api/version", version)
        app.router.add_get("/api/ps", ps)
        app.router.add_post("/api/generate", generate)
        return app


def tiny_entry(path: Path, name: str) -> Any:
    return build_entry(name, Pair.model_validate({"from": str(path), "runtime": {"num_thread": 1},
                                                  "parameters": {"num_ctx": 256, "num_predict": 2}}))


async def test_idle_upstream_models_are_unloaded_before_a_load_that_needs_room(
        aiohttp_client: Factory, tiny: Path) -> None:
    stub = Upstream()
    server = TestServer(stub.app())
    await server.start_server()
    rt = Runtime(LlamaEngine())
    rt.set_entries({"tiny:test": tiny_entry(tiny, "tiny:test")})
    rt.ram = lambda: 1 << 20  # 1 MiB free: the tiny pair fits only once an upstream model is gone
    client = await aiohttp_client(create_app(rt, upstream=str(server.make_url(""))))
    try:
        busy = asyncio.ensure_future(client.post("/api/generate", json={"model": "busy", "prompt": "x"}))
        await asyncio.wait_for(stub.started.wait(), 10)
        r = await client.post("/api/generate", json={"model": "tiny:test", "prompt": "hi", "stream": False})
        assert r.status == 200, await r.text()
        assert ("ps", "") in stub.calls
        assert ("unload", "idle:latest") in stub.calls
        unloaded = stub.calls.index(("unload", "idle:latest"))
        assert ("ps", "") in stub.calls[unloaded:]  # the load waited until the upstream had dropped it
        assert ("unload", "busy:latest") not in stub.calls  # serving a request through the daemon
        assert ("unload", "pinned:latest") not in stub.calls  # its idle neighbour made room first
        stub.release.set()
        assert (await busy).status == 200
        # /api/ps: Ollama's size and size_vram, from the load's plan (all of it in RAM here)
        ps = await (await client.get("/api/ps")).json()
        ours = next(m for m in ps["models"] if m["name"] == "tiny:test")
        plan = rt.loaded_entries()[0][1].plan
        assert plan is not None and ours["size"] == plan.total > 0 and ours["size_vram"] == 0
    finally:
        stub.release.set()
        await server.close()
        await rt.unload_all()


async def test_nothing_busy_is_evicted_and_no_room_is_a_clear_error(aiohttp_client: Factory, tiny: Path) -> None:
    stub = Upstream()
    del stub.loaded["idle:latest"]
    server = TestServer(stub.app())
    await server.start_server()
    rt = Runtime(LlamaEngine())
    rt.set_entries({"tiny:test": tiny_entry(tiny, "tiny:test")})
    rt.ram = lambda: 1 << 20
    client = await aiohttp_client(create_app(rt, upstream=str(server.make_url(""))))
    try:
        busy = asyncio.ensure_future(client.post("/api/generate", json={"model": "busy", "prompt": "x"}))
        await asyncio.wait_for(stub.started.wait(), 10)
        r = await client.post("/api/generate", json={"model": "tiny:test", "prompt": "hi", "stream": False})
        assert r.status == 500
        assert (await r.json())["error"] == (
            f"model requires more system memory ({human(rt_plan_ram(tiny))}) than is available (1.0 MiB)")
        assert [c for c in stub.calls if c[0] == "unload"] == []  # the busy and the pinned model are kept
        stub.release.set()
        await busy
    finally:
        stub.release.set()
        await server.close()
        await rt.unload_all()


def rt_plan_ram(tiny: Path) -> int:
    from sidecar.runtime.room import plan_entry

    plan = plan_entry(tiny_entry(tiny, "tiny:test"), 256, 1, [], 1 << 20)
    assert plan is not None
    return plan.ram


async def test_own_idle_targets_go_first_least_recently_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OLLAMA_MAX_LOADED_MODELS=2: a third target evicts the least recently used idle one."""
    monkeypatch.setenv("OLLAMA_MAX_LOADED_MODELS", "2")
    paths = [write_tiny_llama(tmp_path / f"m{i}.gguf", seed=i) for i in range(3)]
    entries = {f"m{i}:test": tiny_entry(p, f"m{i}:test") for i, p in enumerate(paths)}
    rt = Runtime(LlamaEngine())
    rt.set_entries(entries)
    try:
        for name in ("m0:test", "m1:test"):
            await rt.load(entries[name])
        rt._loaded[rt._key(entries["m0:test"])].used_at = time.monotonic()  # m0 used since: m1 is the LRU
        await rt.load(entries["m2:test"])
        held = {Path(s.model.status().target).name for s in rt._loaded.values()}
        assert held == {"m0.gguf", "m2.gguf"}
    finally:
        await rt.unload_all()


async def test_unset_num_gpu_offloads_what_the_plan_places(monkeypatch: pytest.MonkeyPatch,
                                                           tiny_pair: tuple[Path, Path]) -> None:
    """With a GPU (injected: this machine has none) and num_gpu unset, the draft is loaded with all
    its layers and the target with the layers that fit beside it, as planned before the target
    took its room."""
    from sidecar.runtime.llamacpp import loading
    from sidecar.runtime.memory import FIT_MARGIN, Device
    from sidecar.runtime.room import plan_entry

    entry = build_entry("p:test", Pair.model_validate({
        "from": str(tiny_pair[0]), "draft": str(tiny_pair[1]), "runtime": {"num_thread": 1},
        "parameters": {"num_ctx": 256}}))
    whole = plan_entry(entry, 256, 1, [Device("GPU0", 64 * GIB, 64 * GIB)], 1 << 40, overhead=0)
    assert whole is not None and whole.draft is not None
    t = whole.target
    room = FIT_MARGIN + whole.draft.vram + t.compute_gpu + (t.vram - t.compute_gpu) // 2  # half the layers
    gpus = [Device("GPU0", room, room)]
    plan = plan_entry(entry, 256, 1, gpus, 1 << 40, overhead=0)
    assert plan is not None and plan.draft is not None
    assert plan.draft.gpu_layers == plan.draft.layers and 0 < plan.target.gpu_layers < plan.target.layers
    monkeypatch.setattr(loading, "gpu_offload_supported", lambda: True)
    monkeypatch.setattr(loading, "detect_gpus", lambda: gpus)
    monkeypatch.delenv("OLLAMA_GPU_OVERHEAD", raising=False)
    engine = LlamaEngine()
    lm = await engine.load(entry, 256, 1)
    try:
        await engine.add_pair(lm, entry)
        asked = {Path(w["path"]).name: w["num_gpu"] for w in engine.weights.snapshot()}
        assert asked == {tiny_pair[0].name: plan.target.gpu_layers, tiny_pair[1].name: plan.draft.gpu_layers}
    finally:
        engine.unload(lm)
        await engine.join(lm, 10)


# -- a request's num_gpu ---------------------------------------------------------------------------
def test_a_requests_num_gpu_reloads_the_target_once(tmp_path: Path, tiny: Path) -> None:
    """Ollama's needsReload (server/sched.go): a request whose num_gpu is not the loaded target's
    count reloads it with that many layers, once however many ask at the same time; -1 (or none)
    takes what is loaded. This build has no GPU backend, so what is checked is what the daemon
    asks llama.cpp for: the load's log line and the weights /sidecar/status lists."""
    cfg = write_config(tmp_path / "pairs.yaml", f"""
pairs:
  tiny:test:
    from: {tiny}
    parameters: {{temperature: 0, num_ctx: 256, num_predict: 2}}
    runtime: {{num_thread: 1}}
""")
    daemon = Daemon(cfg)

    def generate(**options: int) -> None:
        r = httpx.post(daemon.url + "/api/generate", timeout=60, json={
            "model": "tiny:test", "prompt": "hi", "stream": False, "options": options})
        assert r.status_code == 200, r.text

    def loads() -> list[str]:
        return [ln for ln in daemon.log().splitlines() if f"loading {tiny.name} for tiny:test (" in ln]

    def asked() -> list[int]:
        """The layer counts of the mapped weights, once the replaced load is freed (its thread frees
        it after its last request, a moment after that request answered)."""
        deadline = time.monotonic() + 30
        while True:
            held = [w["num_gpu"] for w in httpx.get(daemon.url + "/sidecar/status").json()["weights"]]
            if len(held) == 1 or time.monotonic() > deadline:
                return held
            time.sleep(0.05)

    try:
        generate()
        assert len(loads()) == 1 and "num_gpu" not in loads()[0]
        generate(num_gpu=1)
        assert len(loads()) == 2 and "num_gpu 1)" in loads()[1]
        assert asked() == [1]
        generate(num_gpu=1)
        generate()  # -1: whatever is loaded
        generate(num_gpu=-1)
        assert len(loads()) == 2 and asked() == [1]
        with ThreadPoolExecutor(4) as pool:  # four at once asking for another count: one reload
            list(pool.map(lambda _: generate(num_gpu=0), range(4)))
        assert len(loads()) == 3 and "num_gpu 0)" in loads()[2] and asked() == [0]
        ps = httpx.get(daemon.url + "/api/ps").json()["models"]
        assert [m["name"] for m in ps] == ["tiny:test"] and ps[0]["size_vram"] == 0
        assert not daemon.traces()
    finally:
        daemon.stop()


async def test_a_requests_num_gpu_is_what_the_plan_places(aiohttp_client: Factory, monkeypatch: pytest.MonkeyPatch,
                                                         tiny_pair: tuple[Path, Path]) -> None:
    """With a GPU (injected: this machine has none) that holds the whole pair, a request's num_gpu
    is the target's count in the plan and in the load, the draft still goes wholly onto the GPU,
    and /api/ps shows the partial offload."""
    from sidecar.runtime.llamacpp import loading
    from sidecar.runtime.memory import Device

    gpus = [Device("GPU0", 64 * GIB, 64 * GIB)]
    monkeypatch.setattr(loading, "gpu_offload_supported", lambda: True)
    monkeypatch.setattr(loading, "detect_gpus", lambda: gpus)
    entry = build_entry("p:test", Pair.model_validate({
        "from": str(tiny_pair[0]), "draft": str(tiny_pair[1]), "runtime": {"num_thread": 1},
        "parameters": {"num_ctx": 256, "num_predict": 2}}))
    rt = Runtime(LlamaEngine())
    rt.set_entries({"p:test": entry})
    rt.gpus = lambda: gpus
    client = await aiohttp_client(create_app(rt))
    try:
        async def generate(**options: int) -> None:
            r = await client.post("/api/generate", json={"model": "p:test", "prompt": "hi", "stream": False,
                                                         "options": options})
            assert r.status == 200, await r.text()

        await generate()
        (_, served), = rt.loaded_entries()
        assert served.plan is not None and served.plan.draft is not None
        layers = served.plan.target.layers
        assert served.plan.target.gpu_layers == layers  # all of it fits: the plan puts it all there
        await generate(num_gpu=layers)  # the count the plan chose, asked for: no reload
        assert rt.loaded_entries()[0][1] is served
        await generate(num_gpu=1)
        (_, served), = rt.loaded_entries()
        plan = served.plan
        assert plan is not None and plan.draft is not None
        assert plan.target.gpu_layers == 1 and plan.draft.gpu_layers == plan.draft.layers
        assert isinstance(rt.engine, LlamaEngine)
        held = {Path(w["path"]).name: w["num_gpu"] for w in rt.engine.weights.snapshot()}
        assert held[tiny_pair[0].name] == 1 and held[tiny_pair[1].name] == plan.draft.layers
        ps = (await (await client.get("/api/ps")).json())["models"][0]
        assert ps["size"] == plan.total and 0 < ps["size_vram"] == plan.vram < plan.total
        await generate()  # -1: what is loaded
        assert rt.loaded_entries()[0][1].plan is plan
    finally:
        await rt.unload_all()
