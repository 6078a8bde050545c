"""/v1/responses for pairs, through the official `openai` clients (Python and Node) on a real daemon.

The request becomes the same chat request /api/chat runs (Ollama's openai/responses.go
FromResponsesRequest), so greedy text through either door is the same. A tiny model cannot decide
to call a tool, so its call is forced with a `text.format` schema under a template whose calls are
bare JSON, as tests/test_tools.py does; a template with thinking tags that never close makes all
its output thinking, which is what a reasoning summary carries. A second daemon plays the upstream
Ollama for a model that is no pair.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.api.responses import ResponseStore
from sidecar.api.responses_input import chat_messages, chat_tools
from tests.conftest import REPO, Daemon, write_config
from tests.models import write_tiny_llama
from tests.test_thinking import go_template
from tests.test_tools import CALL_SCHEMA, LLAMA

pytestmark = pytest.mark.daemon

T = 120
PAIR, TEXT, THINKER, UP = "tiny:tools", "tiny:text", "tiny:think", "up:model"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": False,
           "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}
CHAT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
FORCE_CALL = {"format": {"type": "json_schema", "name": "call", "schema": CALL_SCHEMA}}
NODE = REPO / "tests" / "node"


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("responses-up")
    model = write_tiny_llama(d / "up.gguf", seed=7)
    daemon = Daemon(write_config(d / "pairs.yaml", f"""
pairs:
  {UP}:
    from: {model}
    parameters: {{temperature: 0, num_ctx: 256, num_predict: 8}}
    runtime: {{num_thread: 1}}
"""))
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def rd(tmp_path_factory: pytest.TempPathFactory, tiny: Path, tiny_endless: Path, up: Daemon) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("responses")
    daemon = Daemon(write_config(d / "pairs.yaml", f"""
upstream: {up.url}
pairs:
  {PAIR}:
    from: {tiny}
    draft: ngram
    template: {json.dumps(LLAMA)}
    parameters: {{temperature: 0, num_ctx: 512, num_predict: 96}}
    speculative: {{n_max: 4, min_predict: 0, adaptive: false}}
    runtime: {{num_thread: 1}}
  {TEXT}:
    from: {tiny_endless}
    draft: ngram
    template: {json.dumps(LLAMA)}
    parameters: {{temperature: 0, num_ctx: 512, num_predict: 32}}
    runtime: {{num_thread: 1}}
  {THINKER}:
    from: {tiny_endless}
    template: {json.dumps(go_template("ZZZZ"))}
    parameters: {{temperature: 0, num_ctx: 512, num_predict: 16}}
    runtime: {{num_thread: 1}}
"""))
    yield daemon
    assert not daemon.traces(), daemon.log()
    daemon.stop()


def client(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", timeout=T, max_retries=0)


def chat(d: Daemon, messages: list[dict[str, Any]], model: str = PAIR, **body: Any) -> dict[str, Any]:
    """/api/chat's greedy answer to the same conversation."""
    r = httpx.post(d.url + "/api/chat", timeout=T, json={
        "model": model, "messages": messages, "stream": False, **body,
        "options": {"temperature": 0, **body.pop("options", {})}})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def post(d: Daemon, body: Any) -> httpx.Response:
    return httpx.post(d.url + "/v1/responses", json=body, timeout=T)


# -- requests become chat requests ----------------------------------------------------------------
def test_string_input_is_one_user_turn(rd: Daemon) -> None:
    c = client(rd)
    ask = [{"role": "user", "content": "Tell me about ferns."}]
    first = c.responses.create(model=TEXT, input="Tell me about ferns.", temperature=0, max_output_tokens=16)
    again = c.responses.create(model=TEXT, input="Tell me about ferns.", temperature=0, max_output_tokens=16)
    want = chat(rd, ask, model=TEXT, options={"num_predict": 16})
    assert first.object == "response" and first.model == TEXT and first.id.startswith("resp_")
    assert first.output_text == again.output_text == want["message"]["content"]
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    # input_tokens is the whole prompt however much of it the prefix cache held; /api/chat, like
    # Ollama, counts only what it evaluated, which is the uncached part.
    assert first.usage is not None and again.usage is not None
    assert first.usage.input_tokens == again.usage.input_tokens
    cached = again.usage.input_tokens_details.cached_tokens
    assert 0 < cached < again.usage.input_tokens
    assert want["prompt_eval_count"] == again.usage.input_tokens - cached
    assert again.usage.output_tokens == want["eval_count"]
    assert again.usage.total_tokens == again.usage.input_tokens + again.usage.output_tokens
    assert again.status == ("incomplete" if want["done_reason"] == "length" else "completed")
    if again.status == "incomplete":
        assert again.incomplete_details is not None and again.incomplete_details.reason == "max_output_tokens"


