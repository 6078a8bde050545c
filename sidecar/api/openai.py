"""The OpenAI-compatible /v1 API for pairs, as Ollama serves it (ollama-api.md §10).

Editors, agents and SDKs that speak OpenAI reach Ollama at /v1, so pairs must answer there too.
Requests become the same Jobs as /api/chat and /api/generate, with Ollama's /v1 defaults:
temperature and top_p 1.0 when absent, `max_tokens` as num_predict, `stream` false by default.
Answers are OpenAI's chat.completion / text_completion objects or SSE chunks (`OpenAIFraming`);
errors use OpenAI's envelope, which the SDKs parse (api.app picks it by path).
"""

from __future__ import annotations

import json
import math
import random
import time
from typing import Any

from aiohttp import web

from sidecar.api import proxy
from sidecar.api.pairs import find_pair, runtime_of
from sidecar.api.respond import joined, logprobs_json, respond
from sidecar.api.wire import ApiError, dumps, json_response, read_body
from sidecar.config.entries import PairEntry
from sidecar.runtime.contract import Delta, Job, Outcome, Prompt
from sidecar.runtime.render import full_name

SSE = "text/event-stream"
FINGERPRINT = "fp_ollama"  # what Ollama sends; clients that branch on it see Ollama


# -- request fields --------------------------------------------------------------------------------
def _number(body: dict[str, Any], key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ApiError(400, f"invalid {key}: must be a number")
    return float(v)


def _integer(body: dict[str, Any], key: str) -> int | None:
    v = _number(body, key)
    if v is None:
        return None
    if v != int(v):
        raise ApiError(400, f"invalid {key}: must be an integer")
    return int(v)


def _object(body: dict[str, Any], key: str) -> dict[str, Any] | None:
    """A field that Ollama decodes into a struct pointer (openai/openai.go): absent or null is nil,
    and anything but an object is refused, as Go's decoder refuses it."""
    v = body.get(key)
    if v is not None and not isinstance(v, dict):
        raise ApiError(400, f"invalid {key}: must be an object")
    return v


def _stop(body: dict[str, Any]) -> list[str] | None:
    v = body.get("stop")
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise ApiError(400, "invalid stop: must be a string or a list of strings")


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "invalid stream: must be a boolean")
    so = _object(body, "stream_options")
    include_usage = stream and so is not None and so.get("include_usage") is True
    return stream, include_usage


def _response_format(body: dict[str, Any]) -> str | dict[str, Any] | None:
    """`response_format` as Ollama's `format`: json_object is "json", json_schema its schema."""
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "invalid response_format: json_schema.schema must be a JSON Schema object")
        return schema
    raise ApiError(400, "invalid response_format: type must be text, json_object or json_schema")


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ApiError(400, "invalid tools: must be an array of objects")
    return tools


def _input_tool_calls(calls: Any, names: dict[str, str]) -> list[dict[str, Any]]:
    """An assistant message's OpenAI tool_calls as Ollama's (arguments parsed to an object)."""
    if not isinstance(calls, list):
        raise ApiError(400, "invalid tool_calls: must be an array")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, "invalid tool call: function.name is required")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise ApiError(400, "invalid tool call arguments") from None
        if not isinstance(args, dict):
            raise ApiError(400, "invalid tool call arguments")
        cid = call.get("id") if isinstance(call.get("id"), str) else ""
        if cid:
            names[cid] = fn["name"]
        out.append({"id": cid, "function": {"name": fn["name"], "arguments": args}})
    return out


def sampling(body: dict[str, Any], *, completion: bool) -> dict[str, Any]:
    """The request's options layer, with Ollama's /v1 defaults (they override the pair's own)."""
    opts: dict[str, Any] = {}
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None:
        opts["num_predict"] = max_tokens
    temperature = _number(body, "temperature")
    opts["temperature"] = 1.0 if temperature is None else temperature
    top_p = _number(body, "top_p")
    opts["top_p"] = 1.0 if top_p is None or (completion and top_p == 0) else top_p
    seed = _integer(body, "seed")
    if seed is not None:
        opts["seed"] = seed
    for key in ("frequency_penalty", "presence_penalty"):
        if (v := _number(body, key)) is not None:
            opts[key] = v
    if (stop := _stop(body)) is not None:
        opts["stop"] = stop
    return opts


