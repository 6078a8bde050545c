"""Tool calls for pairs: the template sees the tools, the output is parsed into calls, results go back in.

The parser is tested on its own for the common formats (Hermes/Qwen `<tool_call>`, Llama 3.x bare
JSON, Mistral `[TOOL_CALLS]`), streamed in awkward pieces. End to end, a tiny random model cannot
decide to call a tool, so its tool-call text is forced with a grammar: a `format` schema through the
daemon (a template whose calls are bare JSON), and a GBNF grammar in the engine for `<tool_call>`.
The round trip runs through the official `ollama` and `openai` clients, streaming and not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.cost import CostModel
from sidecar.engine.decoder import Decoder, Request
from sidecar.engine.drafters import NgramDrafter
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.sampling import SamplingParams
from sidecar.templates.chat import GoChatTemplate
from sidecar.templates.tools import ToolCallParser, supports_tools, tool_tag
from tests.conftest import Daemon, write_config

pytestmark = pytest.mark.daemon

T = 120
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}

HERMES = (
    "{{- if .Tools }}<|im_start|>system\n# Tools\n{{ range .Tools }}{{ json . }}\n{{ end }}<|im_end|>\n{{ end }}"
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n"
    "{{ if .ToolCalls }}<tool_call>\n{{ range .ToolCalls }}"
    '{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}\n{{ end }}</tool_call>'
    "{{ else }}{{ .Content }}{{ end }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
)
LLAMA = (
    "{{- if .Tools }}<|im_start|>system\nTools: {{ json .Tools }}<|im_end|>\n{{ end }}"
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n"
    "{{ if .ToolCalls }}{{ range .ToolCalls }}"
    '{"name": "{{ .Function.Name }}", "parameters": {{ .Function.Arguments }}}{{ end }}'
    "{{ else }}{{ .Content }}{{ end }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
)
MISTRAL = (
    "{{- range .Messages }}{{ if .ToolCalls }}[TOOL_CALLS][{{ range .ToolCalls }}"
    '{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}{{ end }}]'
    "{{ else }}{{ .Content }}{{ end }}{{ end }}{{ if .Tools }}[AVAILABLE_TOOLS]{{ json .Tools }}{{ end }}"
)


def parse(template: str, text: str, step: int) -> tuple[str, list[dict[str, Any]]]:
    parser = ToolCallParser(template, [WEATHER])
    content, calls = [], []
    for i in range(0, len(text), step):
        c, k = parser.feed(text[i:i + step])
        content.append(c)
        calls += k
    c, k = parser.flush()
    return "".join(content) + c, calls + k


def args(calls: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], int]]:
    return [(c["function"]["name"], c["function"]["arguments"], c["function"]["index"]) for c in calls]


def test_tags_come_from_the_template() -> None:
    assert tool_tag(HERMES) == "<tool_call>"
    assert tool_tag(LLAMA) == "{"
    assert tool_tag(MISTRAL) == "[TOOL_CALLS]"
    assert tool_tag("{% if tools %}<tool_call>{% endif %}") == "<tool_call>"
    assert supports_tools(HERMES) and supports_tools("{% for t in tools %}{% endfor %}")
    assert not supports_tools("{{ .Prompt }}") and not supports_tools("{% for m in messages %}{% endfor %}")


PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
TRUNCATED = '{"name": "get_weather", "parameters": {"city": "Par'  # num_predict cut the call short


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(("template", "text", "content", "cities"), [
    (HERMES, f"<tool_call>\n{PARIS}\n</tool_call>", "", ["Paris"]),
    (HERMES, f"Let me look.<tool_call>{PARIS}</tool_call>\n<tool_call>{ROME}</tool_call>\n", "Let me look.",
     ["Paris", "Rome"]),
    (HERMES, "no call < here <tool_ at all", "no call < here <tool_ at all", []),
    (HERMES, '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    (HERMES, "<tool_call>{not json", "<tool_call>{not json", []),
    (LLAMA, '  {"name": "get_weather", "parameters": {"city": "Paris"}}', "", ["Paris"]),
    (LLAMA, f"The answer: {PARIS}", f"The answer: {PARIS}", []),
    (LLAMA, '{"a": 1} is JSON', '{"a": 1} is JSON', []),
    (LLAMA, TRUNCATED, TRUNCATED, []),
    (MISTRAL, f'[TOOL_CALLS][{PARIS}, {{"name": "get_weather", "arguments": "{{\\"city\\": \\"Rome\\"}}"}}]', "",
     ["Paris", "Rome"]),
])
def test_parser(template: str, text: str, content: str, cities: list[str], step: int) -> None:
    got_content, calls = parse(template, text, step)
    assert got_content == content
    assert args(calls) == [("get_weather", {"city": c}, i) for i, c in enumerate(cities)]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 13 for c in calls)


def test_engine_grammar_forces_a_hermes_call(tiny_pair: tuple[Path, Path]) -> None:
    """A grammar makes the tiny model write a `<tool_call>` block; speculation on, the parser finds it."""
    w = Weights(tiny_pair[0], n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=512, n_threads=1))
    try:
        prompt_text = GoChatTemplate(HERMES).render([{"role": "user", "content": "weather?"}], [WEATHER])
        prompt = w.tokenize(prompt_text, add_special=True, parse_special=True)
        grammar = 'root ::= "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" ' \
                  '[A-Z] [a-z]{2,6} "\\"}}\\n</tool_call>"'
        config = SpeculativeConfig(n_max=4, p_min=0.0, min_predict=0, adaptive=False)
        out = list(Decoder(ctx, NgramDrafter(1, 3), config, CostModel(5)).generate(
            Request(prompt, SamplingParams(temperature=0.0), num_predict=120, grammar=grammar)))
        text = "".join(str(p) for p in out[:-1])
        content, calls = parse(HERMES, text, 2)
        assert content == "" and len(calls) == 1
        assert calls[0]["function"]["name"] == "get_weather" and set(calls[0]["function"]["arguments"]) == {"city"}
    finally:
        ctx.close()
        w.close()


# -- end to end ----------------------------------------------------------------------------------
PAIR, PLAIN = "tiny:tools", "tiny:plain"
# What forces the call: the model writes exactly the JSON a Llama-style template's calls are made of.
CALL_SCHEMA = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"},
                   "parameters": {"type": "object", "properties": {"city": {"const": "Paris"}}, "required": ["city"]}},
    "required": ["name", "parameters"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def td(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("tools")
    cfg = write_config(d / "pairs.yaml", f"""
