"""Ollama's generic thinking parser (thinking/parser.go), for models without a built-in parser.

The template says which tags wrap the model's thoughts (`<think>` / `</think>` mostly). Output that
starts, after optional whitespace, with the opening tag is thinking until the closing tag; output
that starts with anything else has no thinking at all, and a tag appearing later is just content.
Whitespace right after either tag is dropped. While streaming, text that may be the start of the
tag it is waiting for is held back until the next piece settles it.

There is no flush: whatever is held back when the stream ends (a partial closing tag, or output
that so far is only whitespace or a prefix of the opening tag) is dropped, as in Ollama.
"""

from __future__ import annotations

from enum import Enum

from sidecar.templates.parsers import _text
from sidecar.templates.parsers.base import ThinkValue, think_enabled


class ThinkingState(Enum):
    """Where the parser is; the values are Ollama's names for the states."""

    # No non-whitespace seen yet: the opening tag may still come.
    LOOKING_FOR_OPENING = "LookingForOpening"
    # Opening tag seen, eating the whitespace before the thoughts.
    THINKING_STARTED_EATING_WHITESPACE = "ThinkingStartedEatingWhitespace"
    THINKING = "Thinking"
    # Closing tag seen, eating the whitespace before the content.
    THINKING_DONE_EATING_WHITESPACE = "ThinkingDoneEatingWhitespace"
    THINKING_DONE = "ThinkingDone"


class ThinkingParser:
    """Splits streamed output into (thinking, content) around `opening_tag` ... `closing_tag`."""

    def __init__(self, opening_tag: str, closing_tag: str) -> None:
        self.opening_tag = opening_tag
        self.closing_tag = closing_tag
        self.state = ThinkingState.LOOKING_FOR_OPENING
        self._acc = ""

    def add(self, text: str) -> tuple[str, str]:
        """(thinking, content) that `text` made final; the rest waits for more output."""
        self._acc += text
        thinking: list[str] = []
        content: list[str] = []
        # One piece can pass through several states; keep going so nothing already
        # unambiguous waits for the next piece.
        more = True
        while more:
            t, c, more = self._eat()
            thinking.append(t)
            content.append(c)
        return "".join(thinking), "".join(content)

    def _eat(self) -> tuple[str, str, bool]:
        """One step: (thinking, content, whether another step can make progress)."""
        acc = self._acc
        match self.state:
            case ThinkingState.LOOKING_FOR_OPENING:
                trimmed = _text.lstrip(acc)
                if trimmed.startswith(self.opening_tag):
                    # what follows may hold more than thinking, so it is parsed again, not returned
                    self._acc = _text.lstrip(trimmed[len(self.opening_tag):])
                    self.state = (
                        ThinkingState.THINKING if self._acc else ThinkingState.THINKING_STARTED_EATING_WHITESPACE
                    )
                    return "", "", True
                if self.opening_tag.startswith(trimmed):
                    return "", "", False  # a partial opening tag, or only whitespace so far
                # thinking was skipped; the content keeps its leading whitespace
                self.state = ThinkingState.THINKING_DONE
                self._acc = ""
                return "", acc, False
            case ThinkingState.THINKING_STARTED_EATING_WHITESPACE:
                self._acc = _text.lstrip(acc)
                if not self._acc:
                    return "", "", False
                self.state = ThinkingState.THINKING
                return "", "", True
            case ThinkingState.THINKING:
                thinking, found, rest = acc.partition(self.closing_tag)
                if found:
                    rest = _text.lstrip(rest)
                    self._acc = ""
                    self.state = (
                        ThinkingState.THINKING_DONE if rest else ThinkingState.THINKING_DONE_EATING_WHITESPACE
                    )
                    return thinking, rest, False
                held = _text.overlap(acc, self.closing_tag)
                self._acc = acc[len(acc) - held:]
                return acc[: len(acc) - held], "", False
            case ThinkingState.THINKING_DONE_EATING_WHITESPACE:
                self._acc = ""
                content = _text.lstrip(acc)
                if content:
                    self.state = ThinkingState.THINKING_DONE
                return "", content, False
            case ThinkingState.THINKING_DONE:
                self._acc = ""
                return "", acc, False


def thinking_parser_for(prompt: str, opening_tag: str, closing_tag: str, think: ThinkValue) -> ThinkingParser | None:
    """The parser ChatHandler and GenerateHandler set up, or None when they set up none.

    Ollama uses one only when thinking is requested and the template has both tags. When the
    rendered prompt already ends with the opening tag (templates that open the thinking section
    for the model), the model's output starts inside it, so the tag is fed to the parser first.
    """
    if not think_enabled(think) or not opening_tag or not closing_tag:
        return None
    parser = ThinkingParser(opening_tag, closing_tag)
    if _text.strip(prompt).endswith(opening_tag):
        parser.add(opening_tag)
    return parser
