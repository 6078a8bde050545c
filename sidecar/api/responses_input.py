"""A /v1/responses request as Ollama reads it, and the chat request Ollama makes of it.

Ollama decodes the body into openai.ResponsesRequest (openai/responses.go), whose fields fail the
way Go's encoding/json fails on the wrong JSON type, and whose input items and content parts are
unions read by their `type`; clients and their tests match on those messages, so they are Go's
here too. FromResponsesRequest then turns the request into an api.ChatRequest: `instructions` a
system message, items chat messages (a function call joins the assistant turn before it, a
reasoning item becomes the next assistant turn's thinking), tools api.Tools.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from sidecar.api.openai import think_from_effort
from sidecar.api.wire import ApiError, json_kind

GO_INT_MAX = 2**63 - 1


# -- Go's decoder, for the fields of openai.ResponsesRequest ------------------------------------------
def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_obj(v: Any) -> bool:
    return isinstance(v, dict)


def _is_list(v: Any) -> bool:
    return isinstance(v, list)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    """A JSON integer literal that fits Go's int (5.0 and 1e3 do not: Go names them as numbers)."""
    return isinstance(v, int) and not isinstance(v, bool) and -GO_INT_MAX - 1 <= v <= GO_INT_MAX


def _type_error(v: Any, struct: str, field: str, go: str) -> ApiError:
    """encoding/json's UnmarshalTypeError text (Go names a number that is no int by its literal)."""
    kind = json_kind(v)
    if go == "int" and kind == "number":
        kind = f"number {json.dumps(v)}"
    where = f"Go struct field {struct}.{field}" if struct else "Go value"
    return ApiError(400, f"json: cannot unmarshal {kind} into {where} of type {go}")


def _fields(obj: dict[str, Any], struct: str, path: str, spec: dict[str, tuple[Any, str]]) -> None:
    """Check an object's fields against a Go struct's: null is the zero value, unknown keys pass."""
    for key, (ok, go) in spec.items():
        v = obj.get(key)
        if v is not None and not ok(v):
            raise _type_error(v, struct, f"{path}{key}", go)


_REQUEST = {
    "model": (_is_str, "string"), "background": (_is_bool, "bool"), "instructions": (_is_str, "string"),
    "max_output_tokens": (_is_int, "int"), "reasoning": (_is_obj, "openai.ResponsesReasoning"),
    "temperature": (_is_num, "float64"), "text": (_is_obj, "openai.ResponsesText"), "top_p": (_is_num, "float64"),
    "truncation": (_is_str, "string"), "tools": (_is_list, "[]openai.ResponsesTool"), "stream": (_is_bool, "bool"),
    "include": (_is_list, "[]string"),
}
_REASONING = {"effort": (_is_str, "string"), "generate_summary": (_is_str, "string"), "summary": (_is_str, "string")}
_FORMAT = {"type": (_is_str, "string"), "name": (_is_str, "string"), "strict": (_is_bool, "bool")}
_TOOL = {"type": (_is_str, "string"), "name": (_is_str, "string"), "description": (_is_str, "string"),
         "strict": (_is_bool, "bool"), "parameters": (_is_obj, "map[string]interface {}"),
         "tools": (_is_list, "[]openai.ResponsesTool")}
_FUNCTION_CALL = {"id": (_is_str, "string"), "type": (_is_str, "string"), "call_id": (_is_str, "string"),
                  "name": (_is_str, "string"), "arguments": (_is_str, "string")}
_CONTENT = {"input_text": {"text": (_is_str, "string")}, "output_text": {"text": (_is_str, "string")},
            "input_image": {"detail": (_is_str, "string"), "file_id": (_is_str, "string"),
                            "image_url": (_is_str, "string")},
            "input_file": {"file_data": (_is_str, "string"), "file_id": (_is_str, "string"),
                           "file_url": (_is_str, "string"), "filename": (_is_str, "string")}}
