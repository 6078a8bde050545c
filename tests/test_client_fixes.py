"""What real clients tripped on: a num_ctx llama.cpp pads, images for a pair, Ollama's wording.

Each case is driven as it was found: the official `ollama` and `openai` clients, or raw HTTP,
against the daemon as a real process. For images the upstream Ollama is a small aiohttp stub
that answers like Ollama (this machine has no vision model); it records what reached it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from aiohttp import web

from tests.conftest import Daemon, free_port, write_config
from tests.stores import add_ollama_model
from tests.test_proxy import Stub

pytestmark = pytest.mark.daemon

T = 120
IMAGE = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def vision_stub(seen: dict[str, Any]) -> web.Application:
    """Ollama with one vision model, `vis:latest`: it answers chat, generate and /v1 in Ollama's shapes."""

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.99.1"})

    async def tags(_: web.Request) -> web.Response:
        return web.json_response({"models": [{"name": "vis:latest", "model": "vis:latest", "size": 1,
                                              "digest": "ab", "details": {"format": "gguf"}}]})

    async def ndjson(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.setdefault("bodies", []).append((request.path, body))
        key = "message" if request.path == "/api/chat" else "response"
        part = (lambda t: {"role": "assistant", "content": t}) if key == "message" else (lambda t: t)
        chunks = [{"model": body["model"], "created_at": "2026-01-01T00:00:00Z", key: part("a red dot"), "done": False},
                  {"model": body["model"], "created_at": "2026-01-01T00:00:00Z", key: part(""), "done": True,
                   "done_reason": "stop", "eval_count": 3}]
        if body.get("stream") is False:
            return web.json_response({**chunks[0], key: part("a red dot"), **{k: v for k, v in chunks[1].items()
                                                                              if k not in (key,)}})
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(json.dumps(c).encode() + b"\n")
        return resp

    async def v1_chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.setdefault("bodies", []).append((request.path, body))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for delta, finish in (({"role": "assistant", "content": "a red dot"}, None), ({}, "stop")):
            chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": body["model"],
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/api/version", version)
    app.router.add_get("/api/tags", tags)
    app.router.add_post("/api/chat", ndjson)
    app.router.add_post("/api/generate", ndjson)
    app.router.add_post("/v1/chat/completions", v1_chat)
    return app


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    return {}


@pytest.fixture(scope="module")
def stub(seen: dict[str, Any]) -> Iterator[Stub]:
    s = Stub(vision_stub(seen))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path, stub: Stub) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("clients")
    store = d / "ollama"
    add_ollama_model(store, "registry.ollama.ai/library/vis/latest", tiny)
    cfg = write_config(d / "pairs.yaml", f"""
upstream: {stub.url}
models: {{ollama: {store}}}
pairs:
  vis:spec:
    from: vis:latest
    parameters: {{temperature: 0, num_predict: 8}}
    runtime: {{num_thread: 1}}
  tiny:test:
    from: {tiny}
    parameters: {{temperature: 0, num_predict: 8}}
    runtime: {{num_thread: 1}}
""")
    daemon = Daemon(cfg)
    yield daemon
    daemon.stop()


def loads(d: Daemon) -> list[str]:
    return [ln for ln in d.log().splitlines() if '"event": "loading target model' in ln]


# -- 1. a num_ctx llama.cpp pads ---------------------------------------------------------------------
def test_a_num_ctx_that_is_padded_loads_once(daemon: Daemon) -> None:
    c = ollama.Client(host=daemon.url, timeout=T)
    before = len(loads(daemon))
    for _ in range(3):
        r = c.generate(model="tiny:test", prompt="hello", options={"num_ctx": 300})
        assert r.done
    assert len(loads(daemon)) == before + 1, loads(daemon)  # one load, not one per request
    (m,) = [m for m in c.ps().models if m.model == "tiny:test"]
    assert m.context_length == 300  # what was asked for, as Ollama reports it (llamaServerRunner.ContextLength)


