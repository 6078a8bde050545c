"""Anthropic's Messages API for pairs (/v1/messages), driven by the official `anthropic` SDK.

Every answer is compared with /api/chat's for the same conversation on the same daemon, so what is
under test is the translation (anthropic/anthropic.go FromMessagesRequest, ToMessagesResponse,
StreamConverter), not the model. SmolLM2 with the bundled template (which takes tools) answers
greedily; a tiny generated model whose template pre-opens `<think>` stands in for a thinking model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import yaml

from sidecar.api.anthropic import AnthropicFraming
from sidecar.runtime.contract import Delta, Outcome
from tests.conftest import SMOLLM2_REF, Daemon, write_config
from tests.models import write_tiny_llama
from tests.test_thinking import JINJA_THINKING

pytestmark = pytest.mark.daemon

PAIR = "smollm2:135m"
THINKER = "think:jinja"
T = 180  # generous: a small, shared machine
ROOT = Path(__file__).resolve().parent.parent
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}
OLLAMA_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER["input_schema"]}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """SmolLM2 as the bundled pairs.yaml declares it (its template takes tools), greedy, and a
    thinking pair."""
    d = tmp_path_factory.mktemp("anthropic")
    bundled = yaml.safe_load((ROOT / "sidecar" / "pairs.yaml").read_text())["pairs"][PAIR]
    thinker = write_tiny_llama(d / "thinker.gguf", seed=1, end_bias=0.0, chat_template=JINJA_THINKING)
    cfg = write_config(d / "pairs.yaml", f"""
pairs:
  {PAIR}:
    from: {SMOLLM2_REF}
    draft: ngram
    template: {json.dumps(bundled["template"])}
    parameters: {{temperature: 0, num_ctx: 2048}}
    runtime: {{num_gpu: 0}}
  {THINKER}:
    from: {thinker}
    parameters: {{temperature: 0, num_ctx: 512}}
    runtime: {{num_thread: 1}}
