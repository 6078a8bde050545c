"""Ollama's Qwen3 parser (model/parsers/qwen3.go): thinking, then content with `<tool_call>` JSON calls.

With thinking on, Qwen3's prompt already ends with `<think>`, so the output starts with the
thoughts themselves; some checkpoints repeat the `<think>` anyway and one such leading tag is
dropped. A `<tool_call>` before `</think>` also ends the thinking. Each call is a JSON object with
`name` and `arguments` between `<tool_call>` and `</tool_call>`.

Text that may be the start of a tag is held back, and so is trailing whitespace (it is dropped
where it runs into a tag). `done` changes nothing, as in Ollama: at the end of the stream held
text, including trailing whitespace and an unclosed tool call, is dropped.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

from sidecar.templates.parsers import _text
from sidecar.templates.parsers.base import (
    Message,
    ParserError,
    ThinkValue,
    Tool,
    ToolCall,
    new_tool_call,
    think_enabled,
)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


class _State(Enum):
    LOOKING_FOR_THINKING_OPEN = auto()
    THINKING_STARTED_EATING_WHITESPACE = auto()
    COLLECTING_THINKING = auto()
    THINKING_DONE_EATING_WHITESPACE = auto()
    COLLECTING_CONTENT = auto()
    TOOL_STARTED_EATING_WHITESPACE = auto()
    COLLECTING_TOOL_CONTENT = auto()


class _Kind(Enum):
    CONTENT = auto()
    THINKING = auto()
    TOOL_CALL = auto()


_Event = tuple[_Kind, str]


class Qwen3Parser:
    """The "qwen3" parser (no thinking) and, with thinking support, "qwen3-thinking"."""

    def __init__(self, has_thinking_support: bool, default_thinking: bool) -> None:
        self._has_thinking_support = has_thinking_support
        # what an unset `think` means
        self._default_thinking = default_thinking
        # Go's zero state, for a parser fed without init: thinking only if the output opens it
        self._state = _State.LOOKING_FOR_THINKING_OPEN
        self._buffer = ""
        self._call_index = 0
        self._maybe_thinking_open_at_bol = False

    def has_tool_support(self) -> bool:
        return True

    def has_thinking_support(self) -> bool:
        return self._has_thinking_support

    def preserved_tokens(self) -> list[str]:
        return [THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE]

    def init(self, tools: list[Tool] | None, last_message: Message | None, think: ThinkValue) -> list[Tool] | None:
        self._buffer = ""
        self._call_index = 0
        thinking = self._default_thinking if think is None else think_enabled(think)
        if self._has_thinking_support and thinking:
            self._state = _State.COLLECTING_THINKING
            self._maybe_thinking_open_at_bol = True
        else:
            self._state = _State.COLLECTING_CONTENT
            self._maybe_thinking_open_at_bol = False
        return tools

    def begin(self, prompt: str) -> None:
        """Nothing to learn from the prompt: init already knows whether it opened the thinking."""

    def add(self, text: str, done: bool) -> tuple[str, str, list[ToolCall]]:
        self._buffer += text
        content: list[str] = []
        thinking: list[str] = []
        calls: list[ToolCall] = []
        for kind, value in self._parse_events():
            if kind is _Kind.TOOL_CALL:
                name, arguments = _parse_tool_call(value)
                calls.append(new_tool_call(name, arguments, self._call_index))
                self._call_index += 1
            elif kind is _Kind.THINKING:
                thinking.append(value)
            else:
                content.append(value)
        return "".join(content), "".join(thinking), calls

    def _parse_events(self) -> list[_Event]:
        events: list[_Event] = []
        more = True
        while more:
            new, more = self._eat()
            events.extend(new)
        return events

    def _eat_leading_whitespace_then(self, next_state: _State) -> tuple[list[_Event], bool]:
        self._buffer = _text.lstrip(self._buffer)
        if not self._buffer:
            return [], False
        self._state = next_state
        return [], True

    def _split_at(self, tag: str) -> tuple[str, str]:
        before, after = _text.split_at_tag(self._buffer, tag, trim_after=True)
        self._buffer = after
        return before, after

    def _emit_unambiguous(self, kind: _Kind, *tags: str) -> tuple[list[_Event], bool]:
        """Emit the buffer up to a possible partial tag and the whitespace before it (or before the end).

        The held whitespace is dropped if a tag follows it, so it cannot be released yet.
        """
        acc = self._buffer
        held = max(_text.overlap(acc, tag) for tag in tags)
        before_partial = acc[: len(acc) - held]
        start = len(before_partial) - _text.trailing_space_len(before_partial)
        self._buffer = acc[start:]
        return ([(kind, acc[:start])] if start else []), False

    def _eat(self) -> tuple[list[_Event], bool]:
        """One step: (events, whether another step can make progress)."""
        acc = self._buffer
        match self._state:
            case _State.LOOKING_FOR_THINKING_OPEN:
                trimmed = _text.lstrip(acc)
                if trimmed.startswith(THINK_OPEN):
                    self._buffer = _text.lstrip(trimmed[len(THINK_OPEN):])
                    self._state = (
                        _State.COLLECTING_THINKING if self._buffer else _State.THINKING_STARTED_EATING_WHITESPACE
                    )
                    return [], True
                if THINK_OPEN.startswith(trimmed):
                    return [], False
                self._state = _State.COLLECTING_CONTENT
                return [], True

            case _State.THINKING_STARTED_EATING_WHITESPACE:
                return self._eat_leading_whitespace_then(_State.COLLECTING_THINKING)

            case _State.COLLECTING_THINKING:
                if self._maybe_thinking_open_at_bol:
                    trimmed = _text.lstrip(acc)
                    if trimmed.startswith(THINK_OPEN):
                        self._buffer = _text.lstrip(trimmed[len(THINK_OPEN):])
                        if not self._buffer:
                            return [], False  # still at the start: whitespace may precede the thoughts
                        self._maybe_thinking_open_at_bol = False
                        return [], True
                    if THINK_OPEN.startswith(trimmed):
                        return [], False
                    self._maybe_thinking_open_at_bol = False

                close_at = acc.find(THINK_CLOSE)
                tool_at = acc.find(TOOL_OPEN)
                if tool_at != -1 and (close_at == -1 or tool_at < close_at):
                    # a call before </think> ends the thinking
                    before, after = self._split_at(TOOL_OPEN)
                    self._state = (
                        _State.COLLECTING_TOOL_CONTENT if after else _State.TOOL_STARTED_EATING_WHITESPACE
                    )
                    return ([(_Kind.THINKING, before)] if before else []), True
                if close_at != -1:
                    thinking, rest = self._split_at(THINK_CLOSE)
                    self._state = _State.COLLECTING_CONTENT if rest else _State.THINKING_DONE_EATING_WHITESPACE
                    return ([(_Kind.THINKING, thinking)] if thinking else []), True
                return self._emit_unambiguous(_Kind.THINKING, THINK_CLOSE, TOOL_OPEN)

            case _State.THINKING_DONE_EATING_WHITESPACE:
                return self._eat_leading_whitespace_then(_State.COLLECTING_CONTENT)

            case _State.COLLECTING_CONTENT:
                if TOOL_OPEN in acc:
                    before, after = self._split_at(TOOL_OPEN)
                    self._state = (
                        _State.COLLECTING_TOOL_CONTENT if after else _State.TOOL_STARTED_EATING_WHITESPACE
                    )
                    return ([(_Kind.CONTENT, before)] if before else []), True
                return self._emit_unambiguous(_Kind.CONTENT, TOOL_OPEN)

            case _State.TOOL_STARTED_EATING_WHITESPACE:
                return self._eat_leading_whitespace_then(_State.COLLECTING_TOOL_CONTENT)

            case _State.COLLECTING_TOOL_CONTENT:
                if TOOL_CLOSE not in acc:
                    return [], False
                raw, _ = self._split_at(TOOL_CLOSE)
                self._state = _State.COLLECTING_CONTENT
                return [(_Kind.TOOL_CALL, raw)], True


def _parse_tool_call(raw: str) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of one `<tool_call>` body, with Ollama's error messages."""
    try:
        parsed = _text.decode_json(raw)
        if parsed is None:
            parsed = {}  # Go decodes `null` into the struct as a no-op
        if not isinstance(parsed, dict):
            raise ValueError(f"cannot unmarshal {type(parsed).__name__} into a tool call object")
        name = parsed.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"cannot unmarshal {type(name).__name__} into the tool call name")
        arguments = _text.decode_arguments(parsed.get("arguments"))
    except ValueError as e:
        raise ParserError(f"failed to parse JSON: {e}") from e
    if not name:
        raise ParserError("empty function name")
    return name, arguments
