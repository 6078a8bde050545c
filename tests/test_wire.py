"""Ollama's wire format: keep_alive durations, NDJSON framing, request bodies and their typed fields."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest

from sidecar.api.requests import ChatRequest, GenerateRequest
from sidecar.api.wire import ApiError, dumps, line, ns, parse_duration, read_body

pytestmark = pytest.mark.pure

# -- parse_duration --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("300ms", 0.3),
        ("-1m", -60.0),
        ("0", 0.0),
        ("-0", 0.0),
        ("0s", 0.0),
        ("1.5h", 5400.0),
        (".5s", 0.5),
        ("2h45m30.5s", 9930.5),
        ("1h2m3s4ms5us6ns", 3723.004005006),
        ("10µs", 1e-5),
        (" 5m ", 300.0),
        (0, 0.0),
        (300, 300.0),
        (-1, -1.0),
        (2.5, 2.5),
    ],
)
def test_parse_duration_values(value: Any, seconds: float) -> None:
    assert parse_duration(value) == pytest.approx(seconds, rel=1e-12, abs=1e-15)


def test_parse_duration_returns_floats() -> None:
    assert type(parse_duration(5)) is float
    assert type(parse_duration("5m")) is float


@pytest.mark.parametrize("value", ["3600", "-5", "00"])
def test_a_number_string_without_unit_is_a_400(value: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_duration(value)
    assert e.value.status == 400
    assert e.value.message == f'time: missing unit in duration "{value}"'


@pytest.mark.parametrize("value", ["", "abc", "5 m", "5d", "m", "-", "1h-30m", "5mm", "1e3s"])
def test_malformed_durations_are_a_400(value: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_duration(value)
    assert e.value.status == 400
    assert e.value.message == f'time: invalid duration "{value.strip()}"'


@pytest.mark.parametrize("value", ["99999999999999h", "2562048h", "9223372037s"])
def test_a_duration_past_int64_nanoseconds_is_invalid_as_in_go(value: str) -> None:
    """time.ParseDuration's overflow; an expiry that far out also broke /api/ps (no clock shows it)."""
    with pytest.raises(ApiError) as e:
        parse_duration(value)
    assert (e.value.status, e.value.message) == (400, f'time: invalid duration "{value}"')
    assert parse_duration("2562047h") == 2562047 * 3600.0


@pytest.mark.parametrize("value", [1e300, 9.3e9])
def test_a_number_past_int64_nanoseconds_keeps_the_model_forever(value: float) -> None:
    assert parse_duration(value) == -1.0


@pytest.mark.parametrize(("value", "seconds"), [("+5m", 300.0), ("+0", 0.0)])
def test_a_leading_plus_sign_is_accepted_like_go(value: str, seconds: float) -> None:
    """Go's time.ParseDuration accepts an optional sign, '-' or '+': "+5m" is 5 minutes."""
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, None])
def test_non_durations_are_a_400(value: Any) -> None:
    with pytest.raises(ApiError) as e:
        parse_duration(value)
    assert (e.value.status, e.value.message) == (400, "invalid keep_alive")


@pytest.mark.parametrize(("value", "go"), [
    (True, "bool"), ([1], "[]interface {}"), ({"m": 5}, "map[string]interface {}"),
])
def test_other_json_types_get_api_durations_error(value: Any, go: str) -> None:
    """api.Duration's UnmarshalJSON: `Unsupported type: '<Go's reflect type>'`."""
    with pytest.raises(ApiError) as e:
        parse_duration(value)
    assert (e.value.status, e.value.message) == (400, f"Unsupported type: '{go}'")


# -- dumps / line ----------------------------------------------------------------------------------


def test_dumps_is_compact() -> None:
    assert dumps({"a": [1, 2], "b": {"c": None, "d": True}}) == '{"a":[1,2],"b":{"c":null,"d":true}}'


def test_dumps_escapes_line_separators_and_all_non_ascii() -> None:
    text = "a\u2028b\u2029c é 日 🎉 \n"
    out = dumps({"response": text})
    assert out == '{"response":"a\\u2028b\\u2029c \\u00e9 \\u65e5 \\ud83c\\udf89 \\n"}'
    assert out.isascii()
    assert json.loads(out) == {"response": text}
    assert not any(ch in out for ch in "\n\r\u2028\u2029\x85")


