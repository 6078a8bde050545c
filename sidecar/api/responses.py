"""The OpenAI Responses API (/v1/responses) for pairs, as Ollama translates it, plus `previous_response_id`.

Coding agents (the Codex CLI with `wire_api = "responses"`) speak this API. Ollama serves it by
translating the request into a chat request for its chat handler (server/routes.go: `/v1/responses`
goes through middleware.ResponsesMiddleware, middleware/openai.go) and the chat handler's answers
back into Responses objects and SSE events (openai/responses.go: FromResponsesRequest, ToResponse,
ResponsesStreamConverter). This module and api.responses_input are that translation and nothing
more: the request (read there) becomes the same `Job` /api/chat makes, api.respond runs it, and
`ResponsesFraming` writes it.

Where the daemon goes beyond Ollama (docs/agents.md, "Codex CLI" says why):

- `previous_response_id`: Ollama ignores it (docs/api/openai-compatibility.mdx: "stateful
  v1/responses not supported"). Here a bounded in-memory store keeps each stored response's input
  and output items, and a follow-up that names it gets them prepended to its own input, as OpenAI
  defines it (the earlier `instructions` are not carried over). `store: false` is honoured: such a
  response is not kept, so it cannot be continued. A restart forgets the store.
- usage: `input_tokens` is the whole prompt and `input_tokens_details.cached_tokens` the part the
  prefix cache supplied, as OpenAI defines them (Ollama reports only what it evaluated, and 0 cached).
- a generation cut by its token limit ends as `response.incomplete` (status `incomplete`,
  `incomplete_details.reason` `max_output_tokens`), as OpenAI documents; Ollama says `completed`.
- the built-in `web_search` tool is ignored: Ollama runs it through ollama.com's search service,
  which this daemon has no access to, so the model is not offered a tool that could only fail.
- response ids are long random ones (`resp_<32 hex>`) rather than Ollama's `resp_<6 digits>`,
  since a store looks them up.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections import OrderedDict
from typing import Any

from aiohttp import web

from sidecar.api import proxy
from sidecar.api.pairs import find_pair
from sidecar.api.respond import joined, respond
from sidecar.api.responses_input import ResponsesRequest, chat_messages, chat_tools, read_item
from sidecar.api.wire import ApiError, json_response, read_body
from sidecar.runtime.contract import Delta, Job, Outcome, Prompt
from sidecar.runtime.render import full_name

SSE = "text/event-stream"
MAX_STORED = 1024  # responses the store keeps at most; the least recently used go first
MAX_STORED_BYTES = 64 * 1024 * 1024  # their items' JSON, counted whole for each response


# -- the store behind previous_response_id ----------------------------------------------------------
class ResponseStore:
    """The recent responses' items (the request's input, earlier ones included, and the output),
    by response id, bounded in count and bytes; the least recently used go first."""

    def __init__(self, max_count: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str) -> list[dict[str, Any]] | None:
        got = self._items.get(rid)
        if got is None:
            return None
        self._items.move_to_end(rid)
        return got[0]

    def put(self, rid: str, items: list[dict[str, Any]]) -> None:
        size = len(json.dumps(items, separators=(",", ":")))
        if size > self.max_bytes:
            return  # larger than the whole store: not kept
        self._items[rid] = (items, size)
        self.bytes += size
        while len(self._items) > self.max_count or self.bytes > self.max_bytes:
            _, (_, gone) = self._items.popitem(last=False)
            self.bytes -= gone


STORE = web.AppKey("sidecar_responses_store", ResponseStore)


# -- the answer (ToResponse, ResponsesStreamConverter) -----------------------------------------------
def _go_number(v: Any) -> Any:
    """A float64 as Go's encoder writes it: 1.0 is `1`."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def usage(o: Outcome) -> dict[str, Any]:
    """OpenAI's usage: the whole prompt, of it the cached part; Ollama counts only what it evaluated."""
    prompt = o.prompt_tokens + o.prompt_cached
    return {"input_tokens": prompt, "output_tokens": o.eval_count, "total_tokens": prompt + o.eval_count,
            "input_tokens_details": {"cached_tokens": o.prompt_cached},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _arguments_json(args: Any) -> str:
    return json.dumps(args, separators=(",", ":"), ensure_ascii=False)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": "completed", "role": "assistant",
            "content": [_text_part(text)]}