def test_items_and_instructions_are_the_conversation(rd: Daemon) -> None:
    items: list[Any] = [
        {"role": "user", "content": "Hi"},  # the shorthand message
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a "},
                                                         {"type": "input_text", "text": "colour."}]},
    ]
    r = client(rd).responses.create(model=TEXT, input=items, instructions="Be brief.", temperature=0,
                                    max_output_tokens=12)
    want = chat(rd, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}],
                model=TEXT, options={"num_predict": 12})
    assert r.output_text == want["message"]["content"] and r.instructions == "Be brief."


def test_stream_events_in_ollamas_order(rd: Daemon) -> None:
    whole = client(rd).responses.create(model=TEXT, input="Stream this.", temperature=0, max_output_tokens=12)
    events = list(client(rd).responses.create(model=TEXT, input="Stream this.", temperature=0,
                                              max_output_tokens=12, stream=True))
    types = [e.type for e in events]
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == whole.output_text
    last = events[-1].response  # type: ignore[union-attr]
    assert last.output_text == text and last.usage is not None and last.usage.output_tokens > 0
    assert events[0].response.status == "in_progress"  # type: ignore[union-attr]


def test_stream_wire_format(rd: Daemon) -> None:
    """SSE as Ollama writes it: `event:` and `data:` lines, no `[DONE]`."""
    with httpx.stream("POST", rd.url + "/v1/responses", timeout=T, json={
            "model": TEXT, "input": "x", "stream": True, "max_output_tokens": 4}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().split("\n\n")
    assert blocks[-1] == ""
    for block in blocks[:-1]:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]


