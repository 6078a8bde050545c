"""Ollama's own test tables for its output parsers, run against the Python ports.

Inputs and expected values are Ollama's, verbatim; each test names the Go test it comes from:
thinking/parser_test.go, model/parsers/qwen3_test.go, model/parsers/parsers_test.go,
harmony/harmonyparser_test.go, and the parser-level expectations of
server/routes_harmony_streaming_test.go (which drive HarmonyMessageHandler through ChatHandler).
A few tests at the end cover what routes.go does around the parsers and have no Go counterpart.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from sidecar.templates.parsers import (
    IMPLEMENTED_PARSER_NAMES,
    KNOWN_PARSER_NAMES,
    HarmonyMessageHandler,
    ParserError,
    Qwen3Parser,
    ThinkingParser,
    ToolCall,
    parser_for_name,
    thinking_parser_for,
)
from sidecar.templates.parsers._text import split_at_tag
from sidecar.templates.parsers.harmony import (
    ContentEmitted,
    FunctionNameMap,
    HarmonyEvent,
    HarmonyHeader,
    HarmonyParser,
    HeaderComplete,
    MessageEnd,
    MessageStart,
    parse_header,
)
from sidecar.templates.parsers.thinking import ThinkingState

pytestmark = pytest.mark.pure

CALL_ID = re.compile(r"call_[a-z0-9]{8}")


def call(name: str, arguments: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """A tool call as the tests expect it, without the random id."""
    return {"function": {"index": index, "name": name, "arguments": arguments}}


def without_ids(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The calls with their ids checked and taken out, for comparing with `call(...)`."""
    for c in calls:
        assert CALL_ID.fullmatch(c["id"]), c["id"]
    return [{k: v for k, v in c.items() if k != "id"} for c in calls]


# --- thinking/parser_test.go -------------------------------------------------------------------

EXTRACT_THINKING = [
    ("<think> internal </think> world", "internal ", "world"),
    ("<think>a</think><think>b</think>c", "a", "<think>b</think>c"),
    ("no think", "", "no think"),
]


@pytest.mark.parametrize(("text", "want_thinking", "want_content"), EXTRACT_THINKING)
def test_extract_thinking(text: str, want_thinking: str, want_content: str) -> None:
    """TestExtractThinking."""
    parser = ThinkingParser("<think>", "</think>")
    assert parser.add(text) == (want_thinking, want_content)


S = ThinkingState
# (input, thinking, content, state after)
THINKING_STREAMING: dict[str, list[tuple[str, str, str, ThinkingState]]] = {
    "content without a thinking tag": [
        ("  abc", "", "  abc", S.THINKING_DONE),
        # regression: the first step must not come out twice
        ("def", "", "def", S.THINKING_DONE),
    ],
    "content before a thinking tag nerfs the thinking tag": [
        ("  abc <think>def</think> ghi", "", "  abc <think>def</think> ghi", S.THINKING_DONE),
    ],
    "building up a thinking tag partially": [
        ("  <th", "", "", S.LOOKING_FOR_OPENING),
        ("in", "", "", S.LOOKING_FOR_OPENING),
        ("k>a", "a", "", S.THINKING),
    ],
    "partial closing tag": [
        ("<think>abc</th", "abc", "", S.THINKING),
        ("ink>def", "", "def", S.THINKING_DONE),
    ],
    "partial closing tag fakeout": [
        ("<think>abc</th", "abc", "", S.THINKING),
        ("ing>def", "</thing>def", "", S.THINKING),
        ("ghi</thi", "ghi", "", S.THINKING),
        ("nk>jkl", "", "jkl", S.THINKING_DONE),
    ],
    "whitespace after thinking tag": [
        ("  <think>abc</think>\n\ndef", "abc", "def", S.THINKING_DONE),
    ],
    "whitespace after thinking tag (incremental)": [
        ("  <think>abc</think>", "abc", "", S.THINKING_DONE_EATING_WHITESPACE),
        ("\n\ndef", "", "def", S.THINKING_DONE),
    ],
    "whitespace after thinking tag with content and more whitespace": [
        ("  <think>abc</think>\n\ndef ", "abc", "def ", S.THINKING_DONE),
        (" ghi", "", " ghi", S.THINKING_DONE),
    ],
    "token by token": [
        ("<think>", "", "", S.THINKING_STARTED_EATING_WHITESPACE),
        ("\n", "", "", S.THINKING_STARTED_EATING_WHITESPACE),
        ("</think>", "", "", S.THINKING_DONE_EATING_WHITESPACE),
        ("\n\n", "", "", S.THINKING_DONE_EATING_WHITESPACE),
        ("Hi", "", "Hi", S.THINKING_DONE),
        (" there", "", " there", S.THINKING_DONE),
    ],
    "leading thinking whitespace": [
        ("  <think>   \t ", "", "", S.THINKING_STARTED_EATING_WHITESPACE),
        ("  these are some ", "these are some ", "", S.THINKING),
        ("thoughts </think>  ", "thoughts ", "", S.THINKING_DONE_EATING_WHITESPACE),
        ("  more content", "", "more content", S.THINKING_DONE),
    ],
}