class ResponsesFraming:
    """Responses objects and SSE events, as Ollama's ResponsesStreamConverter and ToResponse write
    them; at a generation's end the response's items go to the store (unless `store: false`)."""

    content_type = SSE

    def __init__(self, entry_name: str, req: ResponsesRequest, items: list[dict[str, Any]],
                 store: ResponseStore) -> None:
        self.req = req
        self.model = req.model or entry_name
        self.items = items  # the whole input as items, earlier responses' included
        self.store = store
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{random.randrange(999999)}"
        self.created = int(time.time())
        # the stream converter's state
        self.seq = 0
        self.started = False
        self.output_index = 0
        self.content_started = False
        self.tool_calls_sent = False
        self.text = ""
        self.thinking = ""
        self.reasoning_id = ""
        self.completed: list[dict[str, Any]] = []

    # -- the response object ------------------------------------------------------------------------
    def _echo(self) -> dict[str, Any]:
        """What every response object repeats of the request (buildResponseObject)."""
        b = self.req.body
        tools = [{"type": t.get("type") or "", "name": t.get("name") or "", "description": t.get("description"),
                  "strict": t.get("strict"), "parameters": t.get("parameters")} for t in self.req.tools]
        fmt: dict[str, Any] = {"type": "text"}
        given = (b.get("text") or {}).get("format")
        if given:
            fmt = {"type": given.get("type") or ""}
            fmt.update({k: given[k] for k in ("name", "schema", "strict") if given.get(k) not in (None, "")})
        reasoning = b.get("reasoning") or {}
        return {
            "tools": tools, "text": {"format": fmt},
            "reasoning": ({"effort": reasoning.get("effort") or None, "summary": reasoning.get("summary") or None}
                          if reasoning.get("effort") or reasoning.get("summary") else None),
            "truncation": b.get("truncation") if isinstance(b.get("truncation"), str) else "disabled",
            "top_p": _go_number(b["top_p"]) if b.get("top_p") is not None else 1,
            "temperature": _go_number(b["temperature"]) if b.get("temperature") is not None else 1,
        }

    def response(self, status: str, output: list[dict[str, Any]], o: Outcome | None) -> dict[str, Any]:
        """The response object in openai.ResponsesResponse's field order."""
        echo = self._echo()
        incomplete = status == "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": self.model, "previous_response_id": self.req.previous_response_id,
            "instructions": self.req.instructions or None, "output": output, "error": None,
            "tools": echo["tools"], "tool_choice": "auto", "truncation": echo["truncation"],
            "parallel_tool_calls": True, "text": echo["text"], "top_p": echo["top_p"],
            "presence_penalty": 0, "frequency_penalty": 0, "top_logprobs": 0, "temperature": echo["temperature"],
            "reasoning": echo["reasoning"], "usage": usage(o) if o is not None else None,
            "max_output_tokens": self.req.body.get("max_output_tokens"), "max_tool_calls": None,
            "store": self.req.store, "background": self.req.body.get("background") is True,
            "service_tier": "default", "metadata": {}, "safety_identifier": None, "prompt_cache_key": None,
        }

    def _status(self, o: Outcome) -> str:
        return "incomplete" if o.done_reason == "length" else "completed"

    def _keep(self, output: list[dict[str, Any]]) -> None:
        """File the conversation under this response's id, its output read back as input items."""
        if self.req.store:
            self.store.put(self.id, [*self.items, *(read_item(o) for o in output)])

    # -- the stream ---------------------------------------------------------------------------------
    def encode(self, chunk: dict[str, Any]) -> bytes:
        # Go marshals the event maps with their keys sorted.
        data = json.dumps(chunk, ensure_ascii=True, separators=(",", ":"), sort_keys=True)
        return f"event: {chunk['type']}\ndata: {data}\n\n".encode("ascii")

    def _event(self, kind: str, **data: Any) -> dict[str, Any]:
        data.update(type=kind, sequence_number=self.seq)
        self.seq += 1
        return data

    def _start(self) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        return [self._event("response.created", response=self.response("in_progress", [], None)),
                self._event("response.in_progress", response=self.response("in_progress", [], None))]

    def _thinking(self, thinking: str) -> list[dict[str, Any]]:
        out = []
        if not self.reasoning_id:
            self.reasoning_id = f"rs_{random.randrange(999999)}"
            out.append(self._event("response.output_item.added", output_index=self.output_index,
                                   item={"id": self.reasoning_id, "type": "reasoning", "summary": []}))
        self.thinking += thinking
        out.append(self._event("response.reasoning_summary_text.delta", item_id=self.reasoning_id,
                               output_index=self.output_index, summary_index=0, delta=thinking))
        return out

    def _finish_reasoning(self) -> list[dict[str, Any]]:
        if not self.reasoning_id:
            return []
        item = {"id": self.reasoning_id, "type": "reasoning",
                "summary": [{"type": "summary_text", "text": self.thinking}], "encrypted_content": self.thinking}
        self.completed.append(item)
        out = [self._event("response.reasoning_summary_text.done", item_id=self.reasoning_id,
                           output_index=self.output_index, summary_index=0, text=self.thinking),
               self._event("response.output_item.done", output_index=self.output_index, item=item)]
        self.thinking, self.reasoning_id = "", ""
        self.output_index += 1
        return out

    def _tool_calls(self, calls: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
        out = self._finish_reasoning()
        for i, c in enumerate(calls):
            index = self.output_index + i
            fc_id = f"fc_{random.randrange(999999)}_{i}"
            args = _arguments_json(c["function"]["arguments"])
            item = {"id": fc_id, "type": "function_call", "status": "completed", "call_id": c.get("id", ""),
                    "name": c["function"]["name"], "arguments": args}
            self.completed.append(item)
            out += [self._event("response.output_item.added", output_index=index,
                                item={**item, "status": "in_progress", "arguments": ""}),
                    self._event("response.function_call_arguments.delta", item_id=fc_id, output_index=index,
                                delta=args),
                    self._event("response.function_call_arguments.done", item_id=fc_id, output_index=index,
                                arguments=args),
                    self._event("response.output_item.done", output_index=index, item=item)]
        self.output_index += len(calls)
        self.tool_calls_sent = True
        return out

    def _text(self, text: str) -> list[dict[str, Any]]:
        out = self._finish_reasoning()
        if not self.content_started:
            self.content_started = True
            out += [self._event("response.output_item.added", output_index=self.output_index,
                                item={"id": self.item_id, "type": "message", "status": "in_progress",
                                      "role": "assistant", "content": []}),
                    self._event("response.content_part.added", item_id=self.item_id, output_index=self.output_index,
                                content_index=0, part=_text_part(""))]
        self.text += text
        out.append(self._event("response.output_text.delta", item_id=self.item_id, output_index=self.output_index,
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _process(self, content: str, thinking: str, calls: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
        """ResponsesStreamConverter.Process for one of Ollama's chat chunks."""
        out = self._start()
        if thinking:
            out += self._thinking(thinking)
        if calls:
            out += self._tool_calls(calls)
        elif not self.tool_calls_sent and content:
            out += self._text(content)
        return out

    def delta(self, d: Delta) -> list[dict[str, Any]]:
        # As Ollama's chat handler streams a Delta: text and thinking, then the tool calls on their own.
        out = []
        if d.content or d.thinking:
            out += self._process(d.content, d.thinking, ())
        if d.tool_calls:
            out += self._process("", "", d.tool_calls)
        return out

    def _output(self) -> list[dict[str, Any]]:
        return [*self.completed, *([_message_item(self.item_id, self.text)] if self.content_started else [])]

    def final(self, o: Outcome) -> list[dict[str, Any]]:
        out = self._start() + self._finish_reasoning()
        if not self.tool_calls_sent and self.content_started:
            part = _text_part(self.text)
            out += [self._event("response.output_text.done", item_id=self.item_id, output_index=self.output_index,
                                content_index=0, text=self.text, logprobs=[]),
                    self._event("response.content_part.done", item_id=self.item_id, output_index=self.output_index,
                                content_index=0, part=part),
                    self._event("response.output_item.done", output_index=self.output_index,
                                item=_message_item(self.item_id, self.text))]
        status = self._status(o)
        output = self._output()
        out.append(self._event(f"response.{status}", response=self.response(status, output, o)))
        self._keep(output)
        return out

    def end(self) -> bytes:
        return b""

    def error(self, message: str) -> dict[str, Any]:
        """A stream that failed after its first byte ends with `response.failed` (Ollama's shape for a
        failure inside a Responses stream, middleware/openai.go writeWebSearchError)."""
        failed = {"id": self.id, "object": "response", "status": "failed", "model": self.model, "output": [],
                  "error": {"code": "api_error", "message": message}}
        return self._event("response.failed", response=failed)

    # -- the whole answer -----------------------------------------------------------------------------
    def whole(self, parts: list[Delta], o: Outcome) -> web.Response:
        if self.req.stream:  # only a load (no input at all) gets here while streaming
            body = b"".join(self.encode(c) for c in self.final(o))
            return web.Response(body=body, content_type=SSE)
        d = joined(parts)
        output: list[dict[str, Any]] = []
        if d.thinking:
            output.append({"id": f"rs_{self.id}", "type": "reasoning",
                           "summary": [{"type": "summary_text", "text": d.thinking}], "encrypted_content": d.thinking})
        if d.tool_calls:
            output += [{"id": f"fc_{self.id}_{i}", "type": "function_call", "status": "completed",
                        "call_id": c.get("id", ""), "name": c["function"]["name"],
                        "arguments": _arguments_json(c["function"]["arguments"])} for i, c in enumerate(d.tool_calls)]
        else:
            output.append(_message_item(self.item_id, d.content))
        obj = self.response(self._status(o), output, o)
        if obj["reasoning"] is not None:  # ResponsesReasoningOutput: its fields are omitempty
            obj["reasoning"] = {k: v for k, v in obj["reasoning"].items() if v is not None}
        self._keep(output)
        return json_response(obj)


# -- the route ------------------------------------------------------------------------------------------
async def create(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    req = ResponsesRequest.read(body)
    if not req.model:
        raise ApiError(400, "model is required")
    entry = find_pair(request, req.model)
    store = request.app[STORE]
    earlier: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        got = store.get(req.previous_response_id)
        if got is None:
            return _previous_not_found(req.previous_response_id)
        earlier = got
    items = [*earlier, *req.own_items]
    # Images run on the upstream's copy of the target where it has one, as /api/chat's do; not with
    # a stored history, which the upstream does not have.
    if not earlier and any(p["type"] == "input_image" and p.get("image_url") for i in items
                           for p in (i.get("content") or i.get("parts") or [])):
        forwarded = await proxy.images_upstream(request, entry)
        if forwarded is not None:
            return forwarded
    messages = chat_messages(req.instructions, items, full_name(entry))
    prompt = Prompt.of_chat(messages, chat_tools(req.tools) or None, think=req.think())
    job = Job(prompt, req.options(), req.format(), load_only=not messages)
    return await respond(request, entry, job, ResponsesFraming(entry.name, req, items, store), req.stream)


def _previous_not_found(rid: str) -> web.Response:
    """OpenAI's answer to a previous_response_id it does not hold (never stored, evicted, `store:
    false`, or from before a restart), with the param and code clients match on."""
    body = {"error": {"message": f"Previous response with id '{rid}' not found.", "type": "not_found_error",
                      "param": "previous_response_id", "code": "previous_response_not_found"}}
    return json_response(body, status=404)


def setup(app: web.Application) -> None:
    """POST /v1/responses: pairs here, other models forwarded untouched (proxy.pair_or_forward)."""
    app[STORE] = ResponseStore()
    app.router.add_post("/v1/responses", proxy.pair_or_forward(create))
