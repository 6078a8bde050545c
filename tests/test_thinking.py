"""Thinking as Ollama does it, on a real daemon: capability, `think`, parsing, response fields.

A tiny generated model stands in for a reasoning model: the parser runs on whatever the model
writes. Its greedy output is fixed, so the test picks a closing tag out of that output and
declares a Go template whose `.Thinking` block uses it (thinking/template.go InferTags reads the
tags from there); the template also pre-opens `<think>` in the generation prompt, as qwen3-style
templates do, so everything the model writes is thinking until it writes the closing tag.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from sidecar.templates.parsers import ThinkingParser
from tests import openapi
from tests.conftest import Daemon, write_config
from tests.models import write_tiny_llama

pytestmark = pytest.mark.daemon

T = 120
MESSAGES = [{"role": "user", "content": "Think about it."}]


def go_template(close: str) -> str:
    return ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}"
            "{{ if .Thinking }}<think>{{ .Thinking }}" + close + "{{ end }}<|im_end|>\n{{ end }}"
            "<|im_start|>assistant\n{{ if .Think }}<think>{{ end }}")


JINJA_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}"
)


def config(model: Path, thinker: Path, close: str) -> str:
    params = "{temperature: 0, num_ctx: 512, num_predict: 48}"
    return f"""
pairs:
  think:go:
    from: {model}
    template: {json.dumps(go_template(close))}
    parameters: {params}
    runtime: {{num_thread: 1}}
  think:jinja:
    from: {thinker}
    parameters: {params}
    runtime: {{num_thread: 1}}
  plain:test:
    from: {model}
    parameters: {params}
    runtime: {{num_thread: 1}}