@pytest.mark.parametrize("steps", THINKING_STREAMING.values(), ids=THINKING_STREAMING.keys())
def test_thinking_streaming(steps: list[tuple[str, str, str, ThinkingState]]) -> None:
    """TestThinkingStreaming."""
    parser = ThinkingParser("<think>", "</think>")
    for i, (text, want_thinking, want_content, want_state) in enumerate(steps):
        assert parser.add(text) == (want_thinking, want_content), f"step {i}"
        assert parser.state == want_state, f"step {i}"


# --- model/parsers/qwen3_test.go -----------------------------------------------------------------

WEATHER_CALL = (
    '<tool_call>{"name":"get_weather","arguments":{"location":"San Francisco","unit":"celsius"}}</tool_call>'
)


def thinking_qwen3() -> Qwen3Parser:
    parser = Qwen3Parser(has_thinking_support=True, default_thinking=True)
    parser.init(None, None, True)
    return parser


def instruct_qwen3(think: bool | None = False) -> Qwen3Parser:
    parser = Qwen3Parser(has_thinking_support=False, default_thinking=False)
    parser.init(None, None, think)
    return parser


@pytest.mark.parametrize(
    "text",
    ["Let me think...</think>Answer.", "<think>\nLet me think...</think>Answer."],
    ids=["TestQwen3ParserThinkingEnabled", "TestQwen3ParserThinkingEnabledWithExplicitOpeningTag"],
)
def test_qwen3_thinking_enabled(text: str) -> None:
    """TestQwen3ParserThinkingEnabled, TestQwen3ParserThinkingEnabledWithExplicitOpeningTag."""
    assert thinking_qwen3().add(text, True) == ("Answer.", "Let me think...", [])


def test_qwen3_thinking_enabled_with_split_opening_tag() -> None:
    """TestQwen3ParserThinkingEnabledWithSplitOpeningTag."""
    parser = thinking_qwen3()
    assert parser.add("<thi", False) == ("", "", [])
    assert parser.add("nk>Let me think...</think>Answer.", True) == ("Answer.", "Let me think...", [])


@pytest.mark.parametrize(
    "think",
    [False, None],
    ids=["TestQwen3ParserThinkingDisabled", "TestQwen3ParserNilThinkDefaultsToContentForInstructParser"],
)
def test_qwen3_direct_answer(think: bool | None) -> None:
    """TestQwen3ParserThinkingDisabled, TestQwen3ParserNilThinkDefaultsToContentForInstructParser."""
    assert instruct_qwen3(think).add("Direct answer", True) == ("Direct answer", "", [])


def test_qwen3_tool_call() -> None:
    """TestQwen3ParserToolCall."""
    content, thinking, calls = instruct_qwen3().add(WEATHER_CALL, True)
    assert (content, thinking) == ("", "")
    assert without_ids(calls) == [call("get_weather", {"location": "San Francisco", "unit": "celsius"})]
    assert list(calls[0]["function"]["arguments"]) == ["location", "unit"]  # the model's key order


def test_qwen3_thinking_with_tool_call_before_thinking_close() -> None:
    """TestQwen3ParserThinkingWithToolCallBeforeThinkingClose."""
    content, thinking, calls = thinking_qwen3().add("Let me think" + WEATHER_CALL, True)
    assert (content, thinking) == ("", "Let me think")
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_qwen3_thinking_with_split_tool_open_tag() -> None:
    """TestQwen3ParserThinkingWithSplitToolOpenTag."""
    parser = thinking_qwen3()
    assert parser.add("Let me think<tool_ca", False) == ("", "Let me think", [])
    content, thinking, calls = parser.add('ll>{"name":"get_weather","arguments":{"location":"SF"}}</tool_call>', True)
    assert (content, thinking) == ("", "")
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


THREE_CALLS = [call("first", {"a": "1"}, 0), call("second", {"b": "2"}, 1), call("third", {"c": "3"}, 2)]


def test_qwen3_tool_call_indexing() -> None:
    """TestQwen3ParserToolCallIndexing."""
    text = (
        '<tool_call>{"name":"first","arguments":{"a":"1"}}</tool_call>\n'
        '<tool_call>{"name":"second","arguments":{"b":"2"}}</tool_call>\n'
        '<tool_call>{"name":"third","arguments":{"c":"3"}}</tool_call>'
    )
    _, _, calls = instruct_qwen3().add(text, True)
    assert without_ids(calls) == THREE_CALLS