def _think(body: dict[str, Any]) -> bool | str | None:
    """`reasoning.effort` or `reasoning_effort` as Ollama's `think`."""
    reasoning = body.get("reasoning")
    return think_from_effort(reasoning.get("effort") if isinstance(reasoning, dict) else body.get("reasoning_effort"))


def think_from_effort(effort: Any) -> bool | str | None:
    """A reasoning effort as Ollama's `think` (openai/openai.go thinkFromReasoningEffort); /v1/responses
    maps its `reasoning.effort` the same way."""
    if effort in (None, ""):
        return None
    mapping: dict[str, bool | str] = {"none": False, "minimal": "low", "low": "low", "medium": "medium",
                                      "high": "high", "max": "max", "xhigh": "max", "ultra": "max"}
    if not isinstance(effort, str) or effort not in mapping:
        raise ApiError(400, f'invalid reasoning value: {json.dumps(effort)} (must be "minimal", "low", "medium", '
                            '"high", "xhigh", "ultra", "max", or "none")')
    return mapping[effort]


def _logprobs(body: dict[str, Any], *, completion: bool) -> int | None:
    """Chat: `logprobs` true plus `top_logprobs`; completions: `logprobs` is the number of alternatives,
    which Ollama passes on as `top_logprobs` and checks as such (openai/openai.go FromCompleteRequest,
    server/routes.go)."""
    if completion:
        n = _integer(body, "logprobs")
        if n is not None and not 0 <= n <= 20:
            raise ApiError(400, "top_logprobs must be between 0 and 20")
        return n
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise ApiError(400, "invalid logprobs: must be a boolean")
    top = _integer(body, "top_logprobs") or 0
    if not 0 <= top <= 20:
        raise ApiError(400, "top_logprobs must be between 0 and 20")
    return top if on else None


def _find(request: web.Request, body: dict[str, Any]) -> PairEntry:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model is required")
    return find_pair(request, name)