# -- tools ----------------------------------------------------------------------------------------
def test_function_call_round_trip(rd: Daemon) -> None:
    c = client(rd)
    ask = "What is the weather in Paris?"
    r = c.responses.create(model=PAIR, input=ask, tools=[WEATHER], text=FORCE_CALL, temperature=0)  # type: ignore[arg-type]
    assert [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert r.tools[0].name == "get_weather"  # type: ignore[union-attr]

    events = list(c.responses.create(model=PAIR, input=ask, tools=[WEATHER], text=FORCE_CALL,  # type: ignore[arg-type]
                                     temperature=0, stream=True))
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert json.loads(events[4].arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert events[2].item.status == "in_progress" and events[5].item.status == "completed"  # type: ignore[union-attr]

    # The call's output goes back as history; the answer is /api/chat's for the same conversation.
    history: list[Any] = [{"role": "user", "content": ask},
                          {"type": "function_call", "call_id": call.call_id, "name": call.name,
                           "arguments": call.arguments},
                          {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}]
    reply = c.responses.create(model=PAIR, input=history, tools=[WEATHER], temperature=0, max_output_tokens=12)  # type: ignore[arg-type]
    want = chat(rd, [{"role": "user", "content": ask},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": call.call_id, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                     {"role": "tool", "content": "18 degrees", "tool_call_id": call.call_id}],
                tools=[CHAT_WEATHER], options={"num_predict": 12})
    assert reply.output[0].type == "message" and reply.output_text == want["message"]["content"]


def test_reasoning_summary_for_a_thinking_pair(rd: Daemon) -> None:
    want = chat(rd, [{"role": "user", "content": "Think."}], model=THINKER, think="low")
    assert want["message"]["thinking"] and not want["message"]["content"]
    c = client(rd)
    r = c.responses.create(model=THINKER, input="Think.", temperature=0, reasoning={"effort": "low", "summary": "auto"})
    assert r.output[0].type == "reasoning"
    assert r.output[0].summary[0].text == want["message"]["thinking"]
    assert r.reasoning is not None and r.reasoning.effort == "low"
    events = list(c.responses.create(model=THINKER, input="Think.", temperature=0, reasoning={"effort": "low"},
                                     stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")  # type: ignore[union-attr]
    assert thought == want["message"]["thinking"]
    assert [e.type for e in events][-3:] == ["response.reasoning_summary_text.done", "response.output_item.done",
                                              events[-1].type]
    # A pair that does not think refuses an effort, as Ollama's chat handler does.
    with pytest.raises(openai.BadRequestError, match=f'"{PAIR}" does not support thinking'):
        c.responses.create(model=PAIR, input="x", reasoning={"effort": "high"})


# -- previous_response_id -------------------------------------------------------------------------
def test_previous_response_id_continues_the_conversation(rd: Daemon) -> None:
    c = client(rd)
    first = c.responses.create(model=TEXT, input="Hi there.", instructions="Be brief.", temperature=0,
                               max_output_tokens=8)
    assert first.store is True
    second = c.responses.create(model=TEXT, input="And then?", previous_response_id=first.id, temperature=0,
                                max_output_tokens=8)
    assert second.previous_response_id == first.id
    # OpenAI: the earlier instructions are not carried over.
    want = chat(rd, [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": first.output_text},
                     {"role": "user", "content": "And then?"}], model=TEXT, options={"num_predict": 8})
    assert second.output_text == want["message"]["content"]
    third = c.responses.create(model=TEXT, input="More.", previous_response_id=second.id, temperature=0,
                               max_output_tokens=8, stream=True)
    last = list(third)[-1].response  # type: ignore[union-attr]
    want = chat(rd, [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": first.output_text},
                     {"role": "user", "content": "And then?"}, {"role": "assistant", "content": second.output_text},
                     {"role": "user", "content": "More."}], model=TEXT, options={"num_predict": 8})
    assert last.output_text == want["message"]["content"]
    assert last.usage.input_tokens_details.cached_tokens > 0  # the history was the prefix cache's


def test_unknown_or_unstored_previous_response(rd: Daemon) -> None:
    c = client(rd)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model=PAIR, input="x", previous_response_id="resp_nope")
    assert e.value.body == {"message": "Previous response with id 'resp_nope' not found.", "type": "not_found_error",
                            "param": "previous_response_id", "code": "previous_response_not_found"}
    unstored = c.responses.create(model=PAIR, input="x", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=PAIR, input="y", previous_response_id=unstored.id)


def test_store_is_bounded() -> None:
    store = ResponseStore(max_count=3, max_bytes=200)
    item = {"type": "message", "role": "user", "content": "x" * 10}
    for i in range(5):
        store.put(f"r{i}", [item])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") == [item]
    store.get("r2")  # used: the least recently used goes first
    store.put("big", [{"content": "y" * 120}])
    assert store.get("r2") is not None and store.get("r3") is None and store.bytes <= 200
    store.put("huge", [{"content": "z" * 500}])  # larger than the whole store: not kept
    assert store.get("huge") is None and store.get("big") is not None


# -- what agents send -----------------------------------------------------------------------------
def test_translation_as_ollama_does() -> None:
    tools = chat_tools([WEATHER, {"type": "web_search", "external_web_access": False},
                        {"type": "namespace", "name": "agents", "tools": [
                            {"type": "function", "name": "spawn",
                             "parameters": {"type": "object", "properties": {}}}]}])
    assert [t["function"]["name"] for t in tools] == ["get_weather", "agents.spawn"]
    assert tools[0] == CHAT_WEATHER
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
        {"type": "reasoning", "encrypted_content": "hmm"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a":1}'},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call_output", "call_id": "c1", "output": "done", "parts": []},
        {"type": "web_search_call"},
    ]
    assert chat_messages("sys", items, "pair") == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "go"},
        {"role": "assistant", "content": "calling", "thinking": "hmm",
         "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "done", "tool_call_id": "c1"}]


def test_codex_shaped_request_is_accepted(rd: Daemon) -> None:
    """What the Codex CLI sends (docs/agents.md, "Codex CLI"): developer messages, a namespace and the
    built-in web_search, `store: false`, `include`, `prompt_cache_key`, tool_choice and friends."""
    body = {
        "model": PAIR, "stream": True, "tool_choice": "auto", "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"}, "store": False, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199", "client_metadata": {"thread_id": "0199"}, "max_output_tokens": 6,
        "tools": [WEATHER, {"type": "web_search", "external_web_access": False},
                  {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
                   "tools": [{"type": "function", "name": "close_agent", "strict": False,
                              "parameters": {"type": "object", "properties": {}}}]}],
        "input": [{"type": "message", "id": "msg_1", "role": "developer",
                   "content": [{"type": "input_text", "text": "You are a coding agent."}]},
                  {"type": "message", "id": "msg_2", "role": "user",
                   "content": [{"type": "input_text", "text": "hi"}]}],
    }
    r = post(rd, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(b.split("\ndata: ")[1]) for b in r.text.split("\n\n") if b]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    final = events[-1]["response"]
    assert final["store"] is False and final["usage"]["input_tokens"] > 0
    assert [t["type"] for t in final["tools"]] == ["function", "web_search", "namespace"]


HOSTILE: list[tuple[Any, str]] = [
    ({"input": 5}, "input must be a string or array: json: cannot unmarshal number into Go value of type "
                   "[]json.RawMessage"),
    ({"input": [{"type": "bogus"}]}, 'input[0]: unknown input item type: "bogus"'),
    ({"input": [{"content": "x"}]}, "input[0]: input item missing required 'type' field"),
    ({"input": [7]}, "input[0]: json: cannot unmarshal number into Go value of type struct"),
    ({"input": [{"role": "user", "content": [{"type": "weird"}]}]},
     "input[0]: content[0]: unknown content type: weird"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0]: content must be a string or array"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
     "failed to parse function call arguments"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": {"a": 1}}]},
     "input[0]: json: cannot unmarshal object into Go struct field ResponsesFunctionCall.arguments of type string"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
     "input[0]: output must be a string or array"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_data": "eA=="}]}]},
     "file inputs are not currently supported"),
    ({"input": "x", "max_output_tokens": "many"},
     "json: cannot unmarshal string into Go struct field ResponsesRequest.max_output_tokens of type int"),
    ({"input": "x", "max_output_tokens": 10**30}, "json: cannot unmarshal number 1000000000000000000000000000000"),
    ({"input": "x", "temperature": "hot"}, "Go struct field ResponsesRequest.temperature of type float64"),
    ({"input": "x", "stream": "yes"}, "Go struct field ResponsesRequest.stream of type bool"),
    ({"input": "x", "tools": "all"}, "Go struct field ResponsesRequest.tools of type []openai.ResponsesTool"),
    ({"input": "x", "tools": [5]}, "Go struct field ResponsesRequest.tools of type openai.ResponsesTool"),
    ({"input": "x", "tools": [{"type": "function", "name": 5}]}, "ResponsesTool.tools.name of type string"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, 'invalid reasoning value: "extreme"'),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": 5}}}, "invalid format"),
    ({"input": "x", "previous_response_id": 5}, "invalid previous_response_id"),
    ({"input": "x", "model": None}, "model is required"),
]


@pytest.mark.parametrize(("body", "message"), HOSTILE)
def test_hostile_input_gets_a_400_in_openais_shape(rd: Daemon, body: dict[str, Any], message: str) -> None:
    r = post(rd, {"model": PAIR, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and message in err["message"], err


def test_the_daemon_keeps_serving(rd: Daemon) -> None:
    for bad in ([1, 2], "text"):
        r = httpx.post(rd.url + "/v1/responses", json=bad, timeout=T)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(rd.url + "/v1/responses", content=b'{"model": ', timeout=T)
    assert r.status_code == 400 and r.json()["error"]["message"] == "unexpected EOF"
    # A huge limit is bounded by the window, as Ollama bounds num_predict; the answer comes.
    r = post(rd, {"model": PAIR, "input": "x", "max_output_tokens": 10**9})
    assert r.status_code == 200 and r.json()["status"] == "completed"
    assert client(rd).responses.create(model=TEXT, input="still here", max_output_tokens=2).output_text


SCALAR = st.none() | st.booleans() | st.integers(-5, 10**20) | st.floats(allow_nan=False, allow_infinity=False)
JSON = st.recursive(SCALAR | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
PART = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", "input_file", "x"])},
                             optional={"text": JSON | st.text(max_size=8), "image_url": JSON})
ITEM = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "web_search_call",
                             "item_reference", ""]) | JSON,
    "role": st.sampled_from(["user", "assistant", "developer", "system", "tool"]) | JSON,
    "content": st.text(max_size=8) | st.lists(PART, max_size=2) | JSON, "call_id": st.text(max_size=4) | JSON,
    "name": st.text(max_size=4) | JSON, "arguments": st.sampled_from(["{}", '{"a":1}', "[1]", "{"]) | JSON,
    "output": st.text(max_size=8) | st.lists(PART, max_size=2) | JSON, "encrypted_content": JSON})
TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search", "namespace", "custom"]) | JSON},
                             optional={"name": st.text(max_size=6) | JSON, "parameters": JSON, "tools": JSON,
                                       "description": JSON, "strict": JSON})
FIELDS = {
    "input": st.text(max_size=12) | st.lists(ITEM, max_size=3) | JSON, "instructions": st.text(max_size=8) | JSON,
    "tools": st.lists(TOOL, max_size=2) | JSON, "temperature": JSON, "top_p": JSON, "stream": st.booleans() | JSON,
    "max_output_tokens": st.integers(-2, 6) | JSON, "reasoning": JSON, "text": JSON, "store": JSON,
    "previous_response_id": JSON, "include": JSON, "truncation": JSON, "tool_choice": JSON,
}


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(payload=st.fixed_dictionaries({}, optional=FIELDS))
def test_random_bodies_get_well_formed_answers(rd: Daemon, payload: dict[str, Any]) -> None:
    """Whatever the body, a 200 in the API's shape or a 4xx in OpenAI's error envelope, never a 500."""
    if not isinstance(payload.get("max_output_tokens"), int) or payload["max_output_tokens"] > 6:
        payload["max_output_tokens"] = 4
    r = post(rd, {"model": TEXT, **payload})
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["type"] in ("invalid_request_error", "not_found_error")
    elif r.headers["content-type"].startswith("text/event-stream"):
        last = json.loads(r.text.split("\n\n")[-2].split("\ndata: ")[1])
        assert last["type"] in ("response.completed", "response.incomplete")
    else:
        assert r.json()["object"] == "response"