def test_qwen3_tool_call_indexing_streaming() -> None:
    """TestQwen3ParserToolCallIndexingStreaming."""
    parser = instruct_qwen3()
    _, _, first = parser.add(
        '<tool_call>{"name":"first","arguments":{"a":"1"}}</tool_call><tool_call>{"name":"second","arguments":{"b":"2"}',
        False,
    )
    _, _, rest = parser.add('}</tool_call><tool_call>{"name":"third","arguments":{"c":"3"}}</tool_call>', True)
    assert without_ids(first + rest) == THREE_CALLS


def test_qwen3_tool_call_index_reset_on_init() -> None:
    """TestQwen3ParserToolCallIndexResetOnInit."""
    parser = instruct_qwen3()
    parser.add('<tool_call>{"name":"first","arguments":{"a":"1"}}</tool_call>', True)
    parser.init(None, None, False)
    _, _, calls = parser.add('<tool_call>{"name":"second","arguments":{"b":"2"}}</tool_call>', True)
    assert without_ids(calls) == [call("second", {"b": "2"}, 0)]


# --- model/parsers/parsers_test.go ---------------------------------------------------------------

# TestBuiltInParsersStillWork's names; the ones not ported here must at least be known names.
BUILT_IN = [
    "passthrough",
    "qwen3",
    "qwen3-thinking",
    "qwen3-coder",
    "lfm2",
    "lfm2-thinking",
    "qwen3.5",
    "ornith",
    "harmony",
    "nemotron-3-nano",
    "nemotron-3.5-nano",
]


@pytest.mark.parametrize("name", BUILT_IN)
def test_built_in_parsers(name: str) -> None:
    """TestBuiltInParsersStillWork, limited to the ported parsers."""
    assert name in KNOWN_PARSER_NAMES
    parser = parser_for_name(name)
    assert (parser is not None) == (name in IMPLEMENTED_PARSER_NAMES)


def test_unknown_parser_returns_none() -> None:
    """TestUnknownParserReturnsNil."""
    assert parser_for_name("nonexistent-parser") is None
    assert "nonexistent-parser" not in KNOWN_PARSER_NAMES


def test_harmony_preserved_tokens() -> None:
    """TestParserPreservedTokensCoverKnownLlamaServerRegressions, the harmony case (the others are not ported)."""
    parser = parser_for_name("harmony")
    assert parser is not None
    tokens = parser.preserved_tokens()
    assert {"<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"} <= set(tokens)
    assert "<|call|>" not in tokens


def test_qwen3_preserved_tokens() -> None:
    """Not in Ollama's table: the tags Qwen3Parser.PreservedTokens lists."""
    parser = parser_for_name("qwen3")
    assert parser is not None
    assert parser.preserved_tokens() == ["<think>", "</think>", "<tool_call>", "</tool_call>"]


SPLIT = "<!-- split -->"
# (name, input, tag, trim after, before, after); Ollama's wantSB always equals wantAfter
SPLIT_AT_TAG = [
    ("basic split with trimAfter true", "hello <!-- split --> world", SPLIT, True, "hello", "world"),
    ("basic split with trimAfter false", "hello <!-- split -->   world", SPLIT, False, "hello", "   world"),
    ("tag at beginning with trimAfter true", "<!-- split -->world", SPLIT, True, "", "world"),
    ("tag at beginning with trimAfter false", "<!-- split -->   world", SPLIT, False, "", "   world"),
    ("tag at end with trimAfter true", "hello <!-- split -->", SPLIT, True, "hello", ""),
    ("tag at end with trimAfter false", "hello <!-- split -->", SPLIT, False, "hello", ""),
    (
        "multiple tags splits at first occurrence",
        "hello <!-- split --> world <!-- split --> end",
        SPLIT,
        True,
        "hello",
        "world <!-- split --> end",
    ),
    ("tag not present", "hello world", SPLIT, True, "hello world", ""),
    ("empty input", "", SPLIT, True, "", ""),
    ("only whitespace before tag", "   \t\n<!-- split -->world", SPLIT, True, "", "world"),
    ("only whitespace after tag with trimAfter true", "hello<!-- split -->   \t\n", SPLIT, True, "hello", ""),
    ("only whitespace after tag with trimAfter false", "hello<!-- split -->   \t\n", SPLIT, False, "hello", "   \t\n"),
    ("complex whitespace trimming", "  hello \t\n <!-- split --> \n\t world  ", SPLIT, True, "  hello", "world  "),
    (
        "tag with special characters",
        'text <tag attr="value"> more text',
        '<tag attr="value">',
        True,
        "text",
        "more text",
    ),
]