""")
    daemon = Daemon(cfg)
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.url, api_key="unused", timeout=T, max_retries=0)


def chat(daemon: Daemon, messages: list[dict[str, Any]], model: str = PAIR, **body: Any) -> dict[str, Any]:
    """/api/chat's answer for the same conversation (Ollama's messages)."""
    r = httpx.post(daemon.url + "/api/chat", timeout=T,
                   json={"model": model, "messages": messages, "stream": False, **body})
    assert r.status_code == 200, r.text
    return r.json()


def events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    """`event: X\\ndata: {json}\\n\\n` events, each event's name matching its data's type."""
    out = []
    for raw in body.decode().split("\n\n")[:-1]:
        head, data = raw.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        obj = json.loads(data[6:])
        assert obj["type"] == head[7:]
        out.append((head[7:], obj))
    return out


HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]


def test_create_matches_api_chat(client: anthropic.Anthropic, daemon: Daemon) -> None:
    m = client.messages.create(model=PAIR, max_tokens=24, messages=HELLO)  # type: ignore[arg-type]
    ref = chat(daemon, HELLO, options={"num_predict": 24})
    assert m.type == "message" and m.role == "assistant" and m.model == PAIR and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == ref["message"]["content"]  # type: ignore[union-attr]
    assert m.stop_reason == ("max_tokens" if ref["done_reason"] == "length" else "end_turn")
    assert m.usage.output_tokens == ref["eval_count"]
    # input + cached is the whole prompt, whichever of the two requests came first
    whole = client.messages.count_tokens(model=PAIR, messages=HELLO).input_tokens  # type: ignore[arg-type]
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == whole


def test_warm_prompt_counts_as_cached(client: anthropic.Anthropic) -> None:
    """A repeated prompt comes from the prefix cache: Ollama would report 1 input token; the
    cached part goes to cache_read_input_tokens, so the sum stays the whole prompt."""
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    first = client.messages.create(model=PAIR, max_tokens=4, messages=msgs)  # type: ignore[arg-type]
    again = client.messages.create(model=PAIR, max_tokens=4, messages=msgs)  # type: ignore[arg-type]
    whole = client.messages.count_tokens(model=PAIR, messages=msgs).input_tokens  # type: ignore[arg-type]
    assert first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0) == whole
    assert again.usage.input_tokens + (again.usage.cache_read_input_tokens or 0) == whole
    assert (again.usage.cache_read_input_tokens or 0) > whole // 2


def test_stream_through_the_sdk(client: anthropic.Anthropic, daemon: Daemon) -> None:
    with client.messages.stream(model=PAIR, max_tokens=24, messages=HELLO) as s:  # type: ignore[arg-type]
        text = "".join(s.text_stream)
        final = s.get_final_message()
    ref = chat(daemon, HELLO, options={"num_predict": 24})
    assert text == ref["message"]["content"] == final.content[0].text  # type: ignore[union-attr]
    assert final.usage.output_tokens == ref["eval_count"]
    assert final.stop_reason in ("max_tokens", "end_turn")


def test_stream_wire_events(daemon: Daemon) -> None:
    """The events in StreamConverter's order, on the wire."""
    r = httpx.post(daemon.url + "/v1/messages?beta=true", timeout=T, headers={
        "anthropic-version": "2023-06-01", "anthropic-beta": "context-management-2025-06-27", "x-api-key": "x"},
        json={"model": PAIR, "max_tokens": 8, "stream": True, "messages": HELLO,
              "context_management": {"edits": []}, "output_config": {"effort": "high"},
              "metadata": {"user_id": "u"}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.content)
    names = [n for n, _ in evs]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    start = evs[0][1]["message"]
    assert start["content"] == [] and start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] > 0
    assert evs[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(e["delta"]["type"] == "text_delta" and e["index"] == 0 for _, e in evs[2:-3])
    delta = evs[-2][1]
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn") and delta["usage"]["output_tokens"] <= 8


def test_system_as_string_or_blocks(client: anthropic.Anthropic, daemon: Daemon) -> None:
    """Blocks' texts are concatenated, as Ollama does, into one system message."""
    blocks = client.messages.create(model=PAIR, max_tokens=12, messages=HELLO,  # type: ignore[arg-type]
                                    system=[{"type": "text", "text": "You are terse. "},
                                            {"type": "text", "text": "Answer in French."}])
    string = client.messages.create(model=PAIR, max_tokens=12, messages=HELLO,  # type: ignore[arg-type]
                                    system="You are terse. Answer in French.")
    ref = chat(daemon, [{"role": "system", "content": "You are terse. Answer in French."}, *HELLO],
               options={"num_predict": 12})
    assert blocks.content[0].text == string.content[0].text == ref["message"]["content"]  # type: ignore[union-attr]


def test_tools_and_a_tool_result_history(client: anthropic.Anthropic, daemon: Daemon) -> None:
    """A tool_use and its tool_result become Ollama's assistant tool_calls and `tool` message."""
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny, 21 C"}]},
            {"type": "text", "text": "So, should I take an umbrella?"}]},
    ]
    m = client.messages.create(model=PAIR, max_tokens=24, tools=[WEATHER], messages=history)  # type: ignore[arg-type]
    ref = chat(daemon, [
        history[0],
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "So, should I take an umbrella?"},
    ], tools=[OLLAMA_WEATHER], options={"num_predict": 24})
    text = "".join(b.text for b in m.content if b.type == "text")
    calls = [{"name": b.name, "input": b.input} for b in m.content if b.type == "tool_use"]
    assert text == ref["message"]["content"]
    assert calls == [{"name": c["function"]["name"], "input": c["function"]["arguments"]}
                     for c in ref["message"].get("tool_calls", [])]
    assert m.stop_reason == ("tool_use" if calls else "max_tokens" if ref["done_reason"] == "length" else "end_turn")


