"""OLLAMA_NUM_PARALLEL: N slots per target run N requests at once; one slot serialises; models run side by side.

Concurrency is read from the order of events, not from timing: every chunk carries the server's
`created_at`, so two streams overlapped when each produced a token before the other finished.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon, write_config
from tests.models import write_tiny_llama

T = 120


@pytest.fixture(scope="module")
def endless(model_dir: Path) -> tuple[Path, Path]:
    """Two tiny models that never emit end-of-generation, so a stream lasts exactly num_predict tokens."""
    return (write_tiny_llama(model_dir / "endless-a.gguf", seed=11, end_bias=0.0),
            write_tiny_llama(model_dir / "endless-b.gguf", seed=12, end_bias=0.0))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, endless: tuple[Path, Path]) -> Iterator[Daemon]:
    a, b = endless
    d = tmp_path_factory.mktemp("parallel")
    params = "parameters: {temperature: 0, num_ctx: 1024}"
    cfg = write_config(d / "pairs.yaml", f"""
pairs:
  two:slots:
    from: {a}
    {params}
    runtime: {{num_thread: 1}}
  one:slot:
    from: {a}
    {params}
    runtime: {{num_thread: 1, num_parallel: 1}}
  other:model:
    from: {b}
    {params}
    runtime: {{num_thread: 1, num_parallel: 1}}
""")
    daemon = Daemon(cfg, env={"OLLAMA_NUM_PARALLEL": "2"})
    yield daemon
    daemon.stop()


def stamp(chunk: dict[str, Any]) -> float:
    return datetime.fromisoformat(chunk["created_at"].replace("Z", "+00:00")).timestamp()


def run_together(d: Daemon, models: list[str], n: int = 800) -> list[list[dict[str, Any]]]:
    """Stream one request per model, all sent at once; every stream's chunks."""
    out: list[list[dict[str, Any]]] = [[] for _ in models]
    go = threading.Barrier(len(models))

    def one(i: int) -> None:
        body = {"model": models[i], "prompt": f"request {i}", "options": {"num_predict": n}}
        go.wait()
        with httpx.stream("POST", d.url + "/api/generate", json=body, timeout=T) as r:
            assert r.status_code == 200
            out[i] = [json.loads(ln) for ln in r.iter_lines() if ln]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    for chunks in out:
        assert chunks and chunks[-1]["done"] is True and chunks[-1]["eval_count"] == n, chunks[-1:]
    return out


def overlapped(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Each produced a token before the other finished."""
    return stamp(a[0]) < stamp(b[-1]) and stamp(b[0]) < stamp(a[-1])


def test_two_slots_run_two_requests_at_once(daemon: Daemon) -> None:
    a, b = run_together(daemon, ["two:slots", "two:slots"])
    assert overlapped(a, b)


def test_one_slot_serialises(daemon: Daemon) -> None:
    a, b = run_together(daemon, ["one:slot", "one:slot"])
    first, second = (a, b) if stamp(a[0]) < stamp(b[0]) else (b, a)
    assert stamp(first[-1]) <= stamp(second[0]), "the second request started before the first finished"


def test_different_models_run_side_by_side(daemon: Daemon) -> None:
    a, b = run_together(daemon, ["one:slot", "other:model"])
    assert overlapped(a, b)


def test_more_requests_than_slots_all_complete_in_order(daemon: Daemon) -> None:
    """Five requests on two slots: every one completes, with the right text for its prompt."""
    results = run_together(daemon, ["two:slots"] * 5, n=50)
    alone = httpx.post(daemon.url + "/api/generate", timeout=T, json={
        "model": "two:slots", "prompt": "request 3", "stream": False, "options": {"num_predict": 50}}).json()
    assert "".join(c.get("response", "") for c in results[3]) == alone["response"]


def test_status_shows_slots_and_shared_weights(daemon: Daemon) -> None:
    run_together(daemon, ["two:slots", "one:slot"], n=4)
    st = httpx.get(daemon.url + "/sidecar/status").json()
    slots = {tuple(m["pairs"]): m["parallel"] for m in st["models"]}
    assert slots[("two:slots",)] == 2 and slots[("one:slot",)] == 1
    # Two loaded targets (three contexts) over one mapping of the file.
    assert [w["refs"] for w in st["weights"] if w["path"].endswith("endless-a.gguf")] == [2]