@pytest.mark.parametrize(
    ("text", "tag", "trim_after", "want_before", "want_after"),
    [case[1:] for case in SPLIT_AT_TAG],
    ids=[case[0] for case in SPLIT_AT_TAG],
)
def test_split_at_tag(text: str, tag: str, trim_after: bool, want_before: str, want_after: str) -> None:
    """TestSplitAtTag."""
    assert split_at_tag(text, tag, trim_after) == (want_before, want_after)


# --- harmony/harmonyparser_test.go ---------------------------------------------------------------

# (input, role, channel, recipient)
HEADERS = [
    ("assistant<|channel|>analysis", "assistant", "analysis", ""),
    ("assistant<|channel|>analysis to=functions.get_weather", "assistant", "analysis", "functions.get_weather"),
    ("assistant to=functions.get_weather<|channel|>analysis", "assistant", "analysis", "functions.get_weather"),
    # special case where the role is replaced by the recipient (matches reference code)
    ("to=functions.get_weather<|channel|>analysis", "tool", "analysis", "functions.get_weather"),
    # extra token after the recipient is ignored
    ("assistant to=functions.get_weather abc<|channel|>analysis", "assistant", "analysis", "functions.get_weather"),
    # with constrain tag, recipient after channel tag
    (
        "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json",
        "assistant",
        "commentary",
        "functions.get_weather",
    ),
    # with constrain tag, recipient before channel tag
    (
        "assistant to=functions.get_weather<|channel|>commentary <|constrain|>json",
        "assistant",
        "commentary",
        "functions.get_weather",
    ),
    # constrain tag without space
    (
        "assistant<|channel|>commentary to=functions.get_weather<|constrain|>json",
        "assistant",
        "commentary",
        "functions.get_weather",
    ),
    # constrain tag without space, different order
    (
        "assistant to=functions.get_weather<|channel|>commentary<|constrain|>json",
        "assistant",
        "commentary",
        "functions.get_weather",
    ),
]


@pytest.mark.parametrize(("raw", "role", "channel", "recipient"), HEADERS)
def test_header_parsing(raw: str, role: str, channel: str, recipient: str) -> None:
    """TestHeaderParsing."""
    assert parse_header(raw) == HarmonyHeader(role=role, channel=channel, recipient=recipient)


# (input, role, channel, recipient, implicit start)
HEADER_EVENTS = [
    ("<|start|>user<|message|>What is 2 + 2?<|end|>", "user", "", "", False),
    ("<|start|>assistant<|channel|>analysis<|message|>What is 2 + 2?<|end|>", "assistant", "analysis", "", False),
    (
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"San'
        ' Francisco"}<|call|><|start|>functions.get_weather to=assistant<|message|>{"sunny": true, "temperature":'
        " 20}<|end|>",
        "assistant",
        "commentary",
        "functions.get_weather",
        False,
    ),
    (
        "<|channel|>analysis<|message|>User asks weather in SF. We need location. Use get_current_weather with location"
        ' "San Francisco, CA".<|end|><|start|>assistant<|channel|>commentary to=functions.get_current_weather'
        ' <|constrain|>json<|message|>{"location":"San Francisco, CA"}<|call|>',
        "assistant",
        "analysis",
        "",
        True,
    ),
]


@pytest.mark.parametrize(("text", "role", "channel", "recipient", "implicit_start"), HEADER_EVENTS)
def test_harmony_parser_header_event(text: str, role: str, channel: str, recipient: str, implicit_start: bool) -> None:
    """TestHarmonyParserHeaderEvent."""
    parser = HarmonyParser()
    if implicit_start:
        parser.add_implicit_start()
    events = parser.add(text)
    headers = [e.header for e in events if isinstance(e, HeaderComplete)]
    assert headers, "no header complete event"
    assert headers[0] == HarmonyHeader(role=role, channel=channel, recipient=recipient)


def header(role: str, channel: str = "", recipient: str = "") -> HeaderComplete:
    return HeaderComplete(HarmonyHeader(role=role, channel=channel, recipient=recipient))


START, END = MessageStart(), MessageEnd()