pairs:
  {PAIR}:
    from: {tiny}
    draft: ngram
    template: {json.dumps(LLAMA)}
    parameters: {{temperature: 0, num_ctx: 512, num_predict: 96}}
    speculative: {{n_max: 4, min_predict: 0, adaptive: false}}
    runtime: {{num_thread: 1}}
  {PLAIN}:
    from: {tiny}
    template: "{{{{ .Prompt }}}}"
    runtime: {{num_thread: 1}}
""")
    daemon = Daemon(cfg)
    yield daemon
    daemon.stop()


def test_ollama_client_round_trip(td: Daemon) -> None:
    client = ollama.Client(host=td.url, timeout=T)
    r = client.chat(model=PAIR, messages=ASK, tools=[WEATHER], format=CALL_SCHEMA)
    assert r.message.content == "" and r.done_reason == "stop"
    assert r.message.tool_calls is not None and len(r.message.tool_calls) == 1
    call = r.message.tool_calls[0]
    assert call.function.name == "get_weather" and dict(call.function.arguments) == {"city": "Paris"}

    chunks = list(client.chat(model=PAIR, messages=ASK, tools=[WEATHER], format=CALL_SCHEMA, stream=True))
    with_calls = [c for c in chunks if c.message.tool_calls]
    assert len(with_calls) == 1 and not with_calls[0].done and with_calls[0].message.content == ""
    assert with_calls[0].message.tool_calls[0].function.name == "get_weather"  # type: ignore[index]
    assert chunks[-1].done and not chunks[-1].message.tool_calls
    assert "".join(c.message.content or "" for c in chunks) == ""

    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
               {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"}]
    reply = client.chat(model=PAIR, messages=history, tools=[WEATHER], options={"num_predict": 12})
    assert reply.done and not reply.message.tool_calls and reply.message.content


def test_history_renders_through_the_template(td: Daemon) -> None:
    history = [*ASK, {"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "18 degrees", "tool_name": "get_weather"}]
    r = httpx.post(td.url + "/api/chat", json={"model": PAIR, "messages": history, "tools": [WEATHER],
                                               "_debug_render_only": True}, timeout=T)
    rendered = r.json()["_debug_info"]["rendered_template"]
    assert rendered.startswith('<|im_start|>system\nTools: [{"type":"function","function":{"name":"get_weather"')
    assert '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city":"Paris"}}<|im_end|>' in rendered
    assert rendered.endswith("<|im_start|>tool\n18 degrees<|im_end|>\n<|im_start|>assistant\n")


def test_openai_client_round_trip(td: Daemon) -> None:
    client = openai.OpenAI(base_url=td.url + "/v1", api_key="unused", timeout=T, max_retries=0)
    rf = {"type": "json_schema", "json_schema": {"name": "call", "schema": CALL_SCHEMA}}
    r = client.chat.completions.create(model=PAIR, messages=ASK, tools=[WEATHER], response_format=rf,  # type: ignore[arg-type]
                                       temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    stream = list(client.chat.completions.create(model=PAIR, messages=ASK, tools=[WEATHER],  # type: ignore[arg-type]
                                                 response_format=rf, temperature=0, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in stream if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].index == 0 and deltas[0][0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(deltas[0][0].function.arguments or "") == {"city": "Paris"}  # type: ignore[union-attr]
    assert stream[-1].choices[0].finish_reason == "tool_calls"

    history: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    reply = client.chat.completions.create(model=PAIR, messages=history, tools=[WEATHER], max_tokens=12,  # type: ignore[arg-type]
                                           temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length") and not reply.choices[0].message.tool_calls


def test_tools_need_a_template_that_reads_them(td: Daemon) -> None:
    r = httpx.post(td.url + "/api/chat", json={"model": PLAIN, "messages": ASK, "tools": [WEATHER]}, timeout=T)
    assert r.status_code == 400 and r.json()["error"] == f"registry.ollama.ai/library/{PLAIN} does not support tools"
    r = httpx.post(td.url + "/api/chat", json={"model": PLAIN, "messages": ASK, "tools": [], "stream": False,
                                               "options": {"num_predict": 2}}, timeout=T)
    assert r.status_code == 200  # ollama-python always sends "tools": []
    r = httpx.post(td.url + "/v1/chat/completions", json={
        "model": PAIR, "messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]}, timeout=T)
    assert r.status_code == 400 and "invalid tool call arguments" in r.json()["error"]["message"]
    show = httpx.post(td.url + "/api/show", json={"model": PAIR}, timeout=T).json()
    assert show["capabilities"] == ["completion", "tools"]
