"""Anthropic's Messages API for pairs (/v1/messages), as Ollama translates it onto its chat handler.

Claude Code and the Anthropic SDKs speak this API; Ollama serves it by turning the request into
the `api.ChatRequest` that /api/chat decodes (anthropic/anthropic.go FromMessagesRequest, run by
middleware/anthropic.go AnthropicMessagesMiddleware in front of ChatHandler, server/routes.go),
and the chat handler's chunks back into Anthropic's message object or SSE events
(anthropic.ToMessagesResponse, StreamConverter.Process). Here the request becomes the same Job
/api/chat makes (api.anthropic_request decodes and converts it), the one responder (api.respond)
runs it, and `AnthropicFraming` writes it.

Where this differs from Ollama, on purpose:
- usage also carries `cache_read_input_tokens`, the prompt tokens the prefix cache supplied, so
  `input_tokens + cache_read_input_tokens` is the whole prompt an agent's context meter wants
  (Ollama reports only the evaluated tokens, which a warm prefix makes 1);
- `/v1/messages/count_tokens` counts with the pair's own tokenizer and template (Ollama has no
  such route; its len/4 estimate, EstimateInputTokens, only fills message_start);
- a message whose blocks are all unknown leaves no message at all: Ollama would then answer a
  model load, here that is the client's 400;
- a failure after the first byte ends the stream with Anthropic's `error` event (Ollama's type
  StreamErrorEvent; its writer drops the chunk), so the SDKs raise instead of seeing a cut stream.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from aiohttp import web

from sidecar.api import proxy
from sidecar.api.anthropic_request import Request, estimate, options
from sidecar.api.pairs import find_pair, runtime_of
from sidecar.api.respond import joined, respond
from sidecar.api.wire import ApiError, dumps, read_body
from sidecar.config.entries import PairEntry
from sidecar.runtime.contract import Delta, Job, Outcome
from sidecar.runtime.render import full_name

SSE = "text/event-stream"


def message_id(prefix: str = "msg") -> str:
    """anthropic.generateID: the prefix and 12 random bytes in hex."""
    return f"{prefix}_{secrets.token_hex(12)}"

# -- answers ---------------------------------------------------------------------------------------
def stop_reason(done_reason: str, called: bool) -> str:
    """anthropic.mapStopReason."""
    if called:
        return "tool_use"
    if done_reason == "stop":
        return "end_turn"
    if done_reason == "length":
        return "max_tokens"
    return "stop_sequence" if done_reason else ""


def usage(o: Outcome) -> dict[str, int]:
    """Ollama's counts (the prompt tokens evaluated, the tokens generated), and the cached prompt
    tokens in Anthropic's field for them: input_tokens + cache_read_input_tokens is the whole prompt."""
    return {"input_tokens": o.prompt_tokens, "output_tokens": o.eval_count, "cache_read_input_tokens": o.prompt_cached}


def _arguments(args: Any) -> str:
    return json.dumps(args, separators=(",", ":"), ensure_ascii=False)


