"""Ollama's wire format: NDJSON framing, timestamps, durations, error bodies (OpenAI's too), reading a body."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import secrets
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Any, TypeVar

from aiohttp import web

NDJSON = "application/x-ndjson"


class ApiError(Exception):
    """An error with the HTTP status and message Ollama would answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def dumps(obj: Any) -> str:
    # ensure_ascii: httpx (ollama-python) splits lines on U+2028 and friends, so escape them all.
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":"))


def line(obj: Any) -> bytes:
    return (dumps(obj) + "\n").encode("ascii")


def error_response(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=dumps({"error": message}), content_type="application/json")


def openai_error(status: int, message: str) -> web.Response:
    """OpenAI's error envelope, which /v1 clients parse (the openai SDK reads error.message)."""
    kind = "invalid_request_error" if status == 400 else "not_found_error" if status == 404 else "api_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.Response(status=status, text=dumps(body), content_type="application/json")


def anthropic_error(status: int, message: str) -> web.Response:
    """Anthropic's error object, with the type anthropic.NewError gives each status (anthropic/anthropic.go)."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 429: "rate_limit_error", 503: "overloaded_error",
            529: "overloaded_error"}.get(status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": message}, "request_id": f"req_{secrets.token_hex(12)}"}
    return web.Response(status=status, text=dumps(body), content_type="application/json")


def error_for(request: web.Request, status: int, message: str) -> web.Response:
    """An error in the shape the route's clients expect: Anthropic's under /v1/messages, OpenAI's
    elsewhere under /v1, Ollama's elsewhere."""
    if request.path.startswith("/v1/messages"):
        return anthropic_error(status, message)
    if request.path.startswith("/v1/"):
        return openai_error(status, message)
    return error_response(status, message)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=dumps(obj), content_type="application/json")


def now_utc() -> str:
    """Go's time.Now().UTC() in RFC 3339 with fractional seconds."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def local_time(ts: float) -> str:
    """RFC 3339 in local time with offset, like Ollama's modified_at / expires_at."""
    return datetime.fromtimestamp(ts).astimezone().isoformat(timespec="microseconds")


def ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def json_kind(v: Any) -> str:
    """The JSON type of a decoded value, as Go's decoder names it in errors."""
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return "null"


async def read_body(request: web.Request) -> dict[str, Any]:
    """The JSON object of a request, with Ollama's answers for empty and malformed bodies.

    Go's encoding/json takes invalid UTF-8 and unpaired UTF-16 surrogates in a string as U+FFFD
    (its Unmarshal documentation), so they are replaced here too: a JavaScript client that cut a
    string inside an emoji sends a lone surrogate escape, which a tokenizer cannot encode."""
    raw = await request.read()
    if not raw.strip():
        raise ApiError(400, "missing request body")
    text = raw.decode("utf-8", errors="replace")
    try:
        # One value, and whatever follows it is not read: gin binds a body with a json.Decoder
        # (binding/json.go, decodeJSON), which stops after the first value.
        body, _ = _DECODER.raw_decode(text.lstrip(" \t\r\n"))
        if _SURROGATE_ESCAPE.search(text):
            body = _without_surrogates(body)
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, _syntax_error(e)) from None
    if not isinstance(body, dict):
        raise ApiError(400, f"json: cannot unmarshal {json_kind(body)} into Go value of type api.Request")
    return body


_DECODER = json.JSONDecoder(parse_constant=lambda name: _no_constant(name))
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_surrogates(v: Any) -> Any:
    """A decoded body with every unpaired surrogate (JSON's decoder pairs the rest) as U+FFFD."""
    if isinstance(v, str):
        return _SURROGATE.sub("\ufffd", v)
    if isinstance(v, list):
        return [_without_surrogates(x) for x in v]
    if isinstance(v, dict):
        return {_without_surrogates(k): _without_surrogates(x) for k, x in v.items()}
    return v


def _no_constant(name: str) -> Any:
    raise json.JSONDecodeError("Expecting value", name, 0)  # NaN, Infinity: not JSON, as in Go


