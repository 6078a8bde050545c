"""Ollama's response schemas, transcribed from its docs/openapi.yaml (ollama/ollama fb30760).

Only the schemas the daemon's answers must satisfy: GenerateResponse / GenerateStreamEvent,
ChatResponse / ChatStreamEvent, Logprob and TokenLogprob, ToolCall, ErrorResponse. Ollama's
schemas leave additional properties open (the daemon adds its speculation counters); the test
helpers here add what the Go structs imply but the YAML leaves implicit: the fields every chunk
carries (`model`, `created_at`, `done`, and chat's `message.role`).
"""

from __future__ import annotations

from typing import Any

import jsonschema

TOKEN_LOGPROB = {
    "type": "object",
    "required": ["token", "logprob"],
    "properties": {
        "token": {"type": "string"},
        "logprob": {"type": "number"},
        "bytes": {"type": "array", "items": {"type": "integer"}},
    },
}
LOGPROB = {
    "type": "object",
    "required": ["token", "logprob"],
    "properties": {
        **TOKEN_LOGPROB["properties"],
        "top_logprobs": {"type": "array", "items": TOKEN_LOGPROB},
    },
}
TOOL_CALL = {
    "type": "object",
    "properties": {
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                           "arguments": {"type": "object"}},
        },
    },
}
_METRICS = {k: {"type": "integer"} for k in ("total_duration", "load_duration", "prompt_eval_count",
                                               "prompt_eval_duration", "eval_count", "eval_duration")}
GENERATE_RESPONSE = {
    "type": "object",
    "required": ["model", "created_at", "response", "done"],
    "properties": {
        "model": {"type": "string"}, "created_at": {"type": "string"}, "response": {"type": "string"},
        "thinking": {"type": "string"}, "done": {"type": "boolean"}, "done_reason": {"type": "string"},
        **_METRICS, "logprobs": {"type": "array", "items": LOGPROB},
        "context": {"type": "array", "items": {"type": "integer"}},
    },
}
CHAT_RESPONSE = {
    "type": "object",
    "required": ["model", "created_at", "message", "done"],
    "properties": {
        "model": {"type": "string"}, "created_at": {"type": "string"},
        "message": {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"type": "string", "enum": ["assistant"]}, "content": {"type": "string"},
                "thinking": {"type": "string"}, "tool_calls": {"type": "array", "items": TOOL_CALL},
                "images": {"type": "array", "items": {"type": "string"}},
            },
        },
        "done": {"type": "boolean"}, "done_reason": {"type": "string"},
        **_METRICS, "logprobs": {"type": "array", "items": LOGPROB},
    },
}
ERROR_RESPONSE = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}


def check(schema: dict[str, Any], obj: Any) -> None:
    jsonschema.validate(obj, schema)