_CONTENT_STRUCT = {"input_text": "ResponsesTextContent", "output_text": "ResponsesOutputTextContent",
                   "input_image": "ResponsesImageContent", "input_file": "ResponsesFileContent"}


def _tools(tools: list[Any], path: str) -> None:
    for t in tools:
        if not isinstance(t, dict):
            raise _type_error(t, "ResponsesRequest" if path == "" else "ResponsesTool", path + "tools",
                              "openai.ResponsesTool")
        _fields(t, "ResponsesTool", path + "tools.", _TOOL)
        if t.get("tools"):
            _tools(t["tools"], path + "tools.")


def _content(raw: Any) -> list[dict[str, Any]]:
    """A content array (unmarshalResponsesContent): each part by its type."""
    out = []
    for i, part in enumerate(raw):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part, dict) or not (kind is None or isinstance(kind, str)):
            what = part if not isinstance(part, dict) else kind
            err = _type_error(what, "", "", 'struct { Type string "json:\\"type\\"" }').message
            raise ApiError(400, f"content[{i}]: {err}")
        if kind not in _CONTENT:
            raise ApiError(400, f"content[{i}]: unknown content type: {kind or ''}")
        try:
            _fields(part, _CONTENT_STRUCT[kind], "", _CONTENT[kind])
        except ApiError as e:
            raise ApiError(400, f"content[{i}]: {e.message}") from None
        out.append(part)
    return out


def read_item(raw: Any) -> dict[str, Any]:
    """One input item as unmarshalResponsesInputItem reads it; the returned dict is the item with its
    type settled (a `{"role", "content"}` shorthand is a message) and its content as parts."""
    if not isinstance(raw, dict):
        raise _type_error(raw, "", "", 'struct { Type string "json:\\"type\\""; Role string "json:\\"role\\"" }')
    kind, role = raw.get("type") or "", raw.get("role") or ""
    for v in (kind, role):
        if not isinstance(v, str):
            raise _type_error(v, "", "", 'struct { Type string "json:\\"type\\""; Role string "json:\\"role\\"" }')
    if kind == "" and role != "":
        kind = "message"
    if kind == "message":
        content = raw.get("content")
        if content is None:
            parts: list[dict[str, Any]] = []
        elif isinstance(content, str):
            parts = [{"type": "input_text", "text": content}]
        elif isinstance(content, list):
            parts = _content(content)
        else:
            err = _type_error(content, "", "", "[]json.RawMessage").message
            raise ApiError(400, f"content must be a string or array: {err}")
        return {"type": "message", "role": role, "content": parts}
    if kind == "function_call":
        _fields(raw, "ResponsesFunctionCall", "", _FUNCTION_CALL)
        return {"type": kind, "call_id": raw.get("call_id") or "", "name": raw.get("name") or "",
                "arguments": raw.get("arguments") or ""}
    if kind == "function_call_output":
        if raw.get("call_id") is not None and not isinstance(raw["call_id"], str):
            raise _type_error(raw["call_id"], "", "call_id", "string")
        output = raw.get("output")
        images: list[dict[str, Any]] = []
        if isinstance(output, list):
            try:
                images = _content(output)
            except ApiError as e:
                raise ApiError(400, e.message.replace("content[", "output[", 1)) from None
            output = "".join(p.get("text") or "" for p in images if p["type"] in ("input_text", "output_text"))
        elif output is not None and not isinstance(output, str):
            err = _type_error(output, "", "", "[]json.RawMessage").message
            raise ApiError(400, f"output must be a string or array: {err}")
        return {"type": kind, "call_id": raw.get("call_id") or "", "output": output or "", "parts": images}
    if kind == "reasoning":
        enc = raw.get("encrypted_content")
        if enc is not None and not isinstance(enc, str):
            raise _type_error(enc, "ResponsesReasoningInput", "encrypted_content", "string")
        return {"type": kind, "encrypted_content": enc or ""}
    if kind == "web_search_call":
        return {"type": kind}
    if kind == "":
        raise ApiError(400, "input item missing required 'type' field")
    raise ApiError(400, f"unknown input item type: {json.dumps(kind)}")


