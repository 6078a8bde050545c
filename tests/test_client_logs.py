"""What clients make the daemon log: one summary line per generation request whatever its end, no
prompt in a traceback, and one warning line for a request aiohttp cannot parse. A real daemon
with a real model, reached over HTTP (and a raw socket where no HTTP client would send it)."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon, free_port, write_config
from tests.test_service import log_records

pytestmark = pytest.mark.daemon

T = 120
IMAGE = "iVBORw0KGgo="  # the PNG signature, base64: only its presence matters


@pytest.fixture(scope="module")
def tiny_daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[Daemon]:
    cfg = write_config(tmp_path_factory.mktemp("client-logs") / "pairs.yaml", f"""
pairs:
  tiny:test:
    from: {tiny}
    parameters: {{temperature: 0, num_ctx: 256, num_predict: 4}}
    runtime: {{num_thread: 1}}
""")
    d = Daemon(cfg)
    yield d
    d.stop()


def post(d: Daemon, path: str, body: Any, **headers: str) -> tuple[str, httpx.Response]:
    """POST under a request id of our own; the id and the answer."""
    rid = uuid.uuid4().hex
    kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(d.url + path, headers={"X-Request-Id": rid, **headers}, timeout=T, **kw)
    return rid, r


def summaries(d: Daemon, rid: str) -> list[dict[str, Any]]:
    return [rec for rec in log_records(d) if rec.get("request_id") == rid and rec["event"] == "request"]


CHAT = [{"role": "user", "content": "hi"}]
# (path, body, status, model in the summary line): every generation route, refused before any
# generation, by the handler (images, embeddings, a bad field or body, an unknown model) or by
# the runtime (a bad option, raised inside respond(), which logs the line itself).
REFUSED = [
    ("/api/generate", {"model": "tiny:test", "prompt": "look", "images": [IMAGE]}, 400, "tiny:test"),
    ("/api/chat", {"model": "tiny:test", "messages": [{"role": "user", "content": "look", "images": [IMAGE]}]},
     400, "tiny:test"),
    ("/v1/chat/completions", {"model": "tiny:test", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMAGE}"}}]}]}, 400, "tiny:test"),
    ("/v1/completions", {"model": "tiny:test", "prompt": ["not", "a", "string"]}, 400, "tiny:test"),
    ("/api/embed", {"model": "tiny:test", "input": "x"}, 400, "tiny:test"),
    ("/api/embeddings", {"model": "tiny:test", "prompt": "x"}, 400, "tiny:test"),
    ("/v1/embeddings", {"model": "tiny:test", "input": "x"}, 400, "tiny:test"),
    ("/api/generate", {"model": "tiny:test", "prompt": "x", "options": "hot"}, 400, "tiny:test"),
    ("/api/generate", b"{not json", 400, None),
    ("/api/chat", {"model": "nope:x", "messages": CHAT}, 404, "nope:x"),
    ("/api/chat", {"model": "tiny:test", "messages": CHAT, "options": {"temperature": "hot"}}, 400, "tiny:test"),
]


@pytest.mark.parametrize(("path", "body", "status", "model"), REFUSED,
                         ids=[f"{p}-{i}" for i, (p, *_) in enumerate(REFUSED)])
def test_every_refused_generation_logs_one_summary_line(tiny_daemon: Daemon, path: str, body: Any, status: int,
                                                        model: str | None) -> None:
    rid, r = post(tiny_daemon, path, body)
    assert r.status_code == status, r.text
    lines = summaries(tiny_daemon, rid)
    assert len(lines) == 1, lines
    assert lines[0]["status"] == f"error {status}" and lines[0]["path"] == path
    assert lines[0]["model"] == model
    assert lines[0]["reason"], lines  # what the client was told


def test_guard_refusals_and_successes_log_one_line_too(tiny_daemon: Daemon) -> None:
    # The Host check (DNS rebinding) refuses before any handler runs.
    rid, r = post(tiny_daemon, "/api/generate", {"model": "tiny:test", "prompt": "x"}, Host="evil.example")
    assert r.status_code == 403
    assert [rec["status"] for rec in summaries(tiny_daemon, rid)] == ["error 403"]
    rid, r = post(tiny_daemon, "/api/generate", {"model": "tiny:test", "prompt": "x", "stream": False})
    assert r.status_code == 200
    assert [rec["status"] for rec in summaries(tiny_daemon, rid)] == ["ok"]
    # Not a generation route: an error answer still logs its one line, a success none.
    rid, r = post(tiny_daemon, "/api/show", {"model": "nope:x"})
    assert r.status_code == 404
    [line] = summaries(tiny_daemon, rid)
    assert (line["path"], line["model"], line["status"]) == ("/api/show", "nope:x", "error 404")
    assert line["reason"] == r.json()["error"]
    rid, r = post(tiny_daemon, "/api/show", {"model": "tiny:test"})
    assert r.status_code == 200 and summaries(tiny_daemon, rid) == []


@pytest.fixture(scope="module")
def orphan(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[Daemon]:
    """A daemon whose upstream is down: a port nothing listens on."""
    cfg = write_config(tmp_path_factory.mktemp("orphan") / "pairs.yaml", f"""
