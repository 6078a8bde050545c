"""Running as a service: request ids in logs and headers, draining on SIGTERM/SIGINT, load progress logs."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.cli import drain_timeout
from tests.conftest import SMOLLM2_REF, Daemon, write_config
from tests.models import write_tiny_llama

pytestmark = pytest.mark.daemon

T = 120


def log_records(d: Daemon) -> list[dict[str, Any]]:
    """The daemon's JSON log lines (stderr is not a terminal, so every record is one JSON object)."""
    out = []
    for ln in d.log().splitlines():
        if ln.startswith("{"):
            out.append(json.loads(ln))
    return out


def stamp(chunk: dict[str, Any]) -> float:
    return datetime.fromisoformat(chunk["created_at"].replace("Z", "+00:00")).timestamp()


@pytest.fixture
def tiny_daemon(tmp_path: Path, tiny: Path) -> Any:
    cfg = write_config(tmp_path / "pairs.yaml", f"""
pairs:
  tiny:test:
    from: {tiny}
    parameters: {{temperature: 0, num_ctx: 256, num_predict: 8}}
    runtime: {{num_thread: 1}}
""")
    d = Daemon(cfg)
    yield d
    d.stop()


# -- request ids -----------------------------------------------------------------------------------
def test_request_id_in_header_and_every_log_line(tiny_daemon: Daemon) -> None:
    rid = "client-supplied.id-42"
    r = httpx.post(tiny_daemon.url + "/api/generate", json={"model": "tiny:test", "prompt": "hi", "stream": False},
                   headers={"X-Request-Id": rid}, timeout=T)
    assert r.status_code == 200 and r.headers["X-Request-Id"] == rid
    mine = [rec for rec in log_records(tiny_daemon) if rec.get("request_id") == rid]
    events = [rec["event"] for rec in mine]
    # The load (on a helper thread) and the summary line (on the event loop) both carry it.
    assert any(e.startswith("loading target model") for e in events), events
    assert "request" in events, events
    # Streams, errors and other routes get one too; an id that does not look like one is replaced.
    for bad in ("x" * 300, "has space", "ünïcode".encode()):
        r = httpx.post(tiny_daemon.url + "/api/generate", json={"model": "nope:x"}, headers={"X-Request-Id": bad},
                       timeout=T)
        assert r.status_code == 404 and r.headers["X-Request-Id"] not in (bad, "has space")
        assert len(r.headers["X-Request-Id"]) == 32
    with httpx.stream("POST", tiny_daemon.url + "/api/chat", timeout=T,
                      json={"model": "tiny:test", "messages": [{"role": "user", "content": "a"}]}) as s:
        assert s.status_code == 200 and len(s.headers["X-Request-Id"]) == 32
        rid2 = s.headers["X-Request-Id"]
        s.read()
    assert httpx.get(tiny_daemon.url + "/api/tags").headers["X-Request-Id"] != rid2
    summary = [rec for rec in log_records(tiny_daemon) if rec.get("event") == "request" and rec["path"] == "/api/chat"]
    assert [rec["request_id"] for rec in summary] == [rid2]
    # Nothing leaks from one request into log lines written outside any request.
    tiny_daemon.stop()
    shutdown = [rec for rec in log_records(tiny_daemon) if rec["event"].startswith("shutting down")]
    assert shutdown and "request_id" not in shutdown[0]


# -- draining on SIGTERM/SIGINT --------------------------------------------------------------------
@pytest.fixture
def smol_config(tmp_path: Path) -> Path:
    """SmolLM2 without a drafter (no cost calibration at load): slow enough that a stream lasts seconds."""
    return write_config(tmp_path / "pairs.yaml", f"""
pairs:
  smol:plain:
    from: {SMOLLM2_REF}
    parameters: {{temperature: 0, num_ctx: 512}}
""")


@pytest.fixture
def endless_config(tmp_path: Path, model_dir: Path) -> Path:
    """A model that never ends its output, wide enough to take seconds for its 4096-token context
    (SmolLM2 may end a long answer before a short deadline passes)."""
    path = model_dir / "endless-wide.gguf"
    if not path.exists():
        write_tiny_llama(path, seed=1, end_bias=0.0, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024, n_layer=8)
    return write_config(tmp_path / "pairs.yaml", f"""
pairs:
  smol:plain:
    from: {path}
    parameters: {{temperature: 0, num_ctx: 4096}}
    runtime: {{num_thread: 1}}
""")