def test_thinking_on_a_thinking_pair(client: anthropic.Anthropic, daemon: Daemon) -> None:
    ref = chat(daemon, HELLO, model=THINKER, think=True, options={"num_predict": 16})
    assert ref["message"]["thinking"]
    m = client.messages.create(model=THINKER, max_tokens=16, messages=HELLO,  # type: ignore[arg-type]
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content[0].type == "thinking" and m.content[0].thinking == ref["message"]["thinking"]
    with client.messages.stream(model=THINKER, max_tokens=16, messages=HELLO,  # type: ignore[arg-type]
                                thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        kinds = {e.delta.type for e in s if e.type == "content_block_delta"}
        final = s.get_final_message()
    assert "thinking_delta" in kinds
    assert final.content[0].type == "thinking" and final.content[0].thinking == ref["message"]["thinking"]
    off = client.messages.create(model=THINKER, max_tokens=16, messages=HELLO,  # type: ignore[arg-type]
                                 thinking={"type": "disabled"})
    ref_off = chat(daemon, HELLO, model=THINKER, think=False, options={"num_predict": 16})
    assert all(b.type != "thinking" for b in off.content)
    assert "".join(b.text for b in off.content if b.type == "text") == ref_off["message"]["content"]


def test_thinking_asked_of_a_pair_that_cannot_think_is_dropped(client: anthropic.Anthropic) -> None:
    """relax_thinking: Claude Code asks every model to think; Ollama drops it rather than refuse."""
    m = client.messages.create(model=PAIR, max_tokens=4, messages=HELLO,  # type: ignore[arg-type]
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content and all(b.type == "text" for b in m.content)


def test_unknown_model(client: anthropic.Anthropic, daemon: Daemon) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope:1b", max_tokens=4, messages=HELLO)  # type: ignore[arg-type]
    assert e.value.status_code == 404
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"] == {"type": "not_found_error", "message": "model 'nope:1b' not found"}
    r = httpx.post(daemon.url + "/v1/messages/count_tokens", json={"model": "nope:1b", "messages": HELLO}, timeout=T)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_count_tokens_is_the_rendered_prompt(client: anthropic.Anthropic, daemon: Daemon) -> None:
    """The pair's template and tokenizer: the text /api/chat renders, counted by the model."""
    n = client.messages.count_tokens(model=PAIR, messages=HELLO, system="Be brief.",  # type: ignore[arg-type]
                                     tools=[WEATHER]).input_tokens  # type: ignore[list-item]
    bare = client.messages.count_tokens(model=PAIR, messages=HELLO).input_tokens  # type: ignore[arg-type]
    rendered = chat(daemon, [{"role": "system", "content": "Be brief."}, *HELLO], tools=[OLLAMA_WEATHER],
                    _debug_render_only=True)["_debug_info"]["rendered_template"]
    assert n > bare + len(json.dumps(WEATHER)) // 8  # the tool list is in the prompt
    assert len(rendered) // 8 < n < len(rendered)  # tokens, not characters


HOSTILE: list[tuple[Any, str]] = [
    ({"max_tokens": 8, "messages": HELLO}, "model is required"),
    ({"model": PAIR, "messages": HELLO}, "max_tokens is required and must be positive"),
    ({"model": PAIR, "max_tokens": -1, "messages": HELLO}, "max_tokens is required and must be positive"),
    ({"model": PAIR, "max_tokens": 1e30, "messages": HELLO}, "MessagesRequest.max_tokens of type int"),
    ({"model": PAIR, "max_tokens": 2**64, "messages": HELLO}, "MessagesRequest.max_tokens of type int"),
    ({"model": PAIR, "max_tokens": "8", "messages": HELLO}, "cannot unmarshal string"),
    ({"model": PAIR, "max_tokens": 8}, "messages is required"),
    ({"model": PAIR, "max_tokens": 8, "messages": "hi"}, "cannot unmarshal string"),
    ({"model": PAIR, "max_tokens": 8, "messages": [7]}, "anthropic.MessageParam"),
    ({"model": PAIR, "max_tokens": 8, "messages": [{"role": "user"}]}, "unexpected end of JSON input"),
    ({"model": PAIR, "max_tokens": 8, "messages": [{"role": "user", "content": 3}]}, "[]anthropic.ContentBlock"),
    ({"model": PAIR, "max_tokens": 8, "messages": [{"role": "user", "content": ["x"]}]}, "anthropic.ContentBlock"),
    ({"model": PAIR, "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "ContentBlock.text of type string"),
    ({"model": PAIR, "max_tokens": 8, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "name": "f", "input": {}}]}]}, "tool_use block missing required 'id' field"),
    ({"model": PAIR, "max_tokens": 8, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "[1]"}]}]}, "can't find closing"),
    ({"model": PAIR, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, "Only base64 images are supported"),
    ({"model": PAIR, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": "%%%"}}]}]}, "invalid base64 image data"),
    ({"model": PAIR, "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "mystery", "x": 1}]}]},
     "no content the model can read"),
    ({"model": PAIR, "max_tokens": 8, "messages": HELLO, "tools": [{"name": "f", "input_schema": []}]},
     'invalid input_schema for tool "f"'),
    ({"model": PAIR, "max_tokens": 8, "messages": HELLO, "tools": [{"name": "f", "input_schema": {
        "type": "object", "properties": {"a": 5}}}]}, "api.ToolProperty"),
    ({"model": PAIR, "max_tokens": 8, "messages": HELLO, "tools": [{"name": "f", "input_schema": {
        "type": "object", "properties": {"a": {"type": 5}}}}]}, "api.PropertyType"),
    ({"model": PAIR, "max_tokens": 8, "messages": HELLO, "tools": {"name": "f"}}, "[]anthropic.Tool"),
    ({"model": PAIR, "max_tokens": 8, "messages": HELLO, "temperature": "hot"}, "of type float64"),
    ({"model": PAIR, "max_tokens": 8, "messages": HELLO, "stop_sequences": "x"}, "of type []string"),
    ({"model": PAIR, "max_tokens": 8, "messages": HELLO, "thinking": True}, "anthropic.ThinkingConfig"),
    ({"model": PAIR, "max_tokens": 8, "messages": HELLO, "stream": "yes"}, "of type bool"),
    ([1, 2], "cannot unmarshal array"),
    ("{", "unexpected EOF"),
]


@pytest.mark.parametrize(("body", "message"), HOSTILE)
def test_hostile_input_is_a_400_in_anthropics_shape(daemon: Daemon, body: Any, message: str) -> None:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    r = httpx.post(daemon.url + "/v1/messages", content=data, timeout=T, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert message in err["error"]["message"]
    assert err["request_id"].startswith("req_")


def test_the_daemon_keeps_serving_after_hostile_input(client: anthropic.Anthropic, daemon: Daemon) -> None:
    """Also what Ollama accepts: unknown block types beside text (ignored), a max_tokens far past
    the window (bounded), unknown fields and tool_choice; and no traceback in the log."""
    m = client.messages.create(model=PAIR, max_tokens=2**40, stop_sequences=["."],  # type: ignore[arg-type]
                               messages=[{"role": "user", "content": [
                                   {"type": "text", "text": "Say hi."}, {"type": "mystery"},
                                   {"type": "redacted_thinking", "data": "xx"}]}],
                               tool_choice={"type": "auto"}, extra_body={"context_management": {"edits": []}})
    assert m.content and m.stop_reason in ("end_turn", "max_tokens")
    assert not daemon.traces()


def test_a_refused_request_leaves_a_log_line(daemon: Daemon) -> None:
    httpx.post(daemon.url + "/v1/messages", json={"model": PAIR, "max_tokens": 8, "messages": [7]}, timeout=T)
    lines = [json.loads(ln) for ln in daemon.log().splitlines() if ln.startswith("{")]
    assert any(rec.get("path") == "/v1/messages" and rec.get("status") == "error 400" for rec in lines)


# -- the framing on its own: tool calls in a stream (a greedy model does not call tools on cue) ----------
def test_stream_of_thinking_text_and_a_tool_call() -> None:
    """StreamConverter.Process: thinking, then text (the thinking block closed), then the tool call
    as a block of its own with the whole input in one input_json_delta; stop_reason tool_use."""
    class Entry:
        name = PAIR

    f = AnthropicFraming(Entry(), estimated_input=7)  # type: ignore[arg-type]
    call = {"id": "call_1", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}
    out = f.delta(Delta(thinking="hmm")) + f.delta(Delta(content="Let me look.")) + \
        f.delta(Delta(tool_calls=(call,))) + f.final(Outcome(done_reason="stop", tokens=[1, 2], prompt_tokens=3,
                                                             prompt_cached=40))
    assert [(e["type"], e.get("index")) for e in out] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("content_block_start", 2), ("content_block_delta", 2),
        ("content_block_stop", 2), ("message_delta", None), ("message_stop", None)]
    assert out[0]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}
    assert out[7]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert out[8]["delta"] == {"type": "input_json_delta", "partial_json": '{"city":"Paris"}'}
    assert out[10] == {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                       "usage": {"input_tokens": 3, "output_tokens": 2, "cache_read_input_tokens": 40}}
    assert f.encode(out[-1]) == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def test_a_slow_first_token_keeps_the_stream_alive_with_pings() -> None:
    """While the prefill runs (respond.KEEPALIVE), message_start and then pings; the first text
    does not repeat message_start."""
    class Entry:
        name = PAIR

    f = AnthropicFraming(Entry(), estimated_input=7)  # type: ignore[arg-type]
    assert [e["type"] for e in f.waiting()] == ["message_start", "ping"]
    assert f.waiting() == [{"type": "ping"}]
    assert [e["type"] for e in f.delta(Delta(content="hi"))] == ["content_block_start", "content_block_delta"]
