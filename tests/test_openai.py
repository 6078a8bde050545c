"""The OpenAI-compatible /v1 API for pairs, driven by the official `openai` client and checked on the wire.

Every /v1 answer is compared with the native API's answer for the same request on the same
daemon, so the mapping (defaults, max_tokens, stop, penalties, templates) is what is under test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Daemon, write_config

pytestmark = pytest.mark.daemon

PAIR = "tiny:test"
T = 120  # generous: the test machine is small and shared (and pairs run on one thread: tiny models, busy CPUs)


@pytest.fixture(scope="module")
def v1(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[Daemon]:
    """A sidecar with one pair whose own default temperature (0) /v1 must override with 1.0."""
    d = tmp_path_factory.mktemp("openai")
    cfg = write_config(d / "pairs.yaml", f"""
pairs:
  {PAIR}:
    from: {tiny}
    parameters: {{temperature: 0, num_ctx: 256}}
    runtime: {{num_thread: 1}}
""")
    daemon = Daemon(cfg)
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def client(v1: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=v1.url + "/v1", api_key="unused", timeout=T, max_retries=0)


def native(daemon: Daemon, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(daemon.url + path, json={"model": PAIR, "stream": False, **body}, timeout=T)
    assert r.status_code == 200, r.text
    return r.json()


def sse(body: bytes) -> list[Any]:
    """`data: {json}\\n\\n` events; the last must be `data: [DONE]`."""
    assert body.endswith(b"data: [DONE]\n\n")
    events = body.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") for e in events)
    return [e[6:].decode() if e == b"data: [DONE]" else json.loads(e[6:]) for e in events]


MSGS = [{"role": "user", "content": "hello there"}]


def test_chat_matches_native(client: openai.OpenAI, v1: Daemon) -> None:
    r = client.chat.completions.create(model=PAIR, messages=MSGS, max_tokens=10, temperature=0)
    ref = native(v1, "/api/chat", {"messages": MSGS, "options": {"temperature": 0, "num_predict": 10}})
    assert r.choices[0].message.content == ref["message"]["content"]
    assert r.choices[0].message.role == "assistant"
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.system_fingerprint == "fp_ollama"
    assert r.model == PAIR
    assert r.choices[0].finish_reason == ("length" if ref["eval_count"] == 10 else "stop")
    assert r.usage is not None and r.usage.completion_tokens == ref["eval_count"]
    # The native request came second: its prompt came from the prefix cache, which it does not count.
    assert r.usage.prompt_tokens >= ref["prompt_eval_count"] >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_wire_format(v1: Daemon, client: openai.OpenAI) -> None:
    body = {"model": PAIR, "messages": MSGS, "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    r = httpx.post(v1.url + "/v1/chat/completions", json=body, timeout=T)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.content)
    assert events[-1] == "[DONE]"
    chunks, usage, final = events[:-3], events[-2], events[-3]
    assert all(c["object"] == "chat.completion.chunk" and c["system_fingerprint"] == "fp_ollama" for c in events[:-1])
    assert len({c["id"] for c in events[:-1]}) == 1 and len({c["created"] for c in events[:-1]}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = client.chat.completions.create(model=PAIR, messages=MSGS, max_tokens=10, temperature=0)
    assert text == whole.choices[0].message.content

    # The SDK's view of the same stream.
    stream = client.chat.completions.create(model=PAIR, messages=MSGS, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    got = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == text
    assert got[-1].usage is not None and got[-1].usage.completion_tokens == len(chunks)
    # Without include_usage, no usage chunk.
    plain = sse(httpx.post(v1.url + "/v1/chat/completions", json={**body, "stream_options": None}, timeout=T).content)
    assert all(e["choices"] for e in plain[:-1])


def test_completions_match_native(client: openai.OpenAI, v1: Daemon) -> None:
    """/v1/completions goes through the template, like /api/generate without raw."""
    r = client.completions.create(model=PAIR, prompt="once upon", max_tokens=10, temperature=0)
    ref = native(v1, "/api/generate", {"prompt": "once upon", "options": {"temperature": 0, "num_predict": 10}})
    assert r.choices[0].text == ref["response"]
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.usage is not None and r.usage.completion_tokens == ref["eval_count"]
    stream = list(client.completions.create(model=PAIR, prompt="once upon", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref["response"]
    assert stream[-2].choices[0].finish_reason == r.choices[0].finish_reason
    assert stream[-1].choices == [] and stream[-1].usage is not None


def test_defaults_and_sampling_options(client: openai.OpenAI, v1: Daemon) -> None:
    """No temperature/top_p means 1.0 each (overriding the pair's 0); seed and penalties pass through."""
    opts = {"seed": 42, "num_predict": 16, "frequency_penalty": 0.5, "presence_penalty": 0.3}
    r = client.chat.completions.create(model=PAIR, messages=MSGS, max_tokens=16, seed=42, frequency_penalty=0.5,
                                       presence_penalty=0.3)
    sampled = native(v1, "/api/chat", {"messages": MSGS, "options": {**opts, "temperature": 1.0, "top_p": 1.0}})
    greedy = native(v1, "/api/chat", {"messages": MSGS, "options": {**opts, "temperature": 0}})
    assert r.choices[0].message.content == sampled["message"]["content"]
    assert sampled["message"]["content"] != greedy["message"]["content"]


@pytest.mark.parametrize("as_list", [False, True])
def test_stop(client: openai.OpenAI, as_list: bool) -> None:
    full = client.completions.create(model=PAIR, prompt="stop test", max_tokens=30, temperature=0).choices[0].text
    assert len(full) > 8
    stop = full[5:8]
    r = client.completions.create(model=PAIR, prompt="stop test", max_tokens=30, temperature=0,
                                  stop=[stop, "\x00never"] if as_list else stop)
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_models(client: openai.OpenAI) -> None:
    listed = client.models.list()
    assert [m.id for m in listed.data] == [PAIR]
    m = client.models.retrieve(PAIR)
    assert m.id == PAIR and m.object == "model" and m.owned_by == "library" and m.created > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope:1")


@pytest.mark.parametrize(("path", "body", "status", "kind", "message"), [
    ("/v1/chat/completions", {"model": "nope:1", "messages": MSGS}, 404, "not_found_error", "model 'nope:1' not found"),
    ("/v1/chat/completions", {"model": PAIR, "messages": []}, 400, "invalid_request_error", "[] is too short"),
    ("/v1/chat/completions", {"model": PAIR, "messages": MSGS, "temperature": "hot"}, 400, "invalid_request_error",
     "temperature"),
    ("/v1/chat/completions", {"model": PAIR, "messages": MSGS, "temperature": -1}, 400, "invalid_request_error",
     "temperature"),
    ("/v1/chat/completions", {"model": PAIR, "messages": MSGS, "stop": 5}, 400, "invalid_request_error", "stop"),
    # Fields Ollama decodes into structs (openai/openai.go): anything but an object is refused.
    ("/v1/chat/completions", {"model": PAIR, "messages": MSGS, "stream_options": "x"}, 400, "invalid_request_error",
     "invalid stream_options: must be an object"),
    ("/v1/chat/completions", {"model": PAIR, "messages": MSGS, "reasoning": "x"}, 400, "invalid_request_error",
     "invalid reasoning: must be an object"),
    ("/v1/completions", {"model": PAIR, "prompt": ["a", "b"]}, 400, "invalid_request_error",
     "prompt must be a string"),
    # Ollama passes `logprobs` on as top_logprobs, so the same range holds (the whole vocabulary
    # per token was an 8 MB answer to two tokens).
    ("/v1/completions", {"model": PAIR, "prompt": "a", "logprobs": 1000000}, 400, "invalid_request_error",
     "top_logprobs must be between 0 and 20"),
    ("/v1/completions", {"model": PAIR, "prompt": "a", "logprobs": -1}, 400, "invalid_request_error",
     "top_logprobs must be between 0 and 20"),
    ("/v1/embeddings", {"model": PAIR, "input": "x"}, 400, "invalid_request_error", "does not support embeddings"),
])
def test_errors_use_openais_envelope(v1: Daemon, path: str, body: dict, status: int, kind: str, message: str) -> None:
    r = httpx.post(v1.url + path, json=body, timeout=T)
    assert r.status_code == status and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == kind and message in err["message"]


def test_completions_have_no_reasoning_field(v1: Daemon) -> None:
    """Ollama's CompletionRequest has no `reasoning` (openai/openai.go): a string there is an unknown
    field, ignored, where chat completions refuse it."""
    r = httpx.post(v1.url + "/v1/completions", timeout=T,
                   json={"model": PAIR, "prompt": "a", "max_tokens": 2, "reasoning": "x"})
    assert r.status_code == 200, r.text
