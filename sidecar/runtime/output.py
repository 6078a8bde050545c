"""A request's raw output split as Ollama splits it: thinking, content and tool calls.

Which parser runs is Ollama's choice (server/routes.go ChatHandler / GenerateHandler): a model
whose manifest names a built-in parser (qwen3, harmony for gpt-oss) gets it, and it handles
thinking and tool calls itself. Otherwise the generic tag parser takes the thinking out when
thinking is on and the template has tags (pre-fed the opening tag when the prompt already ends
with it), and the template-keyed tool-call parser looks for calls when the request offers tools.

`end_of_thinking` is the text after which an answer begins: a `format` is held back until then,
so a thinking model with a schema still thinks (Ollama restarts the request with the constraint
at that point; the engine applies it from that token on instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sidecar.config.entries import PairEntry
from sidecar.runtime import render
from sidecar.runtime.contract import Prompt
from sidecar.templates.parsers import Parser, ThinkingParser, parser_for_name, thinking_parser_for
from sidecar.templates.tools import ToolCallParser

# Where a built-in parser's answer starts (qwen3: after the thinking block; harmony: the final channel).
_ANSWER_STARTS = {"qwen3": "</think>", "qwen3-thinking": "</think>", "harmony": "<|channel|>final<|message|>"}


@dataclass
class OutputParser:
    builtin: Parser | None = None
    builtin_name: str | None = None
    thinking: ThinkingParser | None = None
    tools: ToolCallParser | None = None
    closing_tag: str | None = None  # the generic thinking parser's
    rendered_tools: list[dict[str, Any]] | None = field(default=None)

    @classmethod
    def start(cls, entry: PairEntry, prompt: Prompt) -> OutputParser:
        """The parsers for a request, before its prompt is rendered: a built-in parser decides how
        the tools are rendered (harmony renames them), see `rendered_tools`."""
        tools = list(prompt.tools) if prompt.tools else None
        name = render.parser_name(entry) if not prompt.raw else None
        builtin = parser_for_name(name) if name else None
        if builtin is None:
            return cls(rendered_tools=tools)
        think = "high" if name == "harmony" and prompt.think == "max" else prompt.think
        last = dict(prompt.messages[-1]) if prompt.chat and prompt.messages else None
        rendered = builtin.init(tools if prompt.chat else None, last, think)
        return cls(builtin, name, rendered_tools=rendered or None)

    def after_render(self, entry: PairEntry, prompt: Prompt, text: str) -> None:
        """The generic parsers, which need the rendered prompt (it may already open the thinking)."""
        if self.builtin is not None or prompt.raw:
            return
        tags = render.thinking_tags(entry)
        if tags is not None:
            self.thinking = thinking_parser_for(text, tags[0], tags[1], prompt.think)
            self.closing_tag = tags[1] if self.thinking is not None else None
        if prompt.tools:
            self.tools = ToolCallParser(render.template_source(entry).text, list(prompt.tools))

    @property
    def parses(self) -> bool:
        return self.builtin is not None or self.thinking is not None or self.tools is not None

    def end_of_thinking(self, prompt: Prompt) -> str | None:
        """Where the answer starts, when a format must wait for it (routes.go structuredOutputsState)."""
        if self.builtin is not None:
            if self.builtin.has_thinking_support() and prompt.think is not None and not prompt.thinks:
                return None  # thinking switched off: constrain from the first token
            return _ANSWER_STARTS.get(self.builtin_name or "")
        return self.closing_tag

    def preserved_tokens(self) -> list[str]:
        """Control tokens the parser must see as text (harmony's <|channel|> and friends)."""
        return self.builtin.preserved_tokens() if self.builtin is not None else []

    def feed(self, text: str, done: bool = False) -> tuple[str, str, list[dict[str, Any]]]:
        """(content, thinking, tool calls) final after this text; `done` at the end releases the rest."""
        if self.builtin is not None:
            return self.builtin.add(text, done)
        thinking = ""
        if self.thinking is not None:
            thinking, text = self.thinking.add(text)
        if self.tools is None:
            return text, thinking, []
        content, calls = self.tools.feed(text)
        if done:
            rest, more = self.tools.flush()
            content, calls = content + rest, calls + more
        return content, thinking, calls
