"""gpt-oss's harmony format, as Ollama parses it (harmony/harmonyparser.go).

Harmony output is a series of messages, `<|start|>HEADER<|message|>TEXT<|end|>`, the header
naming a role, a `<|channel|>` and perhaps a recipient (`to=functions.NAME`). Ollama maps them
onto its own fields: the `analysis` channel is thinking, `final` (or no channel) is content, and a
message with a recipient is a tool call whose text is the JSON arguments. The prompt leaves the
model inside an assistant header, so parsing starts as if `<|start|>assistant` had been seen.

Tool names are renamed for the prompt into identifiers harmony models were trained on (`get
weather` becomes `get_weather`) and mapped back when the model calls them. The one tool call of a
turn is decoded when the stream is `done` (the call ends generation at `<|call|>`); thinking and
content stream as they arrive, holding back only what may be the start of `<|end|>`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum, auto

from sidecar.templates.parsers import _text
from sidecar.templates.parsers.base import Message, ParserError, ThinkValue, Tool, ToolCall, new_tool_call

log = logging.getLogger(__name__)

MESSAGE_START = "<|start|>"
MESSAGE_END = "<|end|>"
HEADER_END = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
# Built-in tools the models know by these names; they are never renamed.
BUILTIN_TOOLS = frozenset({"browser.open", "browser.search", "browser.find", "python"})


@dataclass(frozen=True)
class HarmonyHeader:
    role: str = ""
    channel: str = ""
    recipient: str = ""


@dataclass(frozen=True)
class MessageStart:
    pass


@dataclass(frozen=True)
class HeaderComplete:
    header: HarmonyHeader


@dataclass(frozen=True)
class ContentEmitted:
    content: str


@dataclass(frozen=True)
class MessageEnd:
    pass


HarmonyEvent = MessageStart | HeaderComplete | ContentEmitted | MessageEnd


class _ParserState(Enum):
    LOOKING_FOR_MESSAGE_START = auto()
    PARSING_HEADER = auto()
    PARSING_CONTENT = auto()


class HarmonyParser:
    """Turns harmony text into message events (Ollama's HarmonyParser)."""

    def __init__(self) -> None:
        self._state = _ParserState.LOOKING_FOR_MESSAGE_START
        self._acc = ""

    def add_implicit_start(self) -> None:
        """The prompt ends inside an assistant header: parse as if `<|start|>assistant` was output."""
        self._acc += MESSAGE_START + "assistant"

    def add_implicit_start_or_prefill(self, last_message: Message | None) -> None:
        """Continue a prefilled assistant turn in the section its prompt left open."""
        if last_message is not None and last_message.get("role") == "assistant":
            if last_message.get("content"):
                self._acc += MESSAGE_START + "assistant" + CHANNEL + "final" + HEADER_END
                return
            if last_message.get("thinking"):
                self._acc += MESSAGE_START + "assistant" + CHANNEL + "analysis" + HEADER_END
                return
        self.add_implicit_start()

    def add(self, text: str) -> list[HarmonyEvent]:
        self._acc += text
        events: list[HarmonyEvent] = []
        # one piece can pass through several states; nothing unambiguous should wait for the next
        more = True
        while more:
            new, more = self._eat()
            events.extend(new)
        return events

    def _eat(self) -> tuple[list[HarmonyEvent], bool]:
        acc = self._acc
        match self._state:
            case _ParserState.LOOKING_FOR_MESSAGE_START:
                before, found, after = acc.partition(MESSAGE_START)
                if not found:
                    return [], False
                if before:
                    log.warning("harmony parser: found message start tag in the middle of the content: %r", acc)
                self._acc = after
                self._state = _ParserState.PARSING_HEADER
                return [MessageStart()], True
            case _ParserState.PARSING_HEADER:
                header, found, after = acc.partition(HEADER_END)
                if not found:
                    return [], False
                self._acc = after
                self._state = _ParserState.PARSING_CONTENT
                return [HeaderComplete(parse_header(header))], True
            case _ParserState.PARSING_CONTENT:
                content, found, after = acc.partition(MESSAGE_END)
                if found:
                    self._acc = after
                    self._state = _ParserState.LOOKING_FOR_MESSAGE_START
                    events: list[HarmonyEvent] = [ContentEmitted(content)] if content else []
                    return [*events, MessageEnd()], True
                # emit what cannot be the start of <|end|>, hold back the rest
                held = _text.overlap(acc, MESSAGE_END)
                content = acc[: len(acc) - held]
                self._acc = acc[len(content):]
                return ([ContentEmitted(content)] if content else []), False


def parse_header(raw: str) -> HarmonyHeader:
    """Role, channel and recipient of a header such as `assistant<|channel|>commentary to=functions.f`."""
    # `<|constrain|>` must stand apart from what precedes it, even where the model left out the space
    if CONSTRAIN in raw:
        raw = _text.strip(raw.replace(CONSTRAIN, " " + CONSTRAIN, 1))

    channel = ""
    before, found, after = raw.partition(CHANNEL)
    if found:
        # the channel name runs up to the first whitespace
        end = _text.first_space(after)
        if end == -1:
            end = len(after)
        channel = after[:end]
        raw = _text.strip(before + after[end:])

    tokens = _text.fields(raw)
    if not tokens:
        log.error("harmony parser: missing role in header: %r", raw)
        return HarmonyHeader(channel=channel)
    role, rest = tokens[0], tokens[1:]
    recipient = ""
    if role.startswith("to="):
        # the recipient in the role's place means the message is addressed to a tool
        recipient, role = role[3:], "tool"
    elif rest and rest[0].startswith("to="):
        # the recipient may come before or after the channel
        recipient = rest[0][3:]
    return HarmonyHeader(role=role, channel=channel, recipient=recipient)


class _MessageState(Enum):
    NORMAL = auto()
    THINKING = auto()
    TOOL_CALLING = auto()


class HarmonyToolCallAccumulator:
    """Collects the text of the tool-call message until the stream ends."""

    def __init__(self) -> None:
        self.tool_name: str | None = None
        self._acc = ""

    def add(self, content: str) -> None:
        self._acc += content

    def drain(self) -> tuple[str | None, str]:
        """(recipient of the last tool-call message, everything collected); clears the collected text."""
        raw, self._acc = self._acc, ""
        return self.tool_name, raw


class FunctionNameMap:
    """Maps the request's tool names to harmony identifiers (TypeScript-like) and back."""

    def __init__(self) -> None:
        self.user_to_harmony: dict[str, str] = {}
        self.harmony_to_user: dict[str, str] = {}

    def convert_and_add(self, user_name: str) -> str:
        harmony_name = user_name if user_name in BUILTIN_TOOLS else self._derive_name(user_name)
        self.user_to_harmony[user_name] = harmony_name
        self.harmony_to_user[harmony_name] = user_name
        return harmony_name

    def original_from_converted(self, harmony_name: str) -> str:
        """The request's name for `harmony_name`; the name itself when it was never converted."""
        if harmony_name in self.harmony_to_user:
            return self.harmony_to_user[harmony_name]
        log.warning("harmony parser: no reverse mapping found for function name %r", harmony_name)
        return harmony_name

    @staticmethod
    def convert_to_valid_chars(user_name: str) -> str:
        """A valid identifier from `user_name`: letters, digits, `_` and `$`; space, `-` and `.` become `_`.

        Like Ollama, this checks Unicode letters and decimal digits rather than real ID_Start/ID_Continue,
        and ignores reserved words.
        """
        chars = []
        for c in user_name:
            if c in " -.":
                chars.append("_")
            elif c.isalpha() or c.isdecimal() or c in "_$":
                chars.append(c)
        candidate = "".join(chars)
        if not candidate:
            return "unnamed"
        # Go tests the first byte, which only an ASCII digit can match
        if candidate[0] in "0123456789":
            candidate = "_" + candidate
        return candidate

    def _derive_name(self, user_name: str) -> str:
        original = self.convert_to_valid_chars(user_name)
        candidate = original
        # duplicates get a number, from 2: `f`, `f_2`, `f_3`
        count = 2
        while candidate in self.harmony_to_user:
            candidate = f"{original}_{count}"
            count += 1
        return candidate


class HarmonyMessageHandler:
    """The "harmony" parser: maps harmony messages onto content, thinking and tool calls."""

    def __init__(self) -> None:
        self._state = _MessageState.NORMAL
        self._parser = HarmonyParser()
        self._names = FunctionNameMap()
        self._tool_accumulator = HarmonyToolCallAccumulator()

    def has_tool_support(self) -> bool:
        return True

    def has_thinking_support(self) -> bool:
        return True

    def preserved_tokens(self) -> list[str]:
        # not <|call|>: it ends generation, so it must stay a stop token
        return [MESSAGE_START, MESSAGE_END, HEADER_END, CHANNEL, CONSTRAIN]

    def init(self, tools: list[Tool] | None, last_message: Message | None, think: ThinkValue) -> list[Tool] | None:
        """Start inside the assistant turn and rename the tools; `think` plays no part in parsing."""
        self._parser.add_implicit_start_or_prefill(last_message)
        self._tool_accumulator = HarmonyToolCallAccumulator()
        if not tools:
            return tools
        renamed = []
        for tool in tools:
            function = tool.get("function") or {}
            name = function.get("name")
            if name:
                tool = {**tool, "function": {**function, "name": self._names.convert_and_add(name)}}
            renamed.append(tool)
        return renamed

    def begin(self, prompt: str) -> None:
        """Nothing to learn from the prompt: init started the assistant turn from the last message."""

    def add_content(self, text: str) -> tuple[str, str, str]:
        """(content, thinking, tool-call text) in `text`; the tool-call text still has to be decoded."""
        content: list[str] = []
        thinking: list[str] = []
        tool_content: list[str] = []
        for event in self._parser.add(text):
            match event:
                case HeaderComplete(header=header):
                    if header.channel in ("analysis", "commentary") and header.recipient:
                        # e.g. "functions.calc" for the request's tools, "browser.search" for a built-in
                        self._state = _MessageState.TOOL_CALLING
                        self._tool_accumulator.tool_name = header.recipient
                    elif header.channel == "analysis":
                        self._state = _MessageState.THINKING
                    elif header.channel in ("commentary", "final"):
                        self._state = _MessageState.NORMAL
                    # any other channel carries on in the state the previous message left
                case ContentEmitted(content=c):
                    match self._state:
                        case _MessageState.NORMAL:
                            content.append(c)
                        case _MessageState.THINKING:
                            thinking.append(c)
                        case _MessageState.TOOL_CALLING:
                            tool_content.append(c)
                case MessageEnd():
                    self._state = _MessageState.NORMAL
        return "".join(content), "".join(thinking), "".join(tool_content)

    def add(self, text: str, done: bool) -> tuple[str, str, list[ToolCall]]:
        content, thinking, tool_content = self.add_content(text)
        if tool_content:
            self._tool_accumulator.add(tool_content)
        calls: list[ToolCall] = []
        # a turn holds at most one call, at its end, so it is decoded once the stream is done
        if done:
            tool_name, raw = self._tool_accumulator.drain()
            if tool_name is not None:
                name = self._names.original_from_converted(tool_name.removeprefix("functions."))
                try:
                    arguments = _text.decode_arguments(_text.decode_json(raw))
                except ValueError as e:
                    raise ParserError(f"error parsing tool call: raw='{raw}', err={e}") from e
                calls.append(new_tool_call(name, arguments, 0))
        return content, thinking, calls
