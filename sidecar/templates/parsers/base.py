"""The shape every built-in output parser has: Ollama's `parsers.Parser` (model/parsers/parsers.go).

A parser is made fresh for each request, initialised once with the request's tools, the last
message of the conversation (so a prefilled assistant turn continues in the right section) and the
request's `think` value, shown the rendered prompt (`begin`), then fed the model's output piece by
piece. Each `add` returns only what became final with that piece; text that could still turn out to
be a tag stays inside the parser. The generic parser for models without a built-in one (`generic`)
has this shape too, so a caller has one path for all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from sidecar.templates.tools import call_id

# Ollama's api.ThinkValue: unset, a switch, or a level ("low" / "medium" / "high"; "max" too,
# which callers turn into "high" for harmony as routes.go does).
ThinkValue = bool | str | None
Tool = dict[str, Any]
ToolCall = dict[str, Any]
Message = Mapping[str, Any]


class ParserError(ValueError):
    """The model's output cannot be parsed (a malformed tool call); Ollama ends the request with it."""


class Parser(Protocol):
    def init(self, tools: list[Tool] | None, last_message: Message | None, think: ThinkValue) -> list[Tool] | None:
        """Prepare for one request; returns the tools as the prompt should show them (harmony renames them)."""
        ...

    def begin(self, prompt: str) -> None:
        """The rendered prompt the output continues (a template may already open the thinking section)."""
        ...

    def add(self, text: str, done: bool) -> tuple[str, str, list[ToolCall]]:
        """(content, thinking, tool calls) made final by `text`; `done` marks the last piece of output.

        Raises ParserError for output that cannot be parsed.
        """
        ...

    def preserved_tokens(self) -> list[str]:
        """Special tokens that must be rendered as text when detokenizing, or the parser cannot see its tags."""
        ...

    def has_tool_support(self) -> bool: ...

    def has_thinking_support(self) -> bool: ...


def think_enabled(think: ThinkValue) -> bool:
    """api.ThinkValue.Bool: thinking is on for True or any level."""
    if isinstance(think, bool):
        return think
    return think in ("high", "medium", "low", "max")


def new_tool_call(name: str, arguments: dict[str, Any], index: int) -> ToolCall:
    """A call in Ollama's API shape.

    Ollama's parsers leave the id empty and ChatHandler fills it in (routes.go, toolCallId); it is set
    here so callers get finished calls. GenerateHandler never sets one: a caller serving
    /api/generate should drop it.
    """
    return {"id": call_id(), "function": {"index": index, "name": name, "arguments": arguments}}


class PassthroughParser:
    """The "passthrough" parser: all output is content."""

    def init(self, tools: list[Tool] | None, last_message: Message | None, think: ThinkValue) -> list[Tool] | None:
        return tools

    def begin(self, prompt: str) -> None:
        pass

    def add(self, text: str, done: bool) -> tuple[str, str, list[ToolCall]]:
        return text, "", []

    def preserved_tokens(self) -> list[str]:
        return []

    def has_tool_support(self) -> bool:
        return False

    def has_thinking_support(self) -> bool:
        return False
