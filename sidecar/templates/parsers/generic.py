"""The parser Ollama uses for a model without a built-in one (server/routes.go), in the built-ins' shape.

Two parsers keyed off the pair's template work in turn: the generic thinking parser (`thinking`),
when thinking is on and the template has tags, takes the thoughts out; the template-keyed tool-call
parser (templates.tools), when the request offers tools, finds the calls in what is left. Wrapped
as one `Parser`, callers treat it like qwen3 or harmony: init, begin, add.
"""

from __future__ import annotations

from sidecar.templates.parsers.base import Message, ThinkValue, Tool, ToolCall
from sidecar.templates.parsers.thinking import ThinkingParser, thinking_parser_for
from sidecar.templates.tools import ToolCallParser


class TemplateParser:
    def __init__(self, thinking_tags: tuple[str, str] | None, template_source: str) -> None:
        self._tags = thinking_tags
        self._template = template_source
        self._think: ThinkValue = None
        self._thinking: ThinkingParser | None = None
        self._calls: ToolCallParser | None = None

    def init(self, tools: list[Tool] | None, last_message: Message | None, think: ThinkValue) -> list[Tool] | None:
        self._think = think
        self._calls = ToolCallParser(self._template, list(tools)) if tools else None
        return tools

    def begin(self, prompt: str) -> None:
        """Set up the thinking parser, pre-fed the opening tag when the prompt already ends with it."""
        if self._tags is not None:
            self._thinking = thinking_parser_for(prompt, self._tags[0], self._tags[1], self._think)

    @property
    def closing_tag(self) -> str | None:
        """The tag that ends the thinking, while thinking is being parsed (else None)."""
        return self._thinking.closing_tag if self._thinking is not None else None

    def add(self, text: str, done: bool) -> tuple[str, str, list[ToolCall]]:
        thinking = ""
        if self._thinking is not None:
            thinking, text = self._thinking.add(text)
        if self._calls is None:
            return text, thinking, []
        content, calls = self._calls.feed(text)
        if done:
            rest, more = self._calls.flush()
            content, calls = content + rest, calls + more
        return content, thinking, calls

    def preserved_tokens(self) -> list[str]:
        return []

    # The pair's capabilities come from its template (runtime.format), not from this parser.
    def has_tool_support(self) -> bool:
        return False

    def has_thinking_support(self) -> bool:
        return False
