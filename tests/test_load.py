"""Under load and at rest: 32 concurrent streams (some abandoned) leave no leak; memory stays within the models.

Memory and threads are read from /proc/PID/status of the daemon process (Linux only).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.models.gguf import read_metadata
from tests.conftest import Daemon, write_config

pytestmark = [pytest.mark.daemon, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

T = 120
CLIENTS = 32
NUM_PREDICT = 48
MIB = 1024 * 1024


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS (bytes) and Threads of a process."""
    out: dict[str, int] = {}
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = ln.partition(":")
        if key == "VmRSS":
            out["rss"] = int(value.split()[0]) * 1024
        elif key == "Threads":
            out["threads"] = int(value)
    return out


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path, tiny_endless: Path) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("load")
    # Abandoning clients ask a model that never ends for a whole 4096-token context, so they
    # really leave mid-stream rather than after a short answer was already written.
    cfg = write_config(d / "pairs.yaml", f"""
pairs:
  tiny:test:
    from: {tiny}
    parameters: {{temperature: 0.7, num_ctx: 256}}
    runtime: {{num_thread: 1}}
  endless:test:
    from: {tiny_endless}
    parameters: {{temperature: 0.7, num_ctx: 4096, num_predict: -1}}
    runtime: {{num_thread: 1}}
""")
    daemon = Daemon(cfg, env={"OLLAMA_MAX_QUEUE": str(4 * CLIENTS), "OLLAMA_NUM_PARALLEL": "2"})
    yield daemon
    daemon.stop()


async def one_client(client: httpx.AsyncClient, url: str, i: int, abandon: bool) -> list[dict[str, Any]] | None:
    """Stream one generation; abandon it after two chunks when asked. Returns the chunks of a full stream."""
    body = {"model": "endless:test" if abandon else "tiny:test", "prompt": f"client {i} says",
            "options": {"seed": i} if abandon else {"num_predict": NUM_PREDICT, "seed": i}}
    async with client.stream("POST", url + "/api/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        raw: list[bytes] = []
        buf = b""
        async for data in r.aiter_bytes():
            buf += data
            *complete, buf = buf.split(b"\n")
            raw += complete
            if abandon and len(raw) >= 2:
                return None  # leaving the block closes the connection mid-stream
        assert buf == b"", "the stream must end with a newline"
    assert all(raw), "no blank lines"
    return [json.loads(x) for x in raw]


async def round_of_load(url: str) -> list[list[dict[str, Any]]]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=T, limits=limits) as client:
        results = await asyncio.gather(*(one_client(client, url, i, abandon=i % 4 == 3) for i in range(CLIENTS)))
    return [r for r in results if r is not None]


def check_stream(chunks: list[dict[str, Any]]) -> None:
    *pieces, final = chunks
    assert all(c["done"] is False and c["model"] == "tiny:test" for c in pieces)
    assert final["done"] is True and final["response"] == ""
    assert final["done_reason"] in ("stop", "length")
    assert final["eval_count"] == len(pieces)  # one piece per token for this vocabulary
    if final["done_reason"] == "length":
        assert final["eval_count"] == NUM_PREDICT
    else:
        assert final["eval_count"] <= NUM_PREDICT
    assert final["prompt_eval_count"] >= 1
    assert len(final["context"]) >= final["prompt_eval_count"] + final["eval_count"]  # cached tokens not evaluated


