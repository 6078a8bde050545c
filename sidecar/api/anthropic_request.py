"""Anthropic's Messages request, decoded and converted as Ollama does it (anthropic/anthropic.go).

gin's ShouldBindJSON decodes the body into `anthropic.MessagesRequest` (a field of the wrong JSON
type fails with encoding/json's text, which is the client's 400), the middleware checks model,
max_tokens and messages (middleware/anthropic.go AnthropicMessagesMiddleware), and
FromMessagesRequest turns it into the messages, tools, options and `think` of an `api.ChatRequest`:
here, the same Prompt and options /api/chat makes. api.anthropic frames the answer.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from sidecar.api.pairs import runtime_of
from sidecar.api.wire import ApiError, json_kind
from sidecar.config.entries import PairEntry
from sidecar.runtime.contract import Prompt

GO_INT_MAX = 2**63 - 1  # Go's int on 64-bit: a larger number does not decode
# The function Ollama offers the model for Anthropic's built-in web_search tool (convertTool).
WEB_SEARCH = {"type": "function", "function": {
    "name": "web_search",
    "description": "Search the web for current information. Use this to find up-to-date information about any topic.",
    "parameters": {"type": "object", "required": ["query"], "properties": {
        "query": {"type": "string", "description": "The search query to look up on the web"}}}}}


# -- decoding: Go's encoding/json into anthropic.MessagesRequest ------------------------------------
def _type_error(value: Any, struct: str, field: str, go: str) -> ApiError:
    """encoding/json's UnmarshalTypeError, the text gin's ShouldBindJSON error carries."""
    kind = json_kind(value)
    if go == "int" and kind == "number":
        kind = f"number {value}"
    return ApiError(400, f"json: cannot unmarshal {kind} into Go struct field {struct}.{field} of type {go}")


def _str(obj: dict[str, Any], key: str, struct: str, where: str = "") -> str | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, str):
        raise _type_error(v, struct, where + key, "string")
    return v


def _int(obj: dict[str, Any], key: str, struct: str, where: str = "") -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, float) and v != int(v)) \
            or not -GO_INT_MAX - 1 <= v <= GO_INT_MAX:
        raise _type_error(v, struct, where + key, "int")
    return int(v)


def _float(obj: dict[str, Any], key: str, struct: str) -> float | None:
    v = obj.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
        raise _type_error(v, struct, key, "float64")
    return None if v is None else float(v)


def _bool(obj: dict[str, Any], key: str, struct: str, where: str = "") -> bool:
    v = obj.get(key)
    if v is not None and not isinstance(v, bool):
        raise _type_error(v, struct, where + key, "bool")
    return bool(v)


def _obj(obj: dict[str, Any], key: str, struct: str, go: str, where: str = "") -> dict[str, Any] | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, dict):
        raise _type_error(v, struct, where + key, go)
    return v


def _list(obj: dict[str, Any], key: str, struct: str, go: str, where: str = "") -> list[Any]:
    v = obj.get(key)
    if v is not None and not isinstance(v, list):
        raise _type_error(v, struct, where + key, go)
    return v or []


def _strings(obj: dict[str, Any], key: str, struct: str) -> list[str]:
    out = _list(obj, key, struct, "[]string")
    for s in out:
        if not isinstance(s, str):
            raise _type_error(s, struct, key, "string")
    return out


# An object that Go decodes into api.ToolCallFunctionArguments (an ordered map, buger/jsonparser):
# anything but an object fails with jsonparser's error, not a json.UnmarshalTypeError.
_NOT_AN_OBJECT = "Value looks like object, but can't find closing '}' symbol"


def _block(b: Any) -> dict[str, Any]:
    """One anthropic.ContentBlock as Go decodes it: null is the zero block (type "", ignored)."""
    if b is None:
        return {}
    if not isinstance(b, dict):
        raise ApiError(400, f"json: cannot unmarshal {json_kind(b)} into Go value of type anthropic.ContentBlock")
    s = "ContentBlock"
    for key in ("type", "text", "id", "name", "tool_use_id", "thinking", "signature"):
        _str(b, key, s)
    _bool(b, "is_error", s)
    _obj(b, "source", s, "anthropic.ImageSource")
    _list(b, "citations", s, "[]anthropic.Citation")
    if b.get("input") is not None and not isinstance(b["input"], dict):
        raise ApiError(400, _NOT_AN_OBJECT)
    if isinstance(b.get("source"), dict):
        for key in ("type", "media_type", "data", "url"):
            _str(b["source"], key, "ImageSource", "source.")
    return b


def _message(m: Any) -> tuple[str, list[dict[str, Any]]]:
    """anthropic.MessageParam.UnmarshalJSON: a string content is one text block."""
    if not isinstance(m, dict):
        raise ApiError(400, f"json: cannot unmarshal {json_kind(m)} into Go value of type anthropic.MessageParam")
    role = _str(m, "role", "MessageParam") or ""
    if "content" not in m:
        raise ApiError(400, "unexpected end of JSON input")  # json.Unmarshal of an absent RawMessage
    content = m["content"]
    if content is None or isinstance(content, str):
        return role, [{"type": "text", "text": content or ""}]
    if not isinstance(content, list):
        raise ApiError(400, f"json: cannot unmarshal {json_kind(content)} into Go value of type "
                            "[]anthropic.ContentBlock")
    return role, [_block(b) for b in content]


def _image(source: Any) -> None:
    """resolveImageSource's checks: base64 only, and it must decode."""
    if not isinstance(source, dict):
        raise ApiError(400, "invalid image source")
    if source.get("type") != "base64":
        raise ApiError(400, f"invalid image source type: {source.get('type') or ''}. "
                            "Only base64 images are supported.")
    try:
        base64.b64decode(source.get("data") or "", validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, f"invalid base64 image data: {e}") from None