def _has_images(body: dict[str, Any]) -> bool:
    msgs = body.get("messages")
    return isinstance(msgs, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"]) for m in msgs)


def _messages(entry: PairEntry, body: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI messages as Ollama's: a content array becomes one message per text part."""
    raw = body.get("messages")
    if raw is None or raw == []:
        raise ApiError(400, "[] is too short - 'messages'")
    if not isinstance(raw, list):
        raise ApiError(400, "invalid messages: must be an array")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool call id -> function name, for tool messages that only give the id
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"invalid message {i}: must be an object with a role")
        role = m["role"].lower()
        content = m.get("content")
        extra: dict[str, Any] = {}
        if m.get("tool_calls"):
            extra["tool_calls"] = _input_tool_calls(m["tool_calls"], names)
        if isinstance(m.get("reasoning"), str) and m["reasoning"]:
            extra["thinking"] = m["reasoning"]  # Ollama's name for an earlier turn's reasoning
        if role == "tool":
            cid: str = m["tool_call_id"] if isinstance(m.get("tool_call_id"), str) else ""
            name = m.get("name") if isinstance(m.get("name"), str) else names.get(cid, "")
            extra.update({"tool_name": name, "tool_call_id": cid} if cid else {"tool_name": name})
        if content is None or isinstance(content, str):
            out.append({"role": role, "content": content or "", **extra})
        elif isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    out.append({"role": role, "content": part["text"]})
                elif kind in ("image_url", "input_audio"):  # (images went upstream, if they could)
                    what = "vision" if kind == "image_url" else "audio"
                    raise ApiError(400, f"{full_name(entry)} does not support {what}")
                else:
                    raise ApiError(400, f"invalid message {i}: unsupported content part")
        else:
            raise ApiError(400, f"invalid message {i}: content must be a string or an array")
        if extra and not isinstance(content, str | None):
            out[-1].update(extra)
    return out


# -- responses -------------------------------------------------------------------------------------
def _finish(o: Outcome, called: bool = False) -> str:
    if called:
        return "tool_calls"
    return "length" if o.done_reason == "length" else "stop"


def _tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama's tool calls in OpenAI's shape: arguments as a JSON string, type "function"."""
    return [{"id": c["id"], "index": c["function"]["index"], "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": json.dumps(c["function"]["arguments"], separators=(",", ":"),
                                                  ensure_ascii=False)}}
            for c in calls]


def _usage(o: Outcome) -> dict[str, int]:
    prompt, completion = o.prompt_tokens, o.eval_count
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class OpenAIFraming:
    """chat.completion / text_completion objects, or their SSE chunks ending with `data: [DONE]`.

    The model's thinking is `reasoning` (Ollama's name, not `reasoning_content`); logprobs are
    `choices[].logprobs.content` (openai/openai.go)."""

    content_type = SSE

    def __init__(self, entry: PairEntry, *, chat: bool, include_usage: bool = False) -> None:
        self.chat = chat
        self.include_usage = include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{random.randrange(1000)}"  # Ollama: rand.Intn(999)
        self.model = entry.name
        self.created = int(time.time())  # every chunk carries the first one's
        self.first = True  # the first chat delta carries the role
        self.called = False  # a stream that made tool calls finishes with "tool_calls"

    def envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT}

    def encode(self, chunk: dict[str, Any]) -> bytes:
        return f"data: {dumps(chunk)}\n\n".encode("ascii")

    def chunk(self, d: Delta | None, finish: str | None) -> dict[str, Any]:
        """A streamed Delta (finish None), or the closing chunk (d None)."""
        logprobs = {"content": logprobs_json(d.logprobs)} if d is not None and d.logprobs else None
        if self.chat:
            delta: dict[str, Any] = {}
            if self.first:
                delta["role"] = "assistant"
            if d is not None:
                if d.thinking:
                    delta["reasoning"] = d.thinking
                if d.content or not (d.thinking or d.tool_calls):
                    delta["content"] = d.content
                if d.tool_calls:
                    delta["tool_calls"] = _tool_calls(list(d.tool_calls))
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            if logprobs:
                choice["logprobs"] = logprobs
            obj = "chat.completion.chunk"
        else:
            choice = {"text": d.content if d else "", "index": 0, "logprobs": logprobs, "finish_reason": finish}
            obj = "text_completion"
        self.first = False
        return {**self.envelope(obj), "choices": [choice]}

    def delta(self, d: Delta) -> list[dict[str, Any]]:
        out = []
        if self.chat and d.thinking and (d.content or d.tool_calls):  # a mixed delta is split in two
            out.append(self.chunk(Delta(thinking=d.thinking, logprobs=d.logprobs), None))
            d = Delta(d.content, d.tool_calls)
        if d.content or d.thinking or d.logprobs:
            out.append(self.chunk(Delta(d.content, (), d.thinking, d.logprobs), None))
        if d.tool_calls:
            out.append(self.chunk(Delta(tool_calls=d.tool_calls), None))
            self.called = True
        return out

    def final(self, o: Outcome) -> list[dict[str, Any]]:
        out = [self.chunk(None, _finish(o, self.called))]  # chat: delta {} (the role if nothing came)
        if self.include_usage:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            out.append({**self.envelope(obj), "choices": [], "usage": _usage(o)})
        return out

    def end(self) -> bytes:
        return b"data: [DONE]\n\n"

    def error(self, message: str) -> dict[str, Any]:
        return {"error": {"message": message, "type": "api_error", "param": None, "code": None}}

    def whole(self, parts: list[Delta], o: Outcome) -> web.Response:
        d = joined(parts)
        logprobs = {"content": logprobs_json(d.logprobs)} if d.logprobs else None
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": d.content}
            if d.thinking:
                message["reasoning"] = d.thinking
            if d.tool_calls:
                message["tool_calls"] = _tool_calls(list(d.tool_calls))
            choice: dict[str, Any] = {"index": 0, "message": message,
                                      "finish_reason": _finish(o, bool(d.tool_calls))}
            if logprobs:
                choice["logprobs"] = logprobs
            out = self.envelope("chat.completion")
        else:
            choice = {"text": d.content, "index": 0, "logprobs": logprobs, "finish_reason": _finish(o)}
            out = self.envelope("text_completion")
        return json_response({**out, "choices": [choice], "usage": _usage(o)})


# -- routes ------------------------------------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    entry = _find(request, body)
    if _has_images(body):
        forwarded = await proxy.images_upstream(request, entry)
        if forwarded is not None:
            return forwarded
    _object(body, "reasoning")  # ChatCompletionRequest's struct; CompletionRequest has no such field
    prompt = Prompt.of_chat(_messages(entry, body), _tools(body), think=_think(body))
    job = Job(prompt, sampling(body, completion=False), _response_format(body),
              logprobs=_logprobs(body, completion=False))
    stream, include_usage = _stream(body)
    return await respond(request, entry, job, OpenAIFraming(entry, chat=True, include_usage=include_usage), stream)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    entry = _find(request, body)
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string")
    suffix = body.get("suffix") or ""
    if not isinstance(suffix, str):
        raise ApiError(400, "suffix must be a string")
    # Like Ollama, /v1/completions goes through the template (it is /api/generate without raw).
    job = Job(Prompt.of_completion(prompt, suffix=suffix, think=_think(body)), sampling(body, completion=True),
              _response_format(body), logprobs=_logprobs(body, completion=True))
    stream, include_usage = _stream(body)
    return await respond(request, entry, job, OpenAIFraming(entry, chat=False, include_usage=include_usage), stream)


def owned_by(name: str) -> str:
    """Ollama's owned_by: the namespace of the name (`library`, `user`, `x` for `hf.co/x/y`)."""
    parts = name.split(":", 1)[0].split("/")
    return parts[-2] if len(parts) >= 2 else "library"