# Python's decoder messages, as the context Go's scanner reports the same mistake in.
_GO_CONTEXT = {
    "Expecting value": "looking for beginning of value",
    "Expecting property name enclosed in double quotes": "looking for beginning of object key string",
    "Expecting ':' delimiter": "after object key",
    "Expecting ',' delimiter": "after object key:value pair",
    "Invalid control character at": "in string literal",
    "Invalid \\escape": "in string escape code",
}


def _syntax_error(e: json.JSONDecodeError) -> str:
    """encoding/json's SyntaxError text for a body Python could not decode."""
    if e.pos >= len(e.doc) or e.msg.startswith("Unterminated string"):
        return "unexpected EOF"
    where = _GO_CONTEXT.get(e.msg, "looking for beginning of value")
    if e.msg == "Expecting ',' delimiter" and _in_array(e.doc, e.pos):
        where = "after array element"
    char = e.doc[e.pos]
    return f"invalid character {_go_quote_char(char)} {where}"


def _in_array(doc: str, pos: int) -> bool:
    """Whether the innermost open bracket before pos is an array's (strings skipped)."""
    stack: list[str] = []
    in_string = escaped = False
    for c in doc[:pos]:
        if in_string:
            in_string = c != '"' or escaped
            escaped = c == "\\" and not escaped
        elif c == '"':
            in_string = True
        elif c in "[{":
            stack.append(c)
        elif c in "]}" and stack:
            stack.pop()
    return bool(stack) and stack[-1] == "["


def _go_quote_char(c: str) -> str:
    """Go's quoteChar: 'x', with \\n, \\t and friends written as escapes."""
    if c == "'":
        return "'\\''"
    if c == '"':
        return "'\"'"
    q = json.dumps(c)[1:-1]
    return f"'{q}'"


def client_gone(request: web.Request) -> bool:
    """aiohttp does not cancel handlers when the client leaves; writers and waiters look for themselves."""
    return request.transport is None or request.transport.is_closing()


POLL = 0.25  # how often a request waiting on something looks whether its client is still there
T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection while the request waited (on the runtime, on an upstream)."""


async def while_connected(request: web.Request, aw: Awaitable[T]) -> T:
    """Await `aw`, giving up (ClientGone) as soon as the client disconnects.

    aiohttp does not cancel a handler whose client left, and a request can wait long without
    writing a byte (queued behind others, a model loading, an upstream pulling layers), so it
    looks for itself. The wait is cancelled and awaited before ClientGone leaves: that closes the
    runtime's stream, which stops the worker at its next step (or before it starts), or the
    upstream request."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL)
            if done:
                return task.result()
            if client_gone(request):
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


_DURATION = re.compile(r"([-+]?)((?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h))+$")
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_MAX = 2**63 / 1e9  # seconds: the longest time.Duration


def parse_duration(v: Any) -> float:
    """keep_alive: seconds as a number, or a Go duration string ("5m", "1h30m", "-1m", "0").

    A time.Duration is int64 nanoseconds (about 292 years). Go's ParseDuration rejects a string
    past that as an invalid duration; a number past it has no value in Go (its float-to-int
    conversion is undefined there), so it keeps the model forever, as a negative one does
    (api/types.go, Duration.UnmarshalJSON). Either way no expiry lies beyond what a clock can show."""
    if isinstance(v, bool | list | dict):  # api.Duration's UnmarshalJSON, naming Go's reflect type
        go = {bool: "bool", list: "[]interface {}", dict: "map[string]interface {}"}[type(v)]
        raise ApiError(400, f"Unsupported type: '{go}'")
    if isinstance(v, int | float):
        if not math.isfinite(v):
            raise ApiError(400, "invalid keep_alive")
        return float(v) if v < _DURATION_MAX else -1.0
    if isinstance(v, str):
        s = v.strip()
        if s in ("0", "-0", "+0"):
            return 0.0
        m = _DURATION.fullmatch(s)
        if not m:
            raise ApiError(400, f'time: missing unit in duration "{s}"' if s.lstrip("-").isdigit()
                           else f'time: invalid duration "{s}"')
        total = sum(float(n) * _UNIT[u] for n, u in _PART.findall(s))
        if total >= _DURATION_MAX:
            raise ApiError(400, f'time: invalid duration "{s}"')
        return -total if s.startswith("-") else total
    raise ApiError(400, "invalid keep_alive")
