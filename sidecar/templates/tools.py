"""Tool calls: which templates support them, and finding them in a model's output as Ollama does.

Ollama (tools/tools.go) keys its parser off the chat template: the first text the template
writes inside its `{{ if .ToolCalls }}` block (else branches included, tools/template.go) is the
tag a model puts before its calls (`<tool_call>` for Qwen/Hermes, `[TOOL_CALLS]` for Mistral); a
template whose calls start with JSON (Llama 3.x: `{"name": ..., "parameters": ...}`) gets the tag
`{`, and then only output that *starts* with a JSON object or array is taken for calls. After the
tag come JSON objects (or an array of them) with a `name` and `arguments` (or `parameters`).

The parser is conservative: a call must name one of the request's tools and carry an object of
arguments, otherwise everything it held back is released as ordinary content. While output could
still turn into a call it is held back, so a stream never shows half a call as text.
"""

from __future__ import annotations

import functools
import json
import random
import re
import string
from typing import Any

from sidecar.holdback import partial_suffix
from sidecar.templates.gotemplate import GoTemplate, TemplateError
from sidecar.templates.tags import find_tool_call_node, tool_call_tag

# Tags of the common formats, for jinja (GGUF) templates, which have no .ToolCalls to look after.
_KNOWN_TAGS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|tool_call_start|>", "<function_call>")


def supports_tools(source: str) -> bool:
    """Ollama's `tools` capability: the template reads .Tools (Go) or `tools` (jinja)."""
    if "{{" in source and ".Tools" in source:
        return True
    return "{%" in source and re.search(r"\btools\b", source) is not None


@functools.lru_cache(maxsize=64)  # parsing a Qwen-size template costs a millisecond, per request
def tool_tag(source: str) -> str:
    """The text that opens a model's tool calls under this template ("{" means bare JSON).

    A Go template with an ``{{ if .ToolCalls }}`` gets Ollama's tag (tags.tool_call_tag); any
    other template, or one our engine can't parse, is searched for the common tags.
    """
    try:
        template: GoTemplate | None = GoTemplate(source)
    except TemplateError:
        template = None
    if template is not None and find_tool_call_node(template.root.nodes) is not None:
        tag = tool_call_tag(template)
        if len(tag) > 1 and tag.endswith("["):
            # Not Ollama's: our parser wants the JSON after the tag, and in `[TOOL_CALLS][` the "["
            # opens the array of calls.
            tag = tag[:-1].rstrip()
        return tag
    for tag in _KNOWN_TAGS:
        if tag in source:
            return tag
    return "{"


def call_id() -> str:
    """Ollama's tool call id: `call_` and 8 random lower-case letters and digits."""
    return "call_" + "".join(random.choices(string.ascii_lowercase + string.digits, k=8))


def _closing(tag: str) -> str | None:
    """`<tool_call>` is closed by `</tool_call>`; bracket tags have no closing tag."""
    m = re.fullmatch(r"<(\w+)>", tag)
    return f"</{m.group(1)}>" if m else None


class _Incomplete(Exception):
    """The held text is a call still being written."""


class _NotACall(Exception):
    """The held text cannot be a call: it is content after all."""