@pytest.mark.parametrize("obj", [{}, {"response": "x\ny\n"}, {"done": True, "context": [1, 2]}, "s", 3])
def test_line_ends_with_exactly_one_newline(obj: Any) -> None:
    out = line(obj)
    assert isinstance(out, bytes)
    assert out.endswith(b"\n") and not out.endswith(b"\n\n")
    assert out.count(b"\n") == 1
    assert json.loads(out) == obj


def test_lines_concatenate_into_ndjson() -> None:
    stream = b"".join(line({"response": r, "done": r == ""}) for r in ("Hel", "lo\u2028", ""))
    assert [json.loads(x) for x in stream.splitlines()] == [
        {"response": "Hel", "done": False},
        {"response": "lo\u2028", "done": False},
        {"response": "", "done": True},
    ]


def test_ns_converts_seconds_to_non_negative_nanoseconds() -> None:
    assert ns(1.5) == 1_500_000_000
    assert ns(0) == 0
    assert ns(-3.0) == 0


# -- read_body (it only awaits request.read()) ----------------------------------------------------


class FakeRequest:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def read(self) -> bytes:
        return self.raw


def body(raw: bytes) -> dict[str, Any]:
    return asyncio.run(read_body(FakeRequest(raw)))  # type: ignore[arg-type]


def body_error(raw: bytes) -> str:
    with pytest.raises(ApiError) as e:
        body(raw)
    assert e.value.status == 400
    return e.value.message


def test_read_body_returns_the_object() -> None:
    assert body(b'{"model": "a:b", "options": {"top_k": 3}}') == {"model": "a:b", "options": {"top_k": 3}}


@pytest.mark.parametrize("raw", [b"", b"  \n\t"])
def test_read_body_missing(raw: bytes) -> None:
    assert body_error(raw) == "missing request body"


def test_read_body_reads_one_value_as_gins_decoder_does() -> None:
    """gin binds with a json.Decoder, which stops after the first value: what follows is not read."""
    assert body(b' {"a": 1} x') == {"a": 1}
    assert body(b'{"a": 1}{"b": 2}') == {"a": 1}


def test_read_body_takes_invalid_utf8_in_a_string_as_go_does() -> None:
    """encoding/json replaces invalid UTF-8 with U+FFFD instead of failing (its Unmarshal docs)."""
    assert body(b'{"prompt": "a\xffb"}') == {"prompt": "a\ufffdb"}


def test_read_body_replaces_unpaired_surrogates_as_go_does() -> None:
    """A lone surrogate escape (a JavaScript string cut inside an emoji) is U+FFFD, in keys and
    nested values too; a pair is the character it encodes."""
    raw = b'{"prompt": "x\\ud83d", "messages": [{"content": "\\ude00y\\ud83d\\ude00"}], "\\udc00": 1}'
    assert body(raw) == {"prompt": "x\ufffd", "messages": [{"content": "\ufffdy\U0001f600"}], "\ufffd": 1}


@pytest.mark.parametrize(("raw", "message"), [
    (b"{", "unexpected EOF"),
    (b'{"a": 1,}', "invalid character '}' looking for beginning of object key string"),
    (b"{'a': 1}", "invalid character '\\'' looking for beginning of object key string"),
    (b'{"a": NaN}', "invalid character 'N' looking for beginning of value"),
    (b'{"a": Infinity}', "invalid character 'I' looking for beginning of value"),
    (b"[1 2]", "invalid character '2' after array element"),
])
def test_read_body_rejects_invalid_json_as_go_does(raw: bytes, message: str) -> None:
    """encoding/json's SyntaxError text, which gin answers with."""
    assert body_error(raw) == message


def test_read_body_rejects_deep_nesting() -> None:
    assert body_error(b"[" * 100_000 + b"]" * 100_000) == "request body is nested too deeply"


@pytest.mark.parametrize(
    ("raw", "kind"), [(b"[1]", "array"), (b'"x"', "string"), (b"3", "number"), (b"true", "bool"),
                      (b"null", "null")]
)
def test_read_body_needs_an_object(raw: bytes, kind: str) -> None:
    assert body_error(raw) == f"json: cannot unmarshal {kind} into Go value of type api.Request"


