"""Ollama's built-in output parsers: a model's raw output split into content, thinking and tool calls.

A model names its parser in its Modelfile (`PARSER qwen3`) or, for gpt-oss, gets "harmony" from
its template. `parser_for_name` gives a fresh parser for the names ported here and None for the
rest; `KNOWN_PARSER_NAMES` holds every name Ollama knows (model/parsers/parsers.go), so a caller can
tell a built-in parser that is not ported from a name that is no parser at all. Models without a
built-in parser get `TemplateParser` (generic), which has the same shape.
"""

from __future__ import annotations

from collections.abc import Callable

from sidecar.templates.parsers.base import (
    Message,
    Parser,
    ParserError,
    PassthroughParser,
    ThinkValue,
    Tool,
    ToolCall,
    think_enabled,
)
from sidecar.templates.parsers.generic import TemplateParser
from sidecar.templates.parsers.harmony import HarmonyMessageHandler
from sidecar.templates.parsers.qwen3 import Qwen3Parser
from sidecar.templates.parsers.thinking import ThinkingParser, thinking_parser_for

# Every name ParserForName accepts.
KNOWN_PARSER_NAMES = frozenset(
    {
        "qwen3",
        "qwen3-thinking",
        "qwen3.5",
        "ornith",
        "qwen3-coder",
        "qwen3-vl-instruct",
        "qwen3-vl-thinking",
        "ministral",
        "passthrough",
        "harmony",
        "cogito",
        "deepseek3",
        "olmo3",
        "olmo3-think",
        "nemotron-3-nano",
        "nemotron-3.5-nano",
        "functiongemma",
        "glm-4.7",
        "gemma4",
        "gemma4-no-thinking",
        "glm-ocr",
        "lfm2",
        "lfm2-thinking",
        "laguna",
        "poolside-v1",
        "cohere",
        "glimmer",
    }
)

_CONSTRUCTORS: dict[str, Callable[[], Parser]] = {
    "qwen3": lambda: Qwen3Parser(has_thinking_support=False, default_thinking=False),
    "qwen3-thinking": lambda: Qwen3Parser(has_thinking_support=True, default_thinking=True),
    "passthrough": PassthroughParser,
    "harmony": HarmonyMessageHandler,
}

IMPLEMENTED_PARSER_NAMES = frozenset(_CONSTRUCTORS)


def parser_for_name(name: str) -> Parser | None:
    """A new parser for `name`, or None when it is not ported here (see KNOWN_PARSER_NAMES)."""
    constructor = _CONSTRUCTORS.get(name)
    return constructor() if constructor else None


__all__ = [
    "IMPLEMENTED_PARSER_NAMES",
    "KNOWN_PARSER_NAMES",
    "HarmonyMessageHandler",
    "Message",
    "Parser",
    "ParserError",
    "PassthroughParser",
    "Qwen3Parser",
    "TemplateParser",
    "ThinkValue",
    "ThinkingParser",
    "Tool",
    "ToolCall",
    "parser_for_name",
    "think_enabled",
    "thinking_parser_for",
]
