"""OLLAMA_NUM_PARALLEL: N requests per target decode at once, in one batch; one serialises; models run
side by side; by default a side request (a title) runs beside the conversation instead of before it.

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

pytestmark = pytest.mark.daemon

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


def test_two_requests_share_each_decode(daemon: Daemon) -> None:
    """The two streams are one batch: its decodes hold more than one row on average, and /metrics
    and /sidecar/status say so."""
    before = httpx.get(daemon.url + "/sidecar/status").json()
    run_together(daemon, ["two:slots", "two:slots"], n=200)
    st = next(m for m in httpx.get(daemon.url + "/sidecar/status").json()["models"] if m["pairs"] == ["two:slots"])
    was = next((m for m in before["models"] if m["pairs"] == ["two:slots"]), None)
    assert st["busy"] == 0 and st["rows_per_step"] > 1.0, (was, st)
    scrape = httpx.get(daemon.url + "/metrics").text
    assert 'sidecar_batch_rows_per_step{model="two:slots"}' in scrape
    assert 'sidecar_batch_sequences{model="two:slots"} 0.0' in scrape


def test_a_title_request_runs_beside_the_chat_by_default(tmp_path: Path, endless: tuple[Path, Path]) -> None:
    """Open WebUI sends its title request (non-streamed, num_predict 1000) just before the user's
    chat. With the default parallelism the chat's first token comes while the title still runs."""
    cfg = write_config(tmp_path / "pairs.yaml", f"""
pairs:
  m:latest:
    from: {endless[0]}
    parameters: {{temperature: 0, num_ctx: 2048}}
    runtime: {{num_thread: 1}}
""")
    d = Daemon(cfg, env={"OLLAMA_NUM_PARALLEL": ""})  # empty: the daemon's default
    try:
        title: dict[str, Any] = {}

        def ask_title() -> None:
            title.update(httpx.post(d.url + "/api/generate", timeout=T, json={
                "model": "m", "prompt": "Generate a title", "stream": False, "options": {"num_predict": 1000}}).json())

        t = threading.Thread(target=ask_title)
        t.start()
        # The chat goes only once the title is decoding (the order Open WebUI's requests arrive in).
        while not any(m["busy"] for m in httpx.get(d.url + "/sidecar/status").json()["models"]):
            assert t.is_alive()
        with httpx.stream("POST", d.url + "/api/generate", timeout=T, json={
                "model": "m", "prompt": "hello", "options": {"num_predict": 8}}) as r:
            chat = [json.loads(ln) for ln in r.iter_lines() if ln]
        t.join(T)
        assert title["eval_count"] == 1000 and chat[-1]["done"]
        assert stamp(chat[-1]) < stamp(title), "the chat waited for the title"
    finally:
        d.stop()
