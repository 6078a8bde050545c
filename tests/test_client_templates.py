"""The templates clients meet: the bundled pair's tool-aware template and Ollama's detected templates.

Driven the way the failing cases were: Open WebUI sends its tools with every chat through the
`ollama` client, and reads `capabilities` and `template` from /api/show, against `sidecar serve`
as a real process on the bundled declaration (sidecar/pairs.yaml) and on the bare GGUF.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import llama_cpp
import ollama
import pytest
import yaml

from sidecar.config.entries import PairEntry, build_entry
from sidecar.config.loader import BUNDLED, load, parse
from sidecar.runtime.format import detected_template, resolve, shown_template
from sidecar.templates.chat import GoChatTemplate, JinjaChatTemplate
from sidecar.templates.named import named
from tests.conftest import SMOLLM2_REF, Daemon, write_config
from tests.models import CHATML_TEMPLATE, write_tiny_llama
from tests.test_smollm2 import direct_greedy

pytestmark = pytest.mark.daemon

T = 120
BUNDLED_PAIR = "smollm2:135m"
GGUF_PAIR = "smollm2:gguf"  # the same file without the bundled template: what `ollama create` would make
CHATML = "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"

# One of Open WebUI's built-in tools, in the shape it sends them.
WEB_SEARCH = {
    "type": "function",
    "function": {
        "name": "search_web",
        "description": "Search the web for <query> & return results",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to search for"},
                "count": {"type": "integer", "description": "How many results"},
            },
            "required": ["query"],
        },
    },
}
# templateTool.String() in Ollama: json.Marshal, struct field order, sorted property keys, <>& escaped.
WEB_SEARCH_JSON = (
    '{"type":"function","function":{"name":"search_web",'
    '"description":"Search the web for \\u003cquery\\u003e \\u0026 return results",'
    '"parameters":{"type":"object","required":["query"],"properties":{'
    '"count":{"type":"integer","description":"How many results"},'
    '"query":{"type":"string","description":"What to search for"}}}}}'
)

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}],
    [{"role": "user", "content": "Hello, how are you?"},
     {"role": "assistant", "content": "I'm doing great. How can I help you today?"},
     {"role": "user", "content": "Quote <b> & {{ .Content }}\n  please"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "one"},
     {"role": "assistant", "content": "two"}, {"role": "system", "content": "Now in French."},
     {"role": "user", "content": "three"}],
]


def _bundled_pair() -> dict[str, Any]:
    pairs = yaml.safe_load(BUNDLED.read_text())["pairs"]
    return dict(pairs[BUNDLED_PAIR])


def _entry(name: str, pair: dict[str, Any]) -> PairEntry:
    return build_entry(name, parse(yaml.safe_dump({"pairs": {name: pair}})).pairs[name], BUNDLED.parent)


@pytest.fixture(scope="module")
def gguf_jinja() -> JinjaChatTemplate:
    """What the bundled pair rendered with before it had a template: the GGUF's own jinja."""
    entry = _entry(GGUF_PAIR, {"from": SMOLLM2_REF})
    return JinjaChatTemplate(entry.metadata["tokenizer.chat_template"])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The bundled declaration as it ships (CPU, small window), and the bare GGUF beside it."""
    d = tmp_path_factory.mktemp("client-templates")
    bundled = _bundled_pair()
    bundled["parameters"] = {**bundled["parameters"], "num_ctx": 2048}
    bundled["runtime"] = {"num_gpu": 0}
    pairs = {BUNDLED_PAIR: bundled, GGUF_PAIR: {"from": SMOLLM2_REF, "runtime": {"num_gpu": 0}}}
    daemon = Daemon(write_config(d / "pairs.yaml", yaml.safe_dump({"pairs": pairs})))
    yield daemon
    daemon.stop()


def render_only(daemon: Daemon, model: str, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> str:
    r = httpx.post(daemon.url + "/api/chat", json={"model": model, "messages": messages, "tools": tools or [],
                                                   "_debug_render_only": True}, timeout=T)
    assert r.status_code == 200, r.text
    return r.json()["_debug_info"]["rendered_template"]


# -- the bundled pair ------------------------------------------------------------------------------
def test_bundled_template_writes_what_the_gguf_jinja_wrote(gguf_jinja: JinjaChatTemplate) -> None:
    """Without tools, existing prompts (and so outputs) stay byte for byte what they were."""
    template = GoChatTemplate(load(BUNDLED).pairs[BUNDLED_PAIR].template or "")
    for messages in [[], *CHATS]:
        assert template.render(messages) == gguf_jinja.render(messages)
        assert template.render(messages, tools=[]) == gguf_jinja.render(messages)


def test_open_webui_chat_with_tools_is_answered(served: Daemon, gguf_jinja: JinjaChatTemplate) -> None:
    client = ollama.Client(host=served.url, timeout=T)
    r = client.chat(model=BUNDLED_PAIR, messages=CHATS[1], tools=[WEB_SEARCH],
                    options={"temperature": 0, "num_predict": 8})
    assert r.done and r.message.role == "assistant"
    chunks = list(client.chat(model=BUNDLED_PAIR, messages=CHATS[0], tools=[WEB_SEARCH], stream=True,
                              options={"temperature": 0, "num_predict": 8}))
    assert chunks[-1].done

    show = client.show(BUNDLED_PAIR)
    assert show.capabilities == ["completion", "tools"]
    assert show.template == load(BUNDLED).pairs[BUNDLED_PAIR].template
    assert show.modelfile is not None and f'TEMPLATE """{show.template}"""' in show.modelfile

    for messages in CHATS:  # through the daemon too: the prompt without tools is the jinja's
        assert render_only(served, BUNDLED_PAIR, messages) == gguf_jinja.render(messages)


def test_tools_results_and_calls_render_into_the_prompt(served: Daemon) -> None:
    history = [*CHATS[1],
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "search_web", "arguments": {"query": "Paris", "count": 2}}}]},
               {"role": "tool", "content": "Paris is in France.", "tool_name": "search_web"}]
    rendered = render_only(served, BUNDLED_PAIR, history, [WEB_SEARCH])
    assert rendered.startswith("<|im_start|>system\nBe brief.\n# Tools\n")
    assert f"<tools>\n{WEB_SEARCH_JSON}\n</tools>\n" in rendered
    assert rendered.endswith(
        "<|im_start|>user\nHi ✓<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "search_web", "arguments": {"count":2,"query":"Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nParis is in France.\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # No system message: SmolLM2's default one carries the tools.
    assert render_only(served, BUNDLED_PAIR, CHATS[0], [WEB_SEARCH]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n# Tools\n")


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize(("reply", "content", "calls"), [
    ('<tool_call>{"name": "search_web", "arguments": {"query": "Paris"}}</tool_call>', "", [{"query": "Paris"}]),
    ('<tool_call>\n{"name": "search_web", "arguments": {"query": "a"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "search_web", "arguments": {"query": "b", "count": 3}}\n</tool_call>', "",
     [{"query": "a"}, {"query": "b", "count": 3}]),
    ('Let me search.<tool_call>[{"name": "search_web", "arguments": {"query": "x"}}]</tool_call>', "Let me search.",
     [{"query": "x"}]),
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
])
def test_the_bundled_pairs_parser_finds_tool_calls(reply: str, content: str, calls: list[dict[str, Any]],
                                                   step: int) -> None:
    """The parser the daemon builds for each request of the bundled pair, fed a streamed reply."""
    fmt = resolve(_entry(BUNDLED_PAIR, _bundled_pair()))
    parser = fmt.new_parser(False)
    parser.init([WEB_SEARCH], None, None)
    parser.begin("")
    got_content, got_calls = "", []
    for i in range(0, len(reply), step):
        c, _, k = parser.add(reply[i:i + step], i + step >= len(reply))
        got_content += c
        got_calls += k
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"], c["function"]["index"]) for c in got_calls] == [
        ("search_web", args, i) for i, args in enumerate(calls)]


def test_a_final_assistant_message_is_continued(served: Daemon, smollm2: Path) -> None:
    """A chat that ends with an assistant message is continued (prefill), as Ollama's ChatML
    templates continue it (`$last`): the prompt ends with the prefix, with no <|im_end|> and no new
    assistant header, and the greedy answer, through /api/chat and /v1/messages, is llama.cpp's
    greedy continuation of that prompt."""
    prefix = "The capital of France is"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prefilled = [*question, {"role": "assistant", "content": prefix}]
    rendered = render_only(served, BUNDLED_PAIR, prefilled)
    assert rendered == render_only(served, BUNDLED_PAIR, question) + prefix
    assert rendered.endswith("<|im_start|>assistant\n" + prefix)

    llm = llama_cpp.Llama(str(smollm2), n_ctx=256, n_gpu_layers=0, verbose=False, vocab_only=True)
    expected = llm.detokenize(direct_greedy(smollm2, llm.tokenize(rendered.encode(), special=True), 16)).decode()
    reply = ollama.Client(host=served.url, timeout=T).chat(
        model=BUNDLED_PAIR, messages=prefilled, options={"temperature": 0, "num_predict": 16})
    assert reply.message.content == expected and expected.strip()  # the answer only, not the prefix
    message = anthropic.Anthropic(base_url=served.url, api_key="unused", timeout=T, max_retries=0).messages.create(
        model=BUNDLED_PAIR, max_tokens=16, messages=prefilled,  # type: ignore[arg-type]
        extra_body={"temperature": 0})  # this SDK's create() takes no temperature argument
    assert [b.text for b in message.content if b.type == "text"] == [expected]


# -- a pair on the bare GGUF: Ollama's detected template -----------------------------------------
def test_a_gguf_pair_still_renders_with_its_jinja(served: Daemon, gguf_jinja: JinjaChatTemplate) -> None:
    """The detected template is shown, not rendered: the pair's prompts stay the GGUF's own (with
    SmolLM2's default system prompt, which Ollama's chatml lacks)."""
    client = ollama.Client(host=served.url, timeout=T)
    assert client.show(GGUF_PAIR).capabilities == ["completion"]
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=GGUF_PAIR, messages=CHATS[0], tools=[WEB_SEARCH])
    assert info.value.status_code == 400 and "does not support tools" in info.value.error
    assert render_only(served, GGUF_PAIR, CHATS[0]) == gguf_jinja.render(CHATS[0])
    reply = client.chat(model=GGUF_PAIR, messages=CHATS[0], options={"temperature": 0, "num_predict": 4})
    assert reply.done


def test_a_gguf_pair_shows_the_template_ollama_detects(served: Daemon) -> None:
    """/api/show's `template` is that TEMPLATE, as `ollama show` prints it (was "")."""
    show = ollama.Client(host=served.url, timeout=T).show(GGUF_PAIR)
    assert show.template == CHATML
    assert show.modelfile is not None and f'TEMPLATE """{CHATML}"""' in show.modelfile