# -- typed fields ----------------------------------------------------------------------------------


def test_requests_read_typed_values_and_zero_values() -> None:
    r = GenerateRequest.read({"model": "a:b", "stream": False, "prompt": None, "system": None, "x": 3})
    assert (r.model, r.stream, r.prompt, r.system, r.raw, r.context) == ("a:b", False, "", None, False, None)
    assert GenerateRequest.read({}).stream is True  # Ollama: a missing stream means true
    chat = ChatRequest.read({"messages": [{"role": "User", "content": "hi", "tool_name": None}]})
    assert [m.as_dict() for m in chat.messages] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("model", "body", "message"),
    [
        (GenerateRequest, {"prompt": 3},
         "json: cannot unmarshal number into Go struct field GenerateRequest.prompt of type string"),
        (GenerateRequest, {"raw": "yes"},
         "json: cannot unmarshal string into Go struct field GenerateRequest.raw of type bool"),
        (GenerateRequest, {"stream": 1},
         "json: cannot unmarshal number into Go struct field GenerateRequest.stream of type bool"),
        (GenerateRequest, {"images": {"a": 1}},
         "json: cannot unmarshal object into Go struct field GenerateRequest.images of type []api.ImageData"),
        (GenerateRequest, {"context": [1, "a"]},
         "json: cannot unmarshal string into Go struct field GenerateRequest.context of type int"),
        (ChatRequest, {"messages": [{"role": 3}]},
         "json: cannot unmarshal number into Go struct field Message.messages.role of type string"),
        (ChatRequest, {"messages": ["hi"]},
         "json: cannot unmarshal string into Go struct field ChatRequest.messages of type api.Message"),
        (ChatRequest, {"messages": [{"role": "assistant", "tool_calls": ["f"]}]},
         "json: cannot unmarshal string into Go struct field Message.messages.tool_calls of type api.ToolCall"),
        (ChatRequest, {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 5}}]}]},
         "json: cannot unmarshal number into Go struct field ToolCallFunction.messages.tool_calls.function.name "
         "of type string"),
        # An ordered map decodes the arguments (api/types.go): jsonparser's error, not encoding/json's.
        (ChatRequest, {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": []}}]}]},
         "Value looks like object, but can't find closing '}' symbol"),
        (ChatRequest, {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
         "Value looks like object, but can't find closing '}' symbol"),
        # A type error is saved and decoding goes on; the arguments' error stops it, so it wins.
        (ChatRequest, {"messages": [{"role": "assistant", "tool_calls": [{"id": 1, "function": {"arguments": 3}}]}]},
         "Value looks like object, but can't find closing '}' symbol"),
        (ChatRequest, {"messages": [{"role": "assistant", "tool_calls": [{"id": 1, "function": {}}]}]},
         "json: cannot unmarshal number into Go struct field ToolCall.messages.tool_calls.id of type string"),
        (ChatRequest, {"tools": True},
         "json: cannot unmarshal bool into Go struct field ChatRequest.tools of type api.Tools"),
        (GenerateRequest, {"top_logprobs": 1.5},
         "json: cannot unmarshal number 1.5 into Go struct field GenerateRequest.top_logprobs of type int"),
        (GenerateRequest, {"top_logprobs": 21}, "top_logprobs must be between 0 and 20"),
        (GenerateRequest, {"think": "AAA"},
         'invalid think value: "AAA" (must be "high", "medium", "low", "max", true, or false)'),
        (ChatRequest, {"think": 1},
         'think must be a boolean or string ("high", "medium", "low", "max", true, or false)'),
        (GenerateRequest, {"logprobs": "yes"},
         "json: cannot unmarshal string into Go struct field GenerateRequest.logprobs of type bool"),
        (GenerateRequest, {"options": [1]},
         "json: cannot unmarshal array into Go struct field GenerateRequest.options of type map[string]interface {}"),
    ],
)
def test_wrong_types_get_gos_decoder_error(model: Any, body: dict[str, Any], message: str) -> None:
    with pytest.raises(ApiError) as e:
        model.read(body)
    assert (e.value.status, e.value.message) == (400, message)