# (input, implicit start, events)
NON_STREAMING: list[tuple[str, bool, list[HarmonyEvent]]] = [
    (
        "<|start|>user<|message|>What is 2 + 2?<|end|>",
        False,
        [START, header("user"), ContentEmitted("What is 2 + 2?"), END],
    ),
    (
        "<|start|>assistant<|channel|>analysis<|message|>The answer is 4<|end|>",
        False,
        [START, header("assistant", "analysis"), ContentEmitted("The answer is 4"), END],
    ),
    (
        "<|start|>assistant<|channel|>commentary to=functions.calc<|message|>Computing...<|end|>",
        False,
        [START, header("assistant", "commentary", "functions.calc"), ContentEmitted("Computing..."), END],
    ),
    ("<|start|>user<|message|><|end|>", False, [START, header("user"), END]),
    (
        "<|start|>user<|message|>Hello<|end|><|start|>assistant<|message|>Hi!<|end|>",
        False,
        [START, header("user"), ContentEmitted("Hello"), END, START, header("assistant"), ContentEmitted("Hi!"), END],
    ),
    (
        "<|channel|>analysis<|message|>Thinking about the request<|end|>",
        True,
        [START, header("assistant", "analysis"), ContentEmitted("Thinking about the request"), END],
    ),
]


@pytest.mark.parametrize(("text", "implicit_start", "want"), NON_STREAMING)
def test_harmony_parser_non_streaming(text: str, implicit_start: bool, want: list[HarmonyEvent]) -> None:
    """TestHarmonyParserNonStreaming."""
    parser = HarmonyParser()
    if implicit_start:
        parser.add_implicit_start()
    assert parser.add(text) == want


# desc -> (implicit start, [(input, events)])
HARMONY_STREAMING: dict[str, tuple[bool, list[tuple[str, list[HarmonyEvent]]]]] = {
    "simple message streamed character by character": (
        False,
        [
            ("<", []),
            ("|", []),
            ("start|>u", [START]),
            ("ser<|mess", []),
            ("age|>Hi", [header("user"), ContentEmitted("Hi")]),
            (" there", [ContentEmitted(" there")]),
            ("<|e", []),
            ("nd|>", [END]),
        ],
    ),
    "message with channel streamed": (
        False,
        [
            ("<|start|>assistant", [START]),
            ("<|chan", []),
            ("nel|>analysis", []),
            ("<|message|>", [header("assistant", "analysis")]),
            ("Thinking", [ContentEmitted("Thinking")]),
            ("...", [ContentEmitted("...")]),
            ("<|end|>", [END]),
        ],
    ),
    "message with channel and recipient": (
        False,
        [
            (
                "<|start|>assistant<|channel|>commentary to=functions.calc<|message|>",
                [START, header("assistant", "commentary", "functions.calc")],
            ),
            ('{"x": 5}', [ContentEmitted('{"x": 5}')]),
            ("<|end|>", [END]),
        ],
    ),
    "message with channel and recipient (receipient before channel)": (
        False,
        [
            (
                "<|start|>assistant to=functions.calc<|channel|>commentary<|message|>",
                [START, header("assistant", "commentary", "functions.calc")],
            ),
            ('{"x": 5}', [ContentEmitted('{"x": 5}')]),
            ("<|end|>", [END]),
        ],
    ),
    "implicit start with channel": (
        True,
        [
            ("<|channel|>thinking", [START]),
            ("<|message|>", [header("assistant", "thinking")]),
            ("Processing request", [ContentEmitted("Processing request")]),
            ("<|end|>", [END]),
        ],
    ),
    "multiple messages streamed": (
        False,
        [
            ("<|start|>user<|message|>Hello<|end|>", [START, header("user"), ContentEmitted("Hello"), END]),
            ("<|start|>", [START]),
            ("assistant<|message|>", [header("assistant")]),
            ("Hi!", [ContentEmitted("Hi!")]),
            ("<|end|>", [END]),
        ],
    ),
    "empty message": (
        False,
        [("<|start|>system<|message|><|end|>", [START, header("system"), END])],
    ),
    "partial tag that looks like end but isn't": (
        False,
        [
            ("<|start|>user<|message|>test<|e", [START, header("user"), ContentEmitted("test")]),
            ("xample|>more", [ContentEmitted("<|example|>more")]),
            ("<|end|>", [END]),
        ],
    ),
}


@pytest.mark.parametrize(("implicit_start", "steps"), HARMONY_STREAMING.values(), ids=HARMONY_STREAMING.keys())
def test_harmony_parser_streaming(implicit_start: bool, steps: list[tuple[str, list[HarmonyEvent]]]) -> None:
    """TestHarmonyParserStreaming."""
    parser = HarmonyParser()
    if implicit_start:
        parser.add_implicit_start()
    for i, (text, want) in enumerate(steps):
        assert parser.add(text) == want, f"step {i}: {text!r}"