def test_detection_follows_ollama_create() -> None:
    gguf = _entry(GGUF_PAIR, {"from": SMOLLM2_REF})
    found = detected_template(gguf)
    assert found is not None and found.name == "chatml" and shown_template(gguf) == CHATML
    assert not resolve(gguf).template.go  # shown, not rendered with
    # The pair's own template wins, and nothing is detected for it.
    own = _entry(BUNDLED_PAIR, _bundled_pair())
    assert detected_template(own) is None and shown_template(own) == own.config.template


def test_a_jinja_that_can_do_more_than_its_match_is_kept(tmp_path: Path) -> None:
    """Ollama 0.30+ (server/images.go shouldPreferChatTemplate) renders the jinja when the match
    would lose what it can do, here `tools`: the pair keeps its jinja, its capability and show's ""."""
    plain = _entry("plain:jinja", {"from": str(write_tiny_llama(tmp_path / "plain.gguf"))})  # ChatML jinja
    assert resolve(plain).shown_template == CHATML and resolve(plain).capabilities == ("completion",)
    with_tools = CHATML_TEMPLATE.replace("{% endfor %}", "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}")
    found = named(with_tools)
    assert found is not None and found.name == "chatml"
    entry = _entry("tools:jinja", {"from": str(write_tiny_llama(tmp_path / "tools.gguf", chat_template=with_tools))})
    fmt = resolve(entry)
    assert detected_template(entry) is None and not fmt.template.go and fmt.template.text == with_tools
    assert fmt.capabilities == ("completion", "tools") and fmt.shown_template == ""
