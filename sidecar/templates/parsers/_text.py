"""Go string semantics the parsers depend on, so the ports behave like Ollama on the same text.

Python's `str.isspace` and `str.strip()` disagree with Go's `unicode.IsSpace` (Python also counts
U+001C..U+001F), and Python's `json` accepts NaN and Infinity where Go's does not; the parsers
use these helpers instead so whitespace eating, header splitting and argument decoding match.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Go's unicode.IsSpace: the Latin-1 spaces plus the White_Space property above Latin-1.
GO_SPACE = (
    "\t\n\v\f\r \x85\xa0\u1680"
    "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
_FIELD_SEP = re.compile(f"[{re.escape(GO_SPACE)}]+")


def lstrip(s: str) -> str:
    """strings.TrimLeftFunc(s, unicode.IsSpace)."""
    return s.lstrip(GO_SPACE)


def rstrip(s: str) -> str:
    """strings.TrimRightFunc(s, unicode.IsSpace)."""
    return s.rstrip(GO_SPACE)


def strip(s: str) -> str:
    """strings.TrimSpace."""
    return s.strip(GO_SPACE)


def fields(s: str) -> list[str]:
    """strings.Fields: the runs of non-space text."""
    stripped = strip(s)
    return _FIELD_SEP.split(stripped) if stripped else []


def first_space(s: str) -> int:
    """strings.IndexFunc(s, unicode.IsSpace): index of the first space, or -1."""
    m = _FIELD_SEP.search(s)
    return m.start() if m else -1


def trailing_space_len(s: str) -> int:
    """Length of the whitespace run that ends `s` (Ollama's trailingWhitespaceLen)."""
    return len(s) - len(rstrip(s))


def overlap(s: str, tag: str) -> int:
    """Length of the longest suffix of `s` that is a prefix of `tag`: text that may yet become `tag`.

    A full `tag` at the end counts too, as in Ollama; callers look for the whole tag first.
    """
    for i in range(min(len(tag), len(s)), 0, -1):
        if s.endswith(tag[:i]):
            return i
    return 0


def split_at_tag(s: str, tag: str, trim_after: bool) -> tuple[str, str]:
    """Ollama's splitAtTag: (text before the first `tag`, right-trimmed; text after it).

    The caller's buffer becomes the text after the tag, or empty when there is no tag (then the
    whole of `s` comes back as "before", untrimmed).
    """
    before, found, after = s.partition(tag)
    if not found:
        return s, ""
    return rstrip(before), lstrip(after) if trim_after else after


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid JSON value {name}")


def _go_float(text: str) -> float | int:
    # Go decodes every JSON number to float64 and writes integral ones back without a fraction
    # (5.0 and 5e0 go out as 5); keeping those as int makes re-serialised arguments match Ollama's.
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 1e21 else value


def decode_json(raw: str) -> Any:
    """json.loads with Go's encoding/json strictness: no NaN/Infinity literals."""
    return json.loads(raw, parse_constant=_reject_constant, parse_float=_go_float)


def decode_arguments(value: Any) -> dict[str, Any]:
    """A decoded `arguments` value as api.ToolCallFunctionArguments accepts it: an object, or null for none."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"cannot unmarshal {type(value).__name__} into tool call arguments")
    return value