"""


def chat(d: Daemon, model: str = "think:go", **body: Any) -> httpx.Response:
    return httpx.post(d.url + "/api/chat", timeout=T, json={"model": model, "messages": MESSAGES, "stream": False,
                                                             **body})


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str, str]]:
    """(daemon, the model's greedy output after the pre-opened tag, the closing tag picked from it)."""
    d = tmp_path_factory.mktemp("thinking")
    model = write_tiny_llama(d / "endless.gguf", seed=1, end_bias=0.0)
    thinker = write_tiny_llama(d / "thinker.gguf", seed=1, end_bias=0.0, chat_template=JINJA_THINKING)
    cfg = write_config(d / "pairs.yaml", config(model, thinker, "ZZZZ"))
    daemon = Daemon(cfg)
    try:
        # What the model writes after the pre-opened tag: raw, so no parser touches it.
        prompt = chat(daemon, _debug_render_only=True).json()["_debug_info"]["rendered_template"]
        assert prompt.endswith("<think>")
        raw = httpx.post(daemon.url + "/api/generate", timeout=T, json={
            "model": "plain:test", "prompt": prompt, "raw": True, "stream": False}).json()["response"]
        # A closing tag the output really contains, first seen a dozen characters in.
        close = next(raw[i:i + 3] for i in range(12, 30)
                     if raw[i:i + 3].strip() == raw[i:i + 3] and raw.find(raw[i:i + 3]) == i)
        old = httpx.get(daemon.url + "/sidecar/status", timeout=T).json()["config_hash"]
        cfg.write_text(config(model, thinker, close))
        deadline = time.monotonic() + 30
        while httpx.get(daemon.url + "/sidecar/status", timeout=T).json()["config_hash"] == old:
            assert time.monotonic() < deadline, "the reload did not happen"
            time.sleep(0.2)
        yield daemon, raw, close
    finally:
        daemon.stop()


def split(raw: str, close: str) -> tuple[str, str]:
    """(thinking, content) as Ollama's parser splits the output after a pre-fed opening tag."""
    p = ThinkingParser("<think>", close)
    p.add("<think>")
    return p.add(raw)


def test_the_template_has_the_thinking_capability(setup: tuple[Daemon, str, str]) -> None:
    d, _, _ = setup
    client = ollama.Client(host=d.url)
    assert "thinking" in client.show("think:go").capabilities
    assert "thinking" in client.show("think:jinja").capabilities
    assert "thinking" not in client.show("plain:test").capabilities


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_the_ollama_client(setup: tuple[Daemon, str, str], stream: bool) -> None:
    d, raw, close = setup
    thinking, content = split(raw, close)
    assert thinking and content
    client = ollama.Client(host=d.url)
    if stream:
        parts = list(client.chat(model="think:go", messages=MESSAGES, think=True, stream=True))
        got = ("".join(p.message.thinking or "" for p in parts), "".join(p.message.content for p in parts))
        assert parts[-1].done and not parts[-1].message.thinking
        assert any(p.message.thinking and not p.message.content for p in parts)  # thinking streams as deltas
    else:
        r = client.chat(model="think:go", messages=MESSAGES, think=True)
        got = (r.message.thinking, r.message.content)
    assert got == (thinking, content)


def test_unset_think_means_on_for_a_thinking_model(setup: tuple[Daemon, str, str]) -> None:
    d, raw, close = setup
    body = chat(d).json()
    openapi.check(openapi.CHAT_RESPONSE, body)
    assert (body["message"]["thinking"], body["message"]["content"]) == split(raw, close)


def test_think_false_renders_without_the_tag_and_parses_nothing(setup: tuple[Daemon, str, str]) -> None:
    d, _, _ = setup
    rendered = chat(d, think=False, _debug_render_only=True).json()["_debug_info"]["rendered_template"]
    assert not rendered.endswith("<think>")
    body = chat(d, think=False).json()
    assert "thinking" not in body["message"] and body["message"]["content"]


def test_generate_puts_thinking_at_the_top_level(setup: tuple[Daemon, str, str]) -> None:
    d, raw, close = setup
    thinking, content = split(raw, close)
    r = httpx.post(d.url + "/api/generate", timeout=T, json={
        "model": "think:go", "prompt": MESSAGES[0]["content"], "think": "high", "stream": False})
    body = r.json()
    openapi.check(openapi.GENERATE_RESPONSE, body)
    assert (body["thinking"], body["response"]) == (thinking, content)
    with httpx.stream("POST", d.url + "/api/generate", timeout=T, json={
            "model": "think:go", "prompt": MESSAGES[0]["content"], "think": True}) as s:
        chunks = [json.loads(line) for line in s.iter_lines()]
    for c in chunks:
        openapi.check(openapi.GENERATE_RESPONSE, c)
    assert "".join(c.get("thinking", "") for c in chunks) == thinking
    assert "".join(c["response"] for c in chunks) == content


def test_a_jinja_template_gets_enable_thinking(setup: tuple[Daemon, str, str]) -> None:
    d, _, _ = setup
    on = chat(d, "think:jinja", _debug_render_only=True).json()["_debug_info"]["rendered_template"]
    off = chat(d, "think:jinja", think=False, _debug_render_only=True).json()["_debug_info"]["rendered_template"]
    assert on.endswith("<think>\n") and off.endswith("</think>\n\n")
    body = chat(d, "think:jinja").json()
    assert body["message"]["thinking"]  # the model never writes </think>: all of it is thinking
    assert body["message"]["content"] == ""
    assert "thinking" not in chat(d, "think:jinja", think=False).json()["message"]


def test_a_model_that_cannot_think(setup: tuple[Daemon, str, str]) -> None:
    d, _, _ = setup
    for think in (True, "low", "max"):
        r = chat(d, "plain:test", think=think)
        assert r.status_code == 400 and r.json() == {"error": '"plain:test" does not support thinking'}
    assert chat(d, "plain:test", think=False).status_code == 200
    r = chat(d, "plain:test", think="lots")
    assert r.status_code == 400 and r.json()["error"].startswith('invalid think value: "lots"')
    r = httpx.post(d.url + "/api/generate", timeout=T, json={"model": "plain:test", "prompt": "x", "think": "AAA"})
    assert r.status_code == 400 and "invalid think value" in r.json()["error"]


def test_openai_reasoning(setup: tuple[Daemon, str, str]) -> None:
    d, raw, close = setup
    thinking, content = split(raw, close)
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="x")
    r = client.chat.completions.create(model="think:go", messages=MESSAGES, temperature=0)  # type: ignore[arg-type]
    msg = r.choices[0].message
    assert (msg.model_extra or {}).get("reasoning") == thinking and msg.content == content
    chunks = list(client.chat.completions.create(model="think:go", messages=MESSAGES, temperature=0,  # type: ignore[arg-type]
                                                 stream=True))
    got = "".join((c.choices[0].delta.model_extra or {}).get("reasoning", "") for c in chunks if c.choices)
    assert got == thinking
    off = client.chat.completions.create(model="think:go", messages=MESSAGES, temperature=0,  # type: ignore[arg-type]
                                         reasoning_effort="none")
    assert not (off.choices[0].message.model_extra or {}).get("reasoning")
    with pytest.raises(openai.BadRequestError, match="invalid reasoning value"):
        client.chat.completions.create(model="think:go", messages=MESSAGES,  # type: ignore[arg-type]
                                       reasoning_effort="enormous")  # type: ignore[arg-type]


def test_format_waits_for_the_thinking_to_end(setup: tuple[Daemon, str, str]) -> None:
    """Ollama holds `format` back while the model thinks, then constrains the answer."""
    d, raw, close = setup
    thinking, _ = split(raw, close)
    body = chat(d, format="json").json()
    assert body["message"]["thinking"] == thinking  # unconstrained until the closing tag
    content = body["message"]["content"]
    assert content.lstrip().startswith("{"), content  # the answer follows the JSON grammar


def test_earlier_thinking_reaches_the_template(setup: tuple[Daemon, str, str]) -> None:
    d, _, close = setup
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "thinking": "t"},
               {"role": "user", "content": "c"}]
    r = httpx.post(d.url + "/api/chat", timeout=T, json={
        "model": "think:go", "messages": history, "stream": False, "_debug_render_only": True})
    assert f"b<think>t{close}<|im_end|>" in r.json()["_debug_info"]["rendered_template"]