class AnthropicFraming:
    """Anthropic's message object, or its SSE events as Ollama's StreamConverter writes them: a
    thinking block, then a text block, each tool call as a block of its own with the whole input
    in one input_json_delta, then message_delta (stop reason, usage) and message_stop."""

    content_type = SSE

    def __init__(self, entry: PairEntry, estimated_input: int) -> None:
        self.id = message_id()
        self.model = entry.name
        self.estimated_input = estimated_input  # message_start's input_tokens when no count is known yet
        self.started = False
        self.index = 0
        self.thinking_started = self.thinking_done = self.text_started = False
        self.called = False

    def encode(self, chunk: dict[str, Any]) -> bytes:
        return f"event: {chunk['type']}\ndata: {dumps(chunk)}\n\n".encode("ascii")

    def _start(self, prompt_tokens: int) -> list[dict[str, Any]]:
        """message_start, before the first block: Ollama's count if the chunk had one, else its estimate."""
        if self.started:
            return []
        self.started = True
        return [{"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "usage": {"input_tokens": prompt_tokens or self.estimated_input, "output_tokens": 0}}}]

    def waiting(self) -> list[dict[str, Any]]:
        """While the first token is a long time coming (a long prompt's prefill on a CPU; respond's
        KEEPALIVE): message_start with the estimate, then a `ping` each time, as Anthropic's API
        keeps a stream alive. Beyond Ollama, which writes nothing until its first chunk."""
        return [*self._start(0), {"type": "ping"}]

    def _stop_block(self) -> dict[str, Any]:
        return {"type": "content_block_stop", "index": self.index}

    def delta(self, d: Delta) -> list[dict[str, Any]]:
        out = self._start(0)
        if d.thinking and not self.thinking_done:
            if self.text_started:
                out.append(self._stop_block())
                self.index += 1
                self.text_started = False
            if not self.thinking_started:
                self.thinking_started = True
                out.append({"type": "content_block_start", "index": self.index,
                            "content_block": {"type": "thinking", "thinking": ""}})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": d.thinking}})
        if d.content:
            if self.thinking_started and not self.thinking_done:
                self.thinking_done = True
                out.append(self._stop_block())
                self.index += 1
            if not self.text_started:
                self.text_started = True
                out.append({"type": "content_block_start", "index": self.index,
                            "content_block": {"type": "text", "text": ""}})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "text_delta", "text": d.content}})
        for call in d.tool_calls:
            if self.thinking_started and not self.thinking_done:
                self.thinking_done = True
                out.append(self._stop_block())
                self.index += 1
            if self.text_started:
                out.append(self._stop_block())
                self.index += 1
                self.text_started = False
            fn = call["function"]
            out += [{"type": "content_block_start", "index": self.index,
                     "content_block": {"type": "tool_use", "id": call.get("id", ""), "name": fn["name"], "input": {}}},
                    {"type": "content_block_delta", "index": self.index,
                     "delta": {"type": "input_json_delta", "partial_json": _arguments(fn["arguments"])}},
                    self._stop_block()]
            self.called = True
            self.index += 1
        return out

    def final(self, o: Outcome) -> list[dict[str, Any]]:
        out = self._start(o.prompt_tokens)
        if self.text_started or (self.thinking_started and not self.thinking_done):
            out.append(self._stop_block())
        delta = {"stop_reason": reason} if (reason := stop_reason(o.done_reason, self.called)) else {}
        return [*out, {"type": "message_delta", "delta": delta, "usage": usage(o)}, {"type": "message_stop"}]

    def end(self) -> bytes:
        return b""

    def error(self, message: str) -> dict[str, Any]:
        return {"type": "error", "error": {"type": "api_error", "message": message}}

    def whole(self, parts: list[Delta], o: Outcome) -> web.Response:
        d = joined(parts)
        content: list[dict[str, Any]] = []
        if d.thinking:
            content.append({"type": "thinking", "thinking": d.thinking})
        if d.content:
            content.append({"type": "text", "text": d.content})
        for call in d.tool_calls:
            content.append({"type": "tool_use", "id": call.get("id", ""), "name": call["function"]["name"],
                            "input": call["function"]["arguments"]})
        out: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                               "content": content}
        if reason := stop_reason(o.done_reason, bool(d.tool_calls)):
            out["stop_reason"] = reason
        out["usage"] = usage(o)
        # json.NewEncoder's trailing newline, as Ollama's writer encodes it
        return web.Response(text=dumps(out) + "\n", content_type="application/json")


# -- routes ----------------------------------------------------------------------------------------
async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages: the request converted (or refused) as Ollama's middleware does, then the chat."""
    body = await read_body(request)
    req = Request(body)
    entry = find_pair(request, req.model)
    if req.images:  # base64 that decodes: the upstream runs them, if it has the pair's target
        forwarded = await proxy.images_upstream(request, entry)
        if forwarded is not None:
            return forwarded
        raise ApiError(400, f"{full_name(entry)} does not support vision")
    job = Job(req.prompt(request, entry), options(body))
    return await respond(request, entry, job, AnthropicFraming(entry, estimate(body)), bool(body.get("stream")))


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt the same request to /v1/messages would render,
    counted with the pair's tokenizer, whole (before any cut to fit the context window)."""
    req = Request(await read_body(request), messages_api=False)
    entry = find_pair(request, req.model)
    if req.images:
        raise ApiError(400, f"{full_name(entry)} does not support vision")
    count = await runtime_of(request).count_tokens(entry, Job(req.prompt(request, entry), truncate=False))
    return web.Response(text=dumps({"input_tokens": count}), content_type="application/json")


def setup(app: web.Application) -> None:
    """The Messages routes: pairs here, other models forwarded (proxy.pair_or_forward)."""
    app.router.add_post("/v1/messages", proxy.pair_or_forward(messages))
    app.router.add_post("/v1/messages/count_tokens", proxy.pair_or_forward(count_tokens))