def test_no_input_only_loads(rd: Daemon) -> None:
    """No input at all is Ollama's load request: an empty answer, streamed or not."""
    r = post(rd, {"model": TEXT, "input": ""})
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == ""
    r = post(rd, {"model": TEXT, "input": [], "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert [json.loads(b.split("\ndata: ")[1])["type"] for b in r.text.split("\n\n") if b] == [
        "response.created", "response.in_progress", "response.completed"]


def test_models_that_are_no_pair_go_upstream(rd: Daemon, up: Daemon) -> None:
    r = client(rd).responses.create(model=UP, input="hello", temperature=0)
    direct = client(up).responses.create(model=UP, input="hello", temperature=0)
    assert r.model == UP and r.output_text == direct.output_text
    with pytest.raises(openai.NotFoundError, match="model 'nothing:here' not found"):
        client(rd).responses.create(model="nothing:here", input="x")


# -- Node ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("node") is None or not (NODE / "node_modules" / "openai").is_dir(),
                    reason="node or tests/node/node_modules (npm install --prefix tests/node) is absent")
def test_node_openai_stream(rd: Daemon) -> None:
    out = subprocess.run(["node", str(NODE / "responses_stream.mjs"), rd.url + "/v1", TEXT, "Hello from Node."],
                         capture_output=True, text=True, timeout=T, check=True)
    got = json.loads(out.stdout)
    whole = client(rd).responses.create(model=TEXT, input="Hello from Node.", temperature=0, max_output_tokens=24)
    assert got["types"][:2] == ["response.created", "response.in_progress"]
    assert got["types"][-1] in ("response.completed", "response.incomplete")
    assert got["text"] == got["output_text"] == whole.output_text and got["status"] == whole.status
    assert got["usage"]["total_tokens"] == got["usage"]["input_tokens"] + got["usage"]["output_tokens"]