def _input(raw: Any) -> tuple[str, list[dict[str, Any]]]:
    """ResponsesInput: (the text of a string input, the items of an array)."""
    if raw is None:
        return "", []
    if isinstance(raw, str):
        return raw, []
    if not isinstance(raw, list):
        err = _type_error(raw, "", "", "[]json.RawMessage").message
        raise ApiError(400, f"input must be a string or array: {err}")
    items = []
    for i, r in enumerate(raw):
        try:
            items.append(read_item(r))
        except ApiError as e:
            raise ApiError(400, f"input[{i}]: {e.message}") from None
    return "", items


@dataclass
class ResponsesRequest:
    """openai.ResponsesRequest as read from a body, plus the two stateful fields Ollama does not read."""

    body: dict[str, Any]
    model: str
    text: str  # a string `input`
    items: list[dict[str, Any]]  # an array `input`, each item settled by _item
    instructions: str = ""
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True  # OpenAI's default: a response is kept unless the request says `store: false`
    tools: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, body: dict[str, Any]) -> ResponsesRequest:
        _fields(body, "ResponsesRequest", "", _REQUEST)
        if isinstance(body.get("reasoning"), dict):
            _fields(body["reasoning"], "ResponsesReasoning", "reasoning.", _REASONING)
        if isinstance(body.get("text"), dict):
            fmt = body["text"].get("format")
            if fmt is not None and not isinstance(fmt, dict):
                raise _type_error(fmt, "ResponsesText", "text.format", "openai.ResponsesTextFormat")
            if fmt:
                _fields(fmt, "ResponsesTextFormat", "text.format.", _FORMAT)
        for s in body.get("include") or []:
            if not isinstance(s, str):
                raise _type_error(s, "ResponsesRequest", "include", "string")
        tools = body.get("tools") or []
        _tools(tools, "")
        text, items = _input(body.get("input"))
        prev = body.get("previous_response_id")
        if prev is not None and not isinstance(prev, str):
            raise ApiError(400, "invalid previous_response_id: must be a string")
        store = body.get("store")
        if store is not None and not isinstance(store, bool):
            raise ApiError(400, "invalid store: must be a boolean")
        return cls(body, body.get("model") or "", text, items, body.get("instructions") or "",
                   body.get("stream") is True, prev or None, store is not False, tools)

    @property
    def own_items(self) -> list[dict[str, Any]]:
        """This request's input as items (a string input is one user message), for the store."""
        if self.text:
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.text}]}]
        return self.items

    def options(self) -> dict[str, Any]:
        """Ollama's options for a Responses request: temperature 1.0 when absent, top_p only when
        given (FromResponsesRequest's TODO), max_output_tokens as num_predict."""
        b = self.body
        opts: dict[str, Any] = {"temperature": 1.0 if b.get("temperature") is None else float(b["temperature"])}
        if b.get("top_p") is not None:
            opts["top_p"] = float(b["top_p"])
        if b.get("max_output_tokens") is not None:
            opts["num_predict"] = int(b["max_output_tokens"])
        return opts

    def format(self) -> str | dict[str, Any] | None:
        """`text.format` of type json_schema as Ollama's `format`; any other type is no constraint."""
        fmt = (self.body.get("text") or {}).get("format") or {}
        if fmt.get("type") != "json_schema" or fmt.get("schema") is None:
            return None
        schema = fmt["schema"]
        if isinstance(schema, dict):
            return schema
        if schema == "json":
            return "json"
        raise ApiError(400, f'invalid format: "{json.dumps(schema)}"; expected "json" or a valid JSON Schema object')

    def think(self) -> bool | str | None:
        return think_from_effort((self.body.get("reasoning") or {}).get("effort"))


