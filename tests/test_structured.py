"""Structured output over the wire: `format` on /api/generate and /api/chat, `response_format` on /v1.

Driven by the official `ollama` and `openai` clients against a daemon whose pairs always speculate
(a model draft and the n-gram drafter, adaptive off), so every answer went through grammar-masked
verification. Each answer must validate against its schema, and a speculative answer at temperature
0 must equal the same pair's target-only answer (`draft_num_predict: 0`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.conftest import Daemon, write_config

pytestmark = pytest.mark.daemon

T = 120
DRAFT, NGRAM = "tiny:draft", "tiny:ngram"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}, "kind": {"enum": ["a", "bc"]}},
    "required": ["n", "ok", "kind"],
}
MSGS = [{"role": "user", "content": "give me a record"}]


@pytest.fixture(scope="module")
def sd(tmp_path_factory: pytest.TempPathFactory, tiny_pair: tuple[Path, Path]) -> Iterator[Daemon]:
    target, draft = tiny_pair
    d = tmp_path_factory.mktemp("structured")
    spec = "speculative: {n_max: 4, p_min: 0.0, min_predict: 0, adaptive: false}"
    cfg = write_config(d / "pairs.yaml", f"""
pairs:
  {DRAFT}:
    from: {target}
    draft: {draft}
    parameters: {{temperature: 0, num_ctx: 512, num_predict: 160}}
    {spec}
    runtime: {{num_thread: 1}}
  {NGRAM}:
    from: {target}
    draft: {{type: ngram, min_n: 1, max_n: 3}}
    parameters: {{temperature: 0, num_ctx: 512, num_predict: 160}}
    {spec}
    runtime: {{num_thread: 1}}
""")
    daemon = Daemon(cfg)
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def oc(sd: Daemon) -> ollama.Client:
    return ollama.Client(host=sd.url, timeout=T)


@pytest.fixture(scope="module")
def v1(sd: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=sd.url + "/v1", api_key="unused", timeout=T, max_retries=0)


@pytest.mark.parametrize("model", [DRAFT, NGRAM])
def test_generate_follows_schema_and_equals_target_only(sd: Daemon, oc: ollama.Client, model: str) -> None:
    for i in range(3):
        prompt = f"record number {i} please"
        spec = oc.generate(model=model, prompt=prompt, format=SCHEMA)
        assert spec.done_reason == "stop"
        jsonschema.validate(json.loads(spec.response), SCHEMA)
        # The speculation counters are not in the client's model: read them off the wire.
        body = {"model": model, "prompt": prompt, "format": SCHEMA, "stream": False}
        again = httpx.post(sd.url + "/api/generate", json=body, timeout=T).json()
        plain = httpx.post(sd.url + "/api/generate", json={**body, "options": {"draft_num_predict": 0}},
                           timeout=T).json()
        assert spec.response == again["response"] == plain["response"]
        assert again["draft_tokens"] > 0 and plain["draft_tokens"] == 0


@pytest.mark.parametrize("model", [DRAFT, NGRAM])
def test_chat_stream_sampled_follows_schema(oc: ollama.Client, model: str) -> None:
    for seed in range(3):
        chunks = list(oc.chat(model=model, messages=MSGS, format=SCHEMA, stream=True,
                              options={"temperature": 1.0, "seed": seed}))
        assert chunks[-1].done and chunks[-1].done_reason == "stop"
        jsonschema.validate(json.loads("".join(c.message.content or "" for c in chunks)), SCHEMA)


def test_json_format_and_empty_format(sd: Daemon) -> None:
    def chat(fmt: Any) -> dict[str, Any]:
        r = httpx.post(sd.url + "/api/chat", json={"model": NGRAM, "messages": MSGS, "stream": False, "format": fmt,
                                                   "options": {"num_predict": 24}}, timeout=T)
        assert r.status_code == 200, r.text
        return r.json()

    constrained = chat("json")["message"]["content"]
    assert constrained.startswith("{")  # a random model may not finish within num_predict: truncated JSON
    free = chat("")["message"]["content"]
    assert free == chat(None)["message"]["content"] != constrained


@pytest.mark.parametrize(("fmt", "message"), [
    ({"type": "no-such-type"}, "invalid JSON schema in format"),
    ("yaml", 'invalid format: "yaml"'),
    (5, 'invalid format: "5"'),
])
def test_bad_formats_are_ollamas_400(sd: Daemon, fmt: Any, message: str) -> None:
    for path, body in (("/api/generate", {"prompt": "x"}), ("/api/chat", {"messages": MSGS})):
        r = httpx.post(sd.url + path, json={"model": NGRAM, "format": fmt, **body}, timeout=T)
        assert r.status_code == 400 and message in r.json()["error"], r.text


def test_openai_json_schema(v1: openai.OpenAI) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    r = v1.chat.completions.create(model=DRAFT, messages=MSGS, response_format=rf, temperature=0)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)
    stream = v1.chat.completions.create(model=DRAFT, messages=MSGS, response_format=rf, temperature=0,  # type: ignore[arg-type]
                                        stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    done = v1.completions.create(model=NGRAM, prompt="a record", extra_body={"response_format": rf}, temperature=0.5,
                                 seed=3, max_tokens=160)
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)


def test_openai_json_object_and_errors(v1: openai.OpenAI) -> None:
    r = v1.chat.completions.create(model=NGRAM, messages=MSGS, response_format={"type": "json_object"},  # type: ignore[arg-type]
                                   max_tokens=16, temperature=0)
    assert (r.choices[0].message.content or "").startswith("{")
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema"):
        v1.chat.completions.create(model=NGRAM, messages=MSGS,  # type: ignore[arg-type]
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    with pytest.raises(openai.BadRequestError, match=r"json_schema\.schema"):
        v1.chat.completions.create(model=NGRAM, messages=MSGS,  # type: ignore[arg-type]
                                   response_format={"type": "json_schema", "json_schema": {"name": "x"}})