def settle(pid: int, want_threads: int, timeout: float = 20) -> dict[str, int]:
    """The process's status once its thread count is back to `want_threads` (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    st = proc_status(pid)
    while st["threads"] != want_threads and time.monotonic() < deadline:
        time.sleep(0.2)
        st = proc_status(pid)
    return st


def test_concurrent_streams_with_disconnects_leave_no_leak(daemon: Daemon) -> None:
    pid = daemon.proc.pid
    # Warm-up: loads the model, starts its slot threads and the default executor, fills allocator pools.
    warm = asyncio.run(round_of_load(daemon.url))
    assert len(warm) >= CLIENTS - CLIENTS // 4  # an abandoning client may see a short stream end first
    time.sleep(1)
    before = proc_status(pid)
    left_before = disconnects(daemon)
    for _ in range(2):
        done = asyncio.run(round_of_load(daemon.url))
        assert len(done) >= CLIENTS - CLIENTS // 4
        for chunks in done:
            check_stream(chunks)
    after = settle(pid, before["threads"])
    assert after["threads"] == before["threads"], (before, after)
    assert after["rss"] <= before["rss"] + 32 * MIB, (before, after)
    # Every abandoning client left mid-stream, and the daemon saw it.
    assert disconnects(daemon) - left_before == 2 * (CLIENTS // 4)
    # Nothing is left queued or running, and the daemon still answers.
    models = httpx.get(daemon.url + "/sidecar/status", timeout=T).json()["models"]
    assert [m["in_flight"] for m in models] == [0, 0]
    r = httpx.post(daemon.url + "/api/generate", timeout=T, json={
        "model": "tiny:test", "prompt": "x", "stream": False, "options": {"num_predict": 4}})
    assert r.status_code == 200 and r.json()["done"] is True
    assert not daemon.traces(), daemon.traces()


def disconnects(daemon: Daemon) -> float:
    """sidecar_client_disconnects_total, summed over its labels."""
    text = httpx.get(daemon.url + "/metrics", timeout=T).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("sidecar_client_disconnects_total"))


def kv_bytes(path: Path, n_ctx: int) -> int:
    """An f16 KV cache of n_ctx tokens: K and V, per layer, n_head_kv x head_dim values of 2 bytes."""
    meta = read_metadata(path)
    arch = meta["general.architecture"]
    n_layer, n_embd = meta[f"{arch}.block_count"], meta[f"{arch}.embedding_length"]
    n_head = meta[f"{arch}.attention.head_count"]
    n_head_kv = meta.get(f"{arch}.attention.head_count_kv", n_head)
    return 2 * n_layer * n_ctx * n_head_kv * (n_embd // n_head) * 2


def test_resident_memory_stays_within_the_models(tmp_path: Path, tiny_pair: tuple[Path, Path]) -> None:
    """Target + model draft loaded (two pairs sharing both): RSS within the files, their KV caches and 250 MB.

    Speculation is not adaptive here, so the draft runs whatever this machine's cost model says."""
    target, draft = tiny_pair
    n_ctx = 2048
    pair = f"""
    from: {target}
    draft: {draft}
    parameters: {{temperature: 0, num_ctx: {n_ctx}}}
    speculative: {{adaptive: false}}
    runtime: {{num_thread: 1}}"""
    cfg = write_config(tmp_path / "pairs.yaml", f"pairs:\n  one:pair:{pair}\n  two:pair:{pair}\n    system: other\n")
    d = Daemon(cfg)
    try:
        for name in ("one:pair", "two:pair"):
            r = httpx.post(d.url + "/api/generate", timeout=T, json={
                "model": name, "prompt": "a b c " * 100, "stream": False, "options": {"num_predict": 64}})
            assert r.status_code == 200 and r.json()["draft_rounds"] > 0
        rss = proc_status(d.proc.pid)["rss"]
        st = httpx.get(d.url + "/sidecar/status", timeout=T).json()
    finally:
        d.stop()
    # Loaded once each, however many pairs use them: one target context, one draft context per pair.
    refs = {Path(w["path"]).name: w["refs"] for w in st["weights"]}
    assert refs == {target.name: 1, draft.name: 2}, refs
    assert len(st["models"]) == 1 and st["models"][0]["pairs"] == ["one:pair", "two:pair"]
    files = target.stat().st_size + draft.stat().st_size
    kv = kv_bytes(target, n_ctx) + 2 * kv_bytes(draft, n_ctx)
    assert rss <= files + kv + 250 * MIB, f"RSS {rss / MIB:.0f} MiB > {(files + kv) / MIB:.0f} MiB + 250 MiB"