def open_stream(d: Daemon, num_predict: int) -> tuple[httpx.Client, Iterator[str], list[dict[str, Any]]]:
    """A running stream whose first chunk has arrived; the caller reads the rest."""
    client = httpx.Client(timeout=T)
    body = {"model": "smol:plain", "prompt": "Count from one to one thousand, one number per line.",
            "options": {"num_predict": num_predict}}
    resp = client.send(client.build_request("POST", d.url + "/api/generate", json=body), stream=True)
    lines = resp.iter_lines()
    first = json.loads(next(lines))
    assert first["done"] is False
    return client, lines, [first]


def rest_of(lines: Iterator[str]) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in lines if ln]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_drains_running_streams(smol_config: Path, sig: signal.Signals) -> None:
    d = Daemon(smol_config, env={"SIDECAR_DRAIN_TIMEOUT": "100"})
    try:
        client, resp, chunks = open_stream(d, num_predict=200)
        d.proc.send_signal(sig)
        # New work is refused at once, in Ollama's shape (and OpenAI's on /v1), while the stream runs.
        deadline = time.monotonic() + 10
        while True:
            r = httpx.post(d.url + "/api/generate", json={"model": "smol:plain", "prompt": "x"}, timeout=T)
            if r.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # the signal may not have been handled yet
        refused_at = time.time()
        assert r.status_code == 503 and r.json() == {"error": "server shutting down"}
        v1 = httpx.post(d.url + "/v1/chat/completions", json={"model": "smol:plain", "messages": []}, timeout=T)
        assert v1.status_code == 503 and v1.json()["error"]["message"] == "server shutting down"
        chunks += rest_of(resp)
        client.close()
        final = chunks[-1]
        assert final["done"] is True and final["done_reason"] in ("stop", "length"), final
        assert final["eval_count"] >= len(chunks) - 1 > 20
        assert stamp(final) > refused_at - 0.2  # the stream really was still running during the drain
        assert d.proc.wait(60) == 0
    finally:
        d.stop()
    assert "drain deadline passed" not in d.log()


def test_stop_cuts_streams_at_the_deadline(endless_config: Path) -> None:
    d = Daemon(endless_config, env={"SIDECAR_DRAIN_TIMEOUT": "0.5"})
    # A stream as long as the context allows, and a request queued behind it on the same model.
    queued: dict[str, Any] = {}

    def second() -> None:
        r = httpx.post(d.url + "/api/generate", json={"model": "smol:plain", "prompt": "y", "stream": False},
                       timeout=T)
        queued["status"], queued["body"] = r.status_code, r.json()

    try:
        client, resp, chunks = open_stream(d, num_predict=-1)
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        chunks += rest_of(resp)
        client.close()
        code = d.proc.wait(60)
        elapsed = time.monotonic() - t0
        t.join(30)
    finally:
        d.stop()
    assert code == 0, d.log()[-3000:]
    assert elapsed < 30, "a cut stream must not hold the process until the deadline of systemd"
    # The cut stream ends with Ollama's mid-stream error line, never a done:true that looks complete.
    assert chunks[-1] == {"error": "server shutting down"}
    assert all(c.get("done") is False for c in chunks[:-1])
    # The request that was still waiting for the model was refused, not left hanging.
    assert queued["status"] == 503 and queued["body"] == {"error": "server shutting down"}
    assert "drain deadline passed" in d.log()
    assert not d.traces(), d.traces()


def test_drain_timeout_precedence() -> None:
    assert drain_timeout(2.0, "7", 9.0) == 2.0
    assert drain_timeout(None, "7", 9.0) == 7.0
    assert drain_timeout(None, " ", 9.0) == 9.0
    assert drain_timeout(None, "soon", None) == 30.0
    assert drain_timeout(-1.0, None, None) == 0.0


# -- model loading in the logs ---------------------------------------------------------------------
def test_model_loading_is_logged_for_target_and_draft(tmp_path: Path, tiny_pair: tuple[Path, Path]) -> None:
    target, draft = tiny_pair
    cfg = write_config(tmp_path / "pairs.yaml", f"""
pairs:
  tiny:pair:
    from: {target}
    draft: {draft}
    parameters: {{temperature: 0, num_ctx: 256, num_predict: 4}}
    runtime: {{num_thread: 1}}
""")
    d = Daemon(cfg)
    try:
        r = httpx.post(d.url + "/api/generate", json={"model": "tiny:pair", "prompt": "a", "stream": False}, timeout=T)
        assert r.status_code == 200
        events = [rec["event"] for rec in log_records(d)]
    finally:
        d.stop()
    for role, path in (("target", target), ("draft", draft)):
        loading = [e for e in events if e.startswith(f"loading {role} model {path}")]
        loaded = [e for e in events if e.startswith(f"{role} model loaded: {path.name} in ")]
        assert len(loading) == 1 and "MiB" in loading[0], events
        assert len(loaded) == 1, events
        assert events.index(loading[0]) < events.index(loaded[0])