def model_object(entry: PairEntry) -> dict[str, Any]:
    return {"id": entry.name, "object": "model", "created": int(entry.modified), "owned_by": owned_by(entry.name)}


async def models(request: web.Request) -> web.Response:
    """The pairs, then the upstream's models that no pair shadows."""
    rt = runtime_of(request)
    data = [model_object(e) for e in rt.entries.values()]
    up = proxy.upstream_of(request)
    if up is not None:
        theirs = await up.get_json(request, "/v1/models")
        ours = {e.name.lower() for e in rt.entries.values()}
        items = theirs.get("data") if isinstance(theirs, dict) else None
        for m in items if isinstance(items, list) else []:
            if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"].lower() not in ours:
                data.append(m)
    return json_response({"object": "list", "data": data})


async def model(request: web.Request) -> web.StreamResponse:
    name = request.match_info["model"]
    entry = runtime_of(request).find(name)
    if entry is not None:
        return json_response(model_object(entry))
    up = proxy.upstream_of(request)
    if up is not None:
        return await up.forward(request)
    raise ApiError(404, f"model '{name}' not found")


def setup(app: web.Application) -> None:
    """The /v1 routes: pairs here, other models forwarded (proxy.pair_or_forward)."""
    r = app.router
    r.add_post("/v1/chat/completions", proxy.pair_or_forward(chat_completions))
    r.add_post("/v1/completions", proxy.pair_or_forward(completions))
    r.add_post("/v1/embeddings", proxy.embeddings)
    r.add_get("/v1/models", models)
    r.add_get("/v1/models/{model:.+}", model)