pairs:
  tiny:test:
    from: {tiny}
    parameters: {{num_ctx: 256}}
    runtime: {{num_thread: 1}}
""")
    d = Daemon(cfg, env={"SIDECAR_UPSTREAM": f"http://127.0.0.1:{free_port()}"})
    yield d
    d.stop()


# Forwarded requests (models that are not pairs, endpoints the sidecar does not serve) to an
# upstream that is down: each 502 leaves one line with the path, the model named and the reason.
FORWARDED = [
    ("/api/chat", {"model": "llama3:8b", "messages": CHAT}, "llama3:8b"),
    ("/api/generate", {"model": "llama3:8b", "prompt": "x"}, "llama3:8b"),
    ("/api/show", {"model": "llama3:8b"}, "llama3:8b"),
    ("/api/pull", {"model": "llama3:8b"}, "llama3:8b"),
    ("/v1/chat/completions", {"model": "gpt-x", "messages": CHAT}, "gpt-x"),
    ("/api/somewhere/new", {}, None),
]


@pytest.mark.parametrize(("path", "body", "model"), FORWARDED, ids=[p for p, *_ in FORWARDED])
def test_a_502_from_a_dead_upstream_logs_one_line(orphan: Daemon, path: str, body: Any, model: str | None) -> None:
    rid, r = post(orphan, path, body)
    assert r.status_code == 502, r.text
    [line] = summaries(orphan, rid)
    assert (line["path"], line["model"], line["status"]) == (path, model, "error 502")
    assert "unreachable" in line["reason"] and "127.0.0.1" in line["reason"]


def test_a_traceback_carries_no_prompt(tiny_daemon: Daemon) -> None:
    """A template that fails while executing is the daemon's 500, logged with its traceback; the
    frames' locals hold the prompt, so they stay out of the log (SIDECAR_LOG_LOCALS is unset)."""
    secret = "the-secret-prompt-" + uuid.uuid4().hex
    rid, r = post(tiny_daemon, "/api/generate", {"model": "tiny:test", "prompt": secret, "stream": False,
                                                 "template": "{{ index .Messages 9 }}"})
    # Go's words for it, as Ollama answers them (text/template's exec.go errorf, ErrorContext).
    assert r.status_code == 500 and r.json() == {
        "error": 'template: :1:3: executing "" at <index .Messages 9>: error calling index: index out of range: 9'}
    failed = [rec for rec in log_records(tiny_daemon) if rec.get("request_id") == rid and "exception" in rec]
    assert failed and failed[0]["level"] == "error", failed
    frames = [f for exc in failed[0]["exception"] for f in exc["frames"]]
    assert len(frames) > 3 and not any("locals" in f for f in frames)
    assert secret not in tiny_daemon.log()


def test_a_malformed_request_is_one_warning(tiny_daemon: Daemon) -> None:
    before = len(log_records(tiny_daemon))
    with socket.create_connection(("127.0.0.1", tiny_daemon.port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n")
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == b"400", answer
    assert httpx.get(tiny_daemon.url + "/", timeout=T).status_code == 200  # and it serves on
    new = log_records(tiny_daemon)[before:]
    server = [rec for rec in new if rec["logger"] == "aiohttp.server"]
    assert len(server) == 1, new
    assert server[0]["level"] == "warning" and "exception" not in server[0]
    assert "Invalid header value char" in server[0]["event"] and "a\\x00b" not in server[0]["event"]
    assert not [rec for rec in new if rec["level"] == "error"]