def _tool_result(content: Any) -> tuple[str, int]:
    """convertToolResultContent: a string, or the text of its text blocks (and its images counted)."""
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        return "", 0
    text, images = [], 0
    for cb in content:
        if not isinstance(cb, dict):
            continue
        if cb.get("type") == "text" and isinstance(cb.get("text"), str):
            text.append(cb["text"])
        elif cb.get("type") == "image":
            if not isinstance(cb.get("source"), dict):
                raise ApiError(400, "invalid tool_result image source")
            _image({k: v for k, v in cb["source"].items() if isinstance(v, str)})
            images += 1
    return "".join(text), images


def _web_search_result(content: Any) -> str:
    """formatWebSearchToolResultContent for the decoded JSON shapes it can meet."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for item in content:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "web_search_result":
                title = item.get("title") if isinstance(item.get("title"), str) else ""
                url = item.get("url") if isinstance(item.get("url"), str) else ""
                out.append(f"- {title}: {url}\n")
            elif item.get("type") == "web_search_tool_result_error":
                code = item.get("error_code") if isinstance(item.get("error_code"), str) else ""
                return f"web_search_tool_result_error: {code}" if code else "web_search_tool_result_error"
        return "".join(out)
    if isinstance(content, dict) and content.get("type") == "web_search_tool_result_error":
        code = content.get("error_code") if isinstance(content.get("error_code"), str) else ""
        return f"web_search_tool_result_error: {code}" if code else "web_search_tool_result_error"
    return json.dumps(content, separators=(",", ":"))


def convert_message(role: str, blocks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """anthropic.convertMessage: one Anthropic message as Ollama's messages (a user's tool results
    as `tool` messages before its text, as Ollama orders them), and the number of images it holds."""
    role = role.lower()
    text: list[str] = []
    images = result_images = 0
    calls: list[dict[str, Any]] = []
    thinking = ""
    results: list[dict[str, Any]] = []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            text.append(b.get("text") or "")
        elif kind == "image":
            _image(b.get("source"))
            images += 1
        elif kind in ("tool_use", "server_tool_use"):
            if kind == "tool_use" and not b.get("id"):
                raise ApiError(400, "tool_use block missing required 'id' field")
            if kind == "tool_use" and not b.get("name"):
                raise ApiError(400, "tool_use block missing required 'name' field")
            calls.append({"id": b.get("id") or "", "function": {"name": b.get("name") or "",
                                                                  "arguments": b.get("input") or {}}})
        elif kind == "tool_result":
            content, n = _tool_result(b.get("content"))
            result_images += n
            results.append({"role": "tool", "content": content, "tool_call_id": b.get("tool_use_id") or ""})
        elif kind == "thinking":
            if b.get("thinking") is not None:
                thinking = b["thinking"]
        elif kind == "web_search_tool_result":
            results.append({"role": "tool", "content": _web_search_result(b.get("content")),
                            "tool_call_id": b.get("tool_use_id") or ""})
        # anything else (redacted_thinking, document, unknown types) is ignored, as Ollama ignores it
    out: list[dict[str, Any]] = []
    if role == "user" and results:
        out += results
    if "".join(text) or images or calls or thinking:
        m: dict[str, Any] = {"role": role, "content": "".join(text)}
        if calls:
            m["tool_calls"] = calls
        if thinking:
            m["thinking"] = thinking
        out.append(m)
    if role != "user" or not results:
        out += results
    return out, images + result_images


def _system(system: Any) -> list[dict[str, Any]]:
    """A string, or the text of the text blocks concatenated (anything else is ignored)."""
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if isinstance(system, list):
        text = "".join(b["text"] for b in system
                       if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str))
        return [{"role": "system", "content": text}] if text else []
    return []


def _tools(body: dict[str, Any], struct: str) -> Callable[[], list[dict[str, Any]]]:
    """convertTool for each tool: custom tools become functions with their input_schema as the
    parameters; a built-in web_search becomes Ollama's web_search function and wins over a custom
    tool of that name. The JSON types are checked now (decoding), the schemas when the result is
    called (the conversion, after the middleware's own checks)."""
    raw = _list(body, "tools", struct, "[]anthropic.Tool")
    tools = []
    for t in raw:
        if not isinstance(t, dict):
            raise _type_error(t, struct, "tools", "anthropic.Tool")
        for key in ("type", "name", "description"):
            _str(t, key, "Tool", "tools.")
        _int(t, "max_uses", "Tool", "tools.")
        tools.append(t)

    def convert() -> list[dict[str, Any]]:
        builtin = any((t.get("type") or "").startswith("web_search") for t in tools)
        out = []
        for t in tools:
            if (t.get("type") or "").startswith("web_search"):
                out.append(WEB_SEARCH)
            elif not (builtin and t.get("name") == "web_search"):
                out.append({"type": "function", "function": {
                    "name": t.get("name") or "",
                    **({"description": t["description"]} if t.get("description") else {}),
                    "parameters": _schema(t.get("name") or "", t.get("input_schema"))}})
        return out

    return convert


def _schema(name: str, schema: Any) -> dict[str, Any]:
    """input_schema as api.ToolFunctionParameters decodes it, or convertTool's error."""
    if schema is None:
        return {}  # api.ToolFunctionParameters' zero value
    what = None
    if not isinstance(schema, dict):
        what = f"json: cannot unmarshal {json_kind(schema)} into Go value of type api.ToolFunctionParameters"
    elif schema.get("type") is not None and not isinstance(schema["type"], str):
        what = _type_error(schema["type"], "ToolFunctionParameters", "type", "string").message
    elif schema.get("required") is not None and not (
            isinstance(schema["required"], list) and all(isinstance(r, str) for r in schema["required"])):
        what = _type_error(schema["required"], "ToolFunctionParameters", "required", "[]string").message
    elif schema.get("properties") is not None and not isinstance(schema["properties"], dict):
        what = _type_error(schema["properties"], "ToolFunctionParameters", "properties",
                           "api.ToolPropertiesMap").message
    else:
        what = _bad_properties(schema.get("properties"))
    if what is not None:
        raise ApiError(400, f"invalid input_schema for tool {json.dumps(name)}: {what}")
    return schema  # type: ignore[return-value]


def _bad_properties(props: Any) -> str | None:
    """Go's error for a property that does not decode into api.ToolProperty (an object, whose
    `properties` and `anyOf` hold more of them), or None."""
    for p in (props or {}).values() if isinstance(props, dict) else ():
        if not isinstance(p, dict):
            return f"json: cannot unmarshal {json_kind(p)} into Go value of type api.ToolProperty"
        nested = p.get("properties")
        any_of = p.get("anyOf")
        if nested is not None and not isinstance(nested, dict):
            return _type_error(nested, "ToolProperty", "properties", "api.ToolPropertiesMap").message
        kind = p.get("type")
        if kind is not None and not (isinstance(kind, str) or (
                isinstance(kind, list) and all(isinstance(k, str) for k in kind))):
            return _type_error(kind, "ToolProperty", "type", "api.PropertyType").message
        if any_of is not None and not isinstance(any_of, list):
            return _type_error(any_of, "ToolProperty", "anyOf", "[]api.ToolProperty").message
        if what := _bad_properties(nested) or _bad_properties(dict(enumerate(any_of or []))):
            return what
    return None


def _think(body: dict[str, Any], struct: str) -> bool | str | None:
    """`thinking` enabled/disabled, else `output_config.effort` as a level (xhigh is high)."""
    thinking = _obj(body, "thinking", struct, "anthropic.ThinkingConfig")
    output = _obj(body, "output_config", struct, "anthropic.OutputConfig") if struct == "MessagesRequest" else None
    kind = _str(thinking, "type", "ThinkingConfig", "thinking.") if thinking else None
    if thinking:
        _int(thinking, "budget_tokens", "ThinkingConfig", "thinking.")
    effort = (_str(output, "effort", "OutputConfig", "output_config.") or "") if output else ""
    effort = effort.strip().lower()
    if kind == "enabled":
        return True
    if kind == "disabled":
        return False
    if effort == "xhigh":
        effort = "high"
    return effort if effort in ("high", "medium", "low", "max") else None


class Request:
    """A decoded Messages request (or count_tokens request), converted as FromMessagesRequest
    converts it: Ollama's messages and tools, `think`, and how many images it carries."""

    def __init__(self, body: dict[str, Any], *, messages_api: bool = True) -> None:
        s = "MessagesRequest" if messages_api else "CountTokensRequest"
        _str(body, "model", s)
        if messages_api:
            _int(body, "max_tokens", s)
            _bool(body, "stream", s)
            for key in ("temperature", "top_p"):
                _float(body, key, s)
            _int(body, "top_k", s)
            _strings(body, "stop_sequences", s)
            choice = _obj(body, "tool_choice", s, "anthropic.ToolChoice")
            if choice:
                _str(choice, "type", "ToolChoice", "tool_choice.")
                _str(choice, "name", "ToolChoice", "tool_choice.")
            metadata = _obj(body, "metadata", s, "anthropic.Metadata")
            if metadata:
                _str(metadata, "user_id", "Metadata", "metadata.")
        parsed = [_message(m) for m in _list(body, "messages", s, "[]anthropic.MessageParam")]
        self.think = _think(body, s)
        tools = _tools(body, s)
        # AnthropicMessagesMiddleware's checks, in its order, before the conversion
        if not body.get("model"):
            raise ApiError(400, "model is required")
        if messages_api and (body.get("max_tokens") or 0) <= 0:
            raise ApiError(400, "max_tokens is required and must be positive")
        if not parsed:
            raise ApiError(400, "messages is required")
        self.model: str = body["model"]
        self.messages = _system(body.get("system"))
        self.images = 0
        for role, blocks in parsed:
            converted, images = convert_message(role, blocks)
            self.messages += converted
            self.images += images
        if not self.messages:
            raise ApiError(400, "messages: no content the model can read (only unknown block types)")
        self.tools = tools() or None

    def prompt(self, request: web.Request, entry: PairEntry) -> Prompt:
        """The Prompt /api/chat would make. Thinking asked of a pair that cannot think is dropped,
        not refused: the middleware sets `relax_thinking` (server/routes.go ChatHandler), as Claude
        Code asks every model to think."""
        think = self.think
        if (think is True or isinstance(think, str)) and \
                "thinking" not in runtime_of(request).format(entry).capabilities:
            think = None
        return Prompt.of_chat(self.messages, self.tools, think=think)


def options(body: dict[str, Any]) -> dict[str, Any]:
    """num_predict from max_tokens, and the sampling fields the request sets (no /v1 defaults)."""
    opts: dict[str, Any] = {"num_predict": body["max_tokens"]}
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            opts[key] = body[key]
    if body.get("stop_sequences"):
        opts["stop"] = body["stop_sequences"]
    return opts


def estimate(body: dict[str, Any]) -> int:
    """anthropic.EstimateCountTokens: a quarter of the characters of system, roles, texts and
    thinking, tool blocks as JSON, and tools; at least 1 when there is anything."""
    def content(c: Any) -> int:
        if c is None:
            return 0
        if isinstance(c, str):
            return len(c)
        if isinstance(c, list):
            total = 0
            for b in c:
                if isinstance(b, dict):
                    total += sum(len(b[k]) for k in ("text", "thinking") if isinstance(b.get(k), str))
                    if b.get("type") in ("tool_use", "tool_result"):
                        total += len(json.dumps(b, separators=(",", ":")))
            return total
        return len(json.dumps(c, separators=(",", ":")))

    total = content(body.get("system"))
    msgs = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    for m in msgs:
        total += len(m.get("role") or "") + content(m.get("content"))
    for t in body.get("tools") or []:
        if isinstance(t, dict):
            total += sum(len(t[k]) for k in ("name", "description") if isinstance(t.get(k), str))
            total += len(json.dumps(t["input_schema"], separators=(",", ":"))) if t.get("input_schema") else 0
    tokens = total // 4
    return 1 if tokens == 0 and (msgs or body.get("system") is not None) else tokens