# -- 3. images for a pair ----------------------------------------------------------------------------
def test_images_go_to_the_upstream_under_the_targets_name(daemon: Daemon, seen: dict[str, Any]) -> None:
    c = ollama.Client(host=daemon.url, timeout=T)
    parts = list(c.chat(model="vis:spec", stream=True,
                        messages=[{"role": "user", "content": "what is this?", "images": [IMAGE]}]))
    assert "".join(p.message.content for p in parts) == "a red dot"
    assert all(p.model == "vis:spec" for p in parts)
    assert parts[-1].done
    path, body = seen["bodies"][-1]
    assert path == "/api/chat" and body["model"] == "vis:latest" and body["messages"][0]["images"] == [IMAGE]
    whole = c.generate(model="vis:spec", prompt="describe", images=[IMAGE], stream=False)
    assert whole.response == "a red dot" and whole.model == "vis:spec"
    # The client's types drop fields Ollama lacks; on the wire, the final chunk says why no pair ran it.
    lines = httpx.post(daemon.url + "/api/chat", timeout=T, json={
        "model": "vis:spec", "messages": [{"role": "user", "content": "x", "images": [IMAGE]}]}).text.splitlines()
    assert [json.loads(ln).get("fallback") for ln in lines] == [None, "images"]
    oa = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", timeout=T)
    chunks = list(oa.chat.completions.create(model="vis:spec", stream=True, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMAGE}"}}]}]))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "a red dot"
    assert {ch.model for ch in chunks} == {"vis:spec"}
    assert seen["bodies"][-1][0] == "/v1/chat/completions" and seen["bodies"][-1][1]["model"] == "vis:latest"


def test_images_without_an_upstream_model_are_ollamas_400(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/api/chat", timeout=T, json={
        "model": "tiny:test", "messages": [{"role": "user", "content": "x", "images": [IMAGE]}]})
    assert r.status_code == 400
    assert r.json() == {"error": "registry.ollama.ai/library/tiny:test does not support vision"}


def test_images_with_the_upstream_down_are_a_502(tmp_path: Path, tiny: Path) -> None:
    store = tmp_path / "ollama"
    add_ollama_model(store, "registry.ollama.ai/library/vis/latest", tiny)
    cfg = write_config(tmp_path / "pairs.yaml", f"""
upstream: http://127.0.0.1:{free_port()}
upstream_kind: ollama
models: {{ollama: {store}}}
pairs:
  vis:spec:
    from: vis:latest
""")
    d = Daemon(cfg)
    try:
        r = httpx.post(d.url + "/api/chat", timeout=T, json={
            "model": "vis:spec", "messages": [{"role": "user", "content": "x", "images": [IMAGE]}]})
        assert r.status_code == 502 and "unreachable" in r.json()["error"]
    finally:
        d.stop()


# -- 4. Ollama's wording and status codes -------------------------------------------------------------
def test_capability_refusals_in_ollamas_words(daemon: Daemon) -> None:
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    r = httpx.post(daemon.url + "/api/chat", timeout=T, json={
        "model": "tiny:test", "messages": [{"role": "user", "content": "x"}], "tools": tools})
    assert r.status_code == 400
    assert r.json() == {"error": "registry.ollama.ai/library/tiny:test does not support tools"}


def test_a_template_that_fails_while_executing_is_a_500(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/api/generate", timeout=T, json={
        "model": "tiny:test", "prompt": "x", "template": "{{ .Prompt.Nope }}", "stream": False})
    assert r.status_code == 500 and r.json() == {  # Go's words: the chain placed at .Nope, the type a map's
        "error": 'template: :1:10: executing "" at <.Prompt.Nope>: can\'t evaluate field Nope in type interface {}'}
    assert httpx.post(daemon.url + "/api/generate", timeout=T, json={
        "model": "tiny:test", "prompt": "x", "stream": False}).status_code == 200  # it serves on