# -- the request as Ollama's chat request (FromResponsesRequest) ----------------------------------------
def _text_of(parts: list[dict[str, Any]], entry_name: str) -> str:
    """convertResponsesContent: the text parts joined; images and files are refused for a pair."""
    text = ""
    for p in parts:
        if p["type"] in ("input_text", "output_text"):
            text += p.get("text") or ""
        elif p["type"] == "input_image" and p.get("image_url"):
            raise ApiError(400, f"{entry_name} does not support vision")
        elif p["type"] == "input_file":
            raise ApiError(400, "file inputs are not currently supported")
    return text


def _arguments(raw: str) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"failed to parse function call arguments: {e.msg}") from None
    if not isinstance(args, dict):
        raise ApiError(400, "failed to parse function call arguments: Value looks like object, "
                            "but can't find closing '}' symbol")
    return args


def chat_messages(instructions: str, items: list[dict[str, Any]], vision: str) -> list[dict[str, Any]]:
    """The chat messages Ollama's FromResponsesRequest makes of a Responses input (a string input
    is already its one user message); `vision` is the pair's full name, for the refusal of images."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    pending = ""  # a reasoning item's text, for the next assistant message
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "reasoning":
            pending = item["encrypted_content"]
        elif kind == "message":
            msg: dict[str, Any] = {"role": item["role"], "content": _text_of(item["content"], vision)}
            if msg["role"] == "assistant" and pending:
                msg["thinking"], pending = pending, ""
            # An assistant message replayed between a function_call and its output joins the call's message.
            nxt = items[i + 1] if i + 1 < len(items) else None
            answers = nxt["call_id"] if nxt is not None and nxt["type"] == "function_call_output" else ""
            last = messages[-1] if messages else None
            if (msg["role"] == "assistant" and answers and last is not None and last["role"] == "assistant"
                    and any(c["id"] == answers for c in last.get("tool_calls", ()))):
                if last["content"] and msg["content"]:
                    last["content"] += "\n"
                last["content"] += msg["content"]
                if msg.get("thinking"):
                    last["thinking"] = msg["thinking"]
                continue
            messages.append(msg)
        elif kind == "function_call":
            args = _arguments(item["arguments"])
            call = {"id": item["call_id"], "function": {"name": item["name"], "arguments": args}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
                target = messages[-1]
            else:
                target = {"role": "assistant", "content": "", "tool_calls": [call]}
                messages.append(target)
            if pending:
                target["thinking"], pending = pending, ""
        elif kind == "function_call_output":
            content = _text_of(item["parts"], vision) if item["parts"] else item["output"]
            messages.append({"role": "tool", "content": content, "tool_call_id": item["call_id"]})
        # web_search_call: history metadata only
    if pending:
        messages.append({"role": "assistant", "content": "", "thinking": pending})
    for m in messages:
        if not m.get("tool_calls"):
            m.pop("tool_calls", None)
    return messages


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses tools as Ollama's api.Tool (convertTools): a namespace's members under prefixed
    names; web_search left out (see the module's docstring)."""
    out: list[dict[str, Any]] = []
    for t in tools:
        kind = t.get("type") or ""
        if kind == "web_search":
            continue
        if kind == "namespace":
            prefix = f"{t['name']}." if t.get("name") else ""
            for member in chat_tools(t.get("tools") or []):
                name = member["function"]["name"]
                if prefix and not name.startswith(prefix):
                    member["function"]["name"] = prefix + name
                out.append(member)
            continue
        params = t.get("parameters") or {}
        function: dict[str, Any] = {"name": t.get("name") or ""}
        if t.get("description"):
            function["description"] = t["description"]
        function["parameters"] = {k: params[k] for k in ("type", "$defs", "items", "required", "properties")
                                  if k in params}
        function["parameters"].setdefault("type", "")
        out.append({"type": kind, "function": function})
    return out