CONVERT_TO_VALID_CHARS = [
    ("replace spaces with underscores", "get weather", "get_weather"),
    ("replace hyphens with underscores", "get-weather", "get_weather"),
    ("replace periods with underscores", "get.weather", "get_weather"),
    ("disallow non-word characters", "get weather!", "get_weather"),
    ("strip out invalid non-alphanumeric unicode characters", "a🫠bc", "abc"),
    ("names that only contain invalid characters", "🫠", "unnamed"),
    ("leading number", "123", "_123"),
    ("$ allowed", "$", "$"),
    # weird unicode letters are allowed, though Ollama may map them to ASCII one day
    ("allow weird unicode letter characters", "𝓸𝓵𝓵𝓪𝓶𝓪", "𝓸𝓵𝓵𝓪𝓶𝓪"),
    # names that look like words but are invalid (i.e., not ID_Start/ID_Continue)
    ("disallow non-word characters that look like words", "ⓞⓛⓛⓐⓜⓐ123", "_123"),
]


@pytest.mark.parametrize(
    ("name", "want"), [c[1:] for c in CONVERT_TO_VALID_CHARS], ids=[c[0] for c in CONVERT_TO_VALID_CHARS]
)
def test_function_convert_to_valid_chars(name: str, want: str) -> None:
    """TestFunctionConvertToValidChars."""
    assert FunctionNameMap.convert_to_valid_chars(name) == want


CONVERT_AND_ADD = [
    ("basic dupe handling", ["get weather", "get weather"], ["get_weather", "get_weather_2"]),
    (
        "dupes from different user-specified names",
        ["get weather", "get_weather", "get-weather"],
        ["get_weather", "get_weather_2", "get_weather_3"],
    ),
    (
        "non dupes after dupes",
        ["get weather", "get_weather", "get-weather", "something-different"],
        ["get_weather", "get_weather_2", "get_weather_3", "something_different"],
    ),
    (
        "multiple sets of dupes",
        ["a", "a", "b", "a", "a", "b", "a"],
        ["a", "a_2", "b", "a_3", "a_4", "b_2", "a_5"],
    ),
    (
        "built-in functions should not be renamed",
        ["browser.open", "python", "not.a.built-in.function", "browser.not_a_real_built_in"],
        ["browser.open", "python", "not_a_built_in_function", "browser_not_a_real_built_in"],
    ),
]


@pytest.mark.parametrize(("names", "want"), [c[1:] for c in CONVERT_AND_ADD], ids=[c[0] for c in CONVERT_AND_ADD])
def test_function_convert_and_add(names: list[str], want: list[str]) -> None:
    """TestFunctionConvertAndAdd: one map per case, so later names see the earlier ones."""
    names_map = FunctionNameMap()
    for name, harmony_name in zip(names, want, strict=True):
        assert names_map.convert_and_add(name) == harmony_name
        assert names_map.user_to_harmony[name] == harmony_name
        assert names_map.harmony_to_user[harmony_name] == name


# --- server/routes_harmony_streaming_test.go: what ChatHandler gets from the harmony parser -------

# getTestTools(), reduced to what the parser reads
TEST_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Get the current weather in a given location"},
    },
    {"type": "function", "function": {"name": "calculate", "description": "Calculate a mathematical expression"}},
]


def chat_harmony() -> HarmonyMessageHandler:
    """The parser as ChatHandler sets it up in these tests: the test tools, a user message last."""
    parser = HarmonyMessageHandler()
    parser.init(TEST_TOOLS, {"role": "user", "content": "Hello"}, None)
    return parser


# name -> [(input, done, content, thinking, tool calls)]
REALTIME: dict[str, list[tuple[str, bool, str, str, list[dict[str, Any]]]]] = {
    "content streams as it arrives": [
        ("<|message|>Hello", False, "Hello", "", []),
        (", world", False, ", world", "", []),
        ("!<|end|>", True, "!", "", []),
    ],
    "thinking streams separately from content": [
        ("<|channel|>analysis<|message|>Thinking...", False, "", "Thinking...", []),
        # just closes the analysis message and resets the state to normal
        ("<|end|>", False, "", "", []),
        ("<|start|>assistant<|message|>Answer", False, "Answer", "", []),
        ("<|end|>", True, "", "", []),
    ],
    "partial tags buffer until complete": [
        ("<|chan", False, "", "", []),
        ("nel|>analysis<|mess", False, "", "", []),
        ("age|>Deep ", False, "", "Deep ", []),
        ("thought<|end|>", False, "", "thought", []),
        ("<|start|>assistant<|message|>Done<|end|>", True, "Done", "", []),
    ],
    "simple assistant after analysis": [
        (
            "<|channel|>analysis<|message|>Think<|end|><|start|>assistant<|message|>Answer<|end|>",
            True,
            "Answer",
            "Think",
            [],
        ),
    ],
    "tool call parsed and returned correctly": [
        (
            '<|channel|>commentary to=functions.get_weather<|message|>{"location":"San Francisco"}<|end|>'
            "<|start|>assistant<|message|>The weather is sunny<|end|>",
            True,
            "The weather is sunny",
            "",
            [call("get_weather", {"location": "San Francisco"})],
        ),
    ],
    "tool call with streaming JSON across chunks": [
        ('<|channel|>commentary to=functions.calculate<|message|>{"expr', False, "", "", []),
        ('ession":"2+', False, "", "", []),
        ('2"}', True, "", "", [call("calculate", {"expression": "2+2"})]),
    ],
}


