"""A request's raw output split as Ollama splits it: thinking, content and tool calls.

Which parser runs is Ollama's choice (server/routes.go ChatHandler / GenerateHandler), made once
per pair (runtime.format): a model whose manifest names a built-in parser (qwen3, harmony for
gpt-oss) gets it, and it handles thinking and tool calls itself; otherwise the generic parser takes
the thinking out when thinking is on and the template has tags, and looks for the template's tool
calls when the request offers tools. Every parser has one shape, so there is one path here.

`end_of_thinking` is the text after which an answer begins: a `format` is held back until then,
so a thinking model with a schema still thinks (Ollama restarts the request with the constraint
at that point; the engine applies it from that token on instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sidecar.runtime.contract import Delta, Logprob, Prompt
from sidecar.runtime.format import PairFormat
from sidecar.templates.parsers import Parser, TemplateParser

# Where a built-in parser's answer starts (qwen3: after the thinking block; harmony: the final channel).
_ANSWER_STARTS = {"qwen3": "</think>", "qwen3-thinking": "</think>", "harmony": "<|channel|>final<|message|>"}


@dataclass
class OutputParser:
    parser: Parser
    rendered_tools: list[dict[str, Any]] | None  # the tools as the prompt shows them (harmony renames them)
    answer_start: str | None  # a built-in parser's; the generic one knows its own once it has seen the prompt

    @classmethod
    def start(cls, fmt: PairFormat, prompt: Prompt) -> OutputParser:
        """The request's parser, before its prompt is rendered: it decides how the tools are rendered."""
        parser = fmt.new_parser(prompt.raw)
        tools = list(prompt.tools) if prompt.tools else None
        think = "high" if fmt.parser == "harmony" and prompt.think == "max" else prompt.think
        last = dict(prompt.messages[-1]) if prompt.chat and prompt.messages else None
        rendered = parser.init(tools if prompt.chat else None, last, think)
        # A built-in parser's answer starts at its marker, unless thinking was switched off: then
        # from the first token (and a raw prompt is parsed by no built-in parser at all).
        off = parser.has_thinking_support() and prompt.think is not None and not prompt.thinks
        answer = None if prompt.raw or off else _ANSWER_STARTS.get(fmt.parser or "")
        return cls(parser, rendered or None, answer)

    def begin(self, prompt: str) -> None:
        """The rendered prompt: the generic parser checks whether it already opens the thinking."""
        self.parser.begin(prompt)

    def preserved_tokens(self) -> list[str]:
        """Control tokens the parser must see as text (harmony's <|channel|> and friends)."""
        return self.parser.preserved_tokens()

    def end_of_thinking(self) -> str | None:
        """Where the answer starts, when a format must wait for it (routes.go structuredOutputsState)."""
        return self.parser.closing_tag if isinstance(self.parser, TemplateParser) else self.answer_start

    def delta(self, text: str, done: bool, logprobs: list[Logprob]) -> Delta | None:
        """What `text` made final, with the logprobs of the tokens it came from; `done` releases the rest."""
        content, thinking, calls = self.parser.add(text, done)
        if not (content or thinking or calls or logprobs):
            return None
        return Delta(content, tuple(calls), thinking, tuple(logprobs))