class ToolCallParser:
    """Splits streamed output into content and tool calls (Ollama's shape, `arguments` an object).

    `feed(text)` returns the content that is final now and the calls completed by this text;
    `flush()` at the end releases whatever was held back."""

    def __init__(self, template_source: str, tools: list[dict[str, Any]]) -> None:
        self.tag = tool_tag(template_source)
        self.close_tag = _closing(self.tag)
        self.names = {str((t.get("function") or {}).get("name")) for t in tools if isinstance(t, dict)}
        self.calls = 0  # calls found so far (each call's `index`)
        self._buf = ""
        self._held = ""  # text held back since the last release, to give back if it is no call
        self._state = "look"  # look (for the tag) | call (parsing calls) | done (plain content)

    @property
    def bare_json(self) -> bool:
        return self.tag == "{"

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._state == "done":
            return text, []
        self._buf += text
        return self._step()

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        if self._state == "done":
            return "", []
        content, calls = self._step()
        rest = self._held + self._buf
        self._held = self._buf = ""
        self._state = "done"
        if calls or self.calls:
            rest = rest.strip()  # whitespace around calls is not content
        return content + rest, calls

    def _step(self) -> tuple[str, list[dict[str, Any]]]:
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self._state == "look":
                if not self._look(content):
                    break
            elif self._state == "call":
                try:
                    found = self._parse_calls()
                except _Incomplete:
                    break
                except _NotACall:
                    content.append(self._held + self._buf)
                    self._held = self._buf = ""
                    self._state = "done"
                    break
                calls += found
                self._held = ""
                self._state = "call" if self.bare_json else "look"
            else:
                content.append(self._buf)
                self._buf = ""
                break
        return "".join(content), calls

    def _look(self, content: list[str]) -> bool:
        """Find the tag; True when parsing calls should start (or the state changed)."""
        if self.bare_json:
            stripped = self._buf.lstrip()
            if not stripped:
                return False  # only whitespace so far: could still open a call
            if stripped[0] in "{[":
                self._held += self._buf[: len(self._buf) - len(stripped)]
                self._buf = stripped
                self._state = "call"
                return True
            self._state = "done"  # Ollama: bare JSON calls only at the very start
            self._buf = self._held + self._buf
            self._held = ""
            return True
        if self.calls:
            # Between calls whitespace is no content: hold it while another tag may follow.
            rest = self._buf.lstrip()
            if self.tag.startswith(rest):
                return False
            if rest.startswith(self.tag):
                self._buf = rest
        i = self._buf.find(self.tag)
        if i < 0:
            keep = partial_suffix(self._buf, (self.tag,))
            cut = len(self._buf) - keep
            content.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        content.append(self._buf[:i])
        self._held = self.tag
        self._buf = self._buf[i + len(self.tag):]
        self._state = "call"
        return True

    def _parse_calls(self) -> list[dict[str, Any]]:
        """Parse one JSON value of calls from the buffer (raises _Incomplete or _NotACall)."""
        stripped = self._buf.lstrip()
        if not stripped:
            raise _Incomplete
        if stripped[0] not in "{[":
            raise _NotACall  # after bare JSON calls too: Ollama stops looking, the rest is content
        try:
            value, end = json.JSONDecoder().raw_decode(stripped)
        except json.JSONDecodeError as e:
            if e.pos >= len(stripped) or e.msg.startswith("Unterminated string"):
                raise _Incomplete from None
            raise _NotACall from None
        items = value if isinstance(value, list) else [value]
        found = [self._call(item) for item in items]
        rest = stripped[end:]
        if self.close_tag is not None:
            r = rest.lstrip()
            if self.close_tag.startswith(r) and len(r) < len(self.close_tag):
                raise _Incomplete  # the closing tag may still be on its way
            if r.startswith(self.close_tag):
                rest = r[len(self.close_tag):]
        self._buf = rest
        calls = []
        for name, args in found:
            calls.append({"id": call_id(), "function": {"index": self.calls, "name": name, "arguments": args}})
            self.calls += 1
        return calls

    @staticmethod
    def _unpack(item: Any) -> tuple[Any, Any]:
        """(name, arguments) of one call object, in any of the common spellings."""
        if not isinstance(item, dict):
            raise _NotACall
        fn: dict[str, Any] = item["function"] if isinstance(item.get("function"), dict) else item
        return fn.get("name"), fn.get("arguments", fn.get("parameters", {}))

    def _call(self, item: Any) -> tuple[str, dict[str, Any]]:
        name, args = self._unpack(item)
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise _NotACall from None
        if not isinstance(name, str) or name not in self.names or not isinstance(args, dict):
            raise _NotACall
        return name, args