@pytest.mark.parametrize("steps", REALTIME.values(), ids=REALTIME.keys())
def test_chat_harmony_streaming_realtime(steps: list[tuple[str, bool, str, str, list[dict[str, Any]]]]) -> None:
    """TestChatHarmonyParserStreamingRealtime, checked per step (Ollama matches the non-empty chunks in order)."""
    parser = chat_harmony()
    for i, (text, done, want_content, want_thinking, want_calls) in enumerate(steps):
        content, thinking, calls = parser.add(text, done)
        assert (content, thinking, without_ids(calls)) == (want_content, want_thinking, want_calls), f"step {i}"


def test_chat_harmony_streaming_simple() -> None:
    """TestChatHarmonyParserStreamingSimple."""
    parser = chat_harmony()
    responses = [("<|message|>First ", False), ("chunk ", False), ("here<|end|>", True)]
    chunks = [parser.add(text, done)[0] for text, done in responses]
    assert "".join(chunks) == "First chunk here"
    assert sum(1 for c in chunks if c) >= 2


# name -> (responses, {response number: (content, thinking)}, whole content, whole thinking)
CHAT_STREAMING: dict[str, tuple[list[str], dict[int, tuple[str, str]], str, str]] = {
    "simple message without thinking": (
        ["<|start|>assistant<|message|>Hello, ", "how can I help?", "<|end|>"],
        {1: ("Hello, ", ""), 2: ("how can I help?", "")},
        "Hello, how can I help?",
        "",
    ),
    "message with analysis channel for thinking": (
        [
            "<|channel|>analysis<|message|>",
            "Let me think ",
            "about this problem...",
            "<|end|>",
            "<|start|>assistant<|message|>",
            "The answer ",
            "is 42",
            "<|end|>",
        ],
        {2: ("", "Let me think "), 3: ("", "about this problem..."), 6: ("The answer ", ""), 7: ("is 42", "")},
        "The answer is 42",
        "Let me think about this problem...",
    ),
    "streaming with partial tags across boundaries": (
        [
            "<|chan",
            "nel|>analy",
            "sis<|mess",
            "age|>Think",
            "ing deeply...<|end|>",
            "<|start|>assi",
            "stant<|message|>Result ",
            "computed<|e",
            "nd|>",
        ],
        {4: ("", "Think"), 5: ("", "ing deeply..."), 7: ("Result ", ""), 8: ("computed", "")},
        "Result computed",
        "Thinking deeply...",
    ),
}


@pytest.mark.parametrize(
    ("responses", "chunks", "want_content", "want_thinking"), CHAT_STREAMING.values(), ids=CHAT_STREAMING.keys()
)
def test_chat_harmony_streaming(
    responses: list[str], chunks: dict[int, tuple[str, str]], want_content: str, want_thinking: str
) -> None:
    """TestChatHarmonyParserStreaming: the totals, and its expectedChunks (which the Go test leaves unchecked)."""
    parser = chat_harmony()
    got = {}
    for n, text in enumerate(responses, start=1):
        content, thinking, calls = parser.add(text, n == len(responses))
        assert calls == []
        if content or thinking:
            got[n] = (content, thinking)
    assert got == chunks
    assert "".join(c for c, _ in got.values()) == want_content
    assert "".join(t for _, t in got.values()) == want_thinking


# --- what routes.go and the parsers do around these tables (no Go test of their own) ------------


@pytest.mark.parametrize(
    ("prompt", "output", "want"),
    [
        ("<|im_start|>assistant\n<think>\n", "abc</think>\n\ndef", ("abc", "def")),
        ("<|im_start|>assistant\n", "<think>abc</think>def", ("abc", "def")),
        ("<|im_start|>assistant\n", "abc</think>def", ("", "abc</think>def")),
    ],
    ids=["prompt opens thinking", "model opens thinking", "no opening tag anywhere"],
)
def test_thinking_parser_fed_opening_tag_from_prompt(prompt: str, output: str, want: tuple[str, str]) -> None:
    """ChatHandler feeds the opening tag first when the trimmed prompt ends with it."""
    parser = thinking_parser_for(prompt, "<think>", "</think>", True)
    assert parser is not None
    assert parser.add(output) == want


@pytest.mark.parametrize(
    ("think", "opening", "closing"),
    [(None, "<think>", "</think>"), (False, "<think>", "</think>"), (True, "", "</think>"), ("high", "<think>", "")],
)
def test_no_thinking_parser(think: bool | str | None, opening: str, closing: str) -> None:
    """Ollama sets up no thinking parser without thinking requested or without both tags."""
    assert thinking_parser_for("<think>", opening, closing, think) is None


def test_thinking_parser_holds_partial_closing_tag_without_flush() -> None:
    """A partial closing tag at the end of the stream stays held back; Ollama never flushes it."""
    parser = ThinkingParser("<think>", "</think>")
    assert parser.add("<think>abc</thi") == ("abc", "")


@pytest.mark.parametrize(("think", "thinking"), [(None, True), ("low", True), ("max", True), (False, False)])
def test_qwen3_thinking_think_values(think: bool | str | None, thinking: bool) -> None:
    """qwen3-thinking: an unset think means on, any level means on (api.ThinkValue.Bool)."""
    parser = parser_for_name("qwen3-thinking")
    assert parser is not None
    parser.init(None, None, think)
    want = ("Answer.", "Let me think...", []) if thinking else ("Let me think...</think>Answer.", "", [])
    assert parser.add("Let me think...</think>Answer.", True) == want


def test_qwen3_holds_trailing_whitespace_even_when_done() -> None:
    """Qwen3Parser ignores `done`: trailing whitespace and an unclosed call are never released."""
    parser = instruct_qwen3()
    assert parser.add("Hi \n", False) == ("Hi", "", [])
    assert parser.add(" there ", True) == (" \n there", "", [])
    assert parser.add('<tool_call>{"name":"f"', True) == ("", "", [])


@pytest.mark.parametrize(
    ("text", "want"),
    [("<think>\nx</think>\n\ny", ("y", "x", [])), ("y<think>x</think>", ("y<think>x</think>", "", []))],
)
def test_qwen3_without_init(text: str, want: tuple[str, str, list[ToolCall]]) -> None:
    """Before init, Qwen3Parser is in Go's zero state: thinking only when the output opens with <think>."""
    parser = Qwen3Parser(has_thinking_support=True, default_thinking=True)
    assert parser.add(text, True) == want


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("not json", "failed to parse JSON"),
        ('{"arguments":{}}', "empty function name"),
        ('{"name":"f","arguments":[1]}', "failed to parse JSON"),
    ],
)
def test_qwen3_bad_tool_call(body: str, error: str) -> None:
    """Qwen3Parser.Add fails on a call it cannot decode, ending the request in Ollama."""
    with pytest.raises(ParserError, match=error):
        instruct_qwen3().add(f"<tool_call>{body}</tool_call>", True)


def test_harmony_renames_tools_and_maps_calls_back() -> None:
    """Init renames tools for the prompt (without touching the caller's), Add maps the call's name back."""
    tools = [{"type": "function", "function": {"name": "get weather", "parameters": {"type": "object"}}}]
    parser = HarmonyMessageHandler()
    renamed = parser.init(tools, None, None)
    assert renamed == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert tools[0]["function"]["name"] == "get weather"
    text = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"b":1.0,"a":[2]}'
    content, thinking, calls = parser.add(text, True)
    assert (content, thinking) == ("", "")
    assert without_ids(calls) == [call("get weather", {"b": 1, "a": [2]})]
    assert list(calls[0]["function"]["arguments"]) == ["b", "a"]


@pytest.mark.parametrize(
    ("last_message", "output", "want"),
    [
        ({"role": "assistant", "content": "The answer"}, " is 4<|end|>", (" is 4", "")),
        ({"role": "assistant", "thinking": "Hmm"}, ", let me see<|end|>", ("", ", let me see")),
        ({"role": "user", "content": "Hi"}, "<|channel|>final<|message|>Hello<|end|>", ("Hello", "")),
    ],
    ids=["content prefill", "thinking prefill", "no prefill"],
)
def test_harmony_prefill(last_message: dict[str, str], output: str, want: tuple[str, str]) -> None:
    """A prefilled assistant turn continues in its channel (AddImplicitStartOrPrefill)."""
    parser = HarmonyMessageHandler()
    parser.init(None, last_message, None)
    content, thinking, _ = parser.add(output, True)
    assert (content, thinking) == want


def test_harmony_bad_tool_call() -> None:
    """Harmony's Add fails when the call's text is not a JSON object."""
    parser = chat_harmony()
    with pytest.raises(ParserError, match=re.escape("error parsing tool call: raw='{\"x\"'")):
        parser.add('<|channel|>commentary to=functions.calculate<|message|>{"x"', True)
