"""Go's encoding/json Marshal, as Ollama's ``json`` template function and String methods use it.

Tool schemas and arguments are printed into prompts as JSON, so the bytes must match Go's:
compact, HTML-safe escaping (``<`` is ``\\u003c``), float64 spelling, sorted map keys, struct
fields in declaration order with their tags and ``omitempty``.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping
from typing import Any, Final

from sidecar.templates.gotemplate.strconv import format_float_e, format_float_f, format_float_g
from sidecar.templates.gotemplate.values import (
    OMIT_EMPTY,
    OMIT_NIL,
    GoMap,
    GoSlice,
    NamedValue,
    Struct,
    go_type_name,
)


class JSONError(Exception):
    """json.Marshal's error (an unsupported value or type), with Go's message."""


_JSON_ESCAPES: Final = {
    '"': '\\"',
    "\\": "\\\\",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\b": "\\b",
    "\f": "\\f",
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}
_JSON_SPECIAL_RE: Final = re.compile('[\\x00-\\x1f"\\\\<>&\\u2028\\u2029\\ud800-\\udfff]')


def _json_escape_char(m: re.Match[str]) -> str:
    c = m.group()
    escaped = _JSON_ESCAPES.get(c)
    if escaped is not None:
        return escaped
    if "\ud800" <= c <= "\udfff":
        return "\\ufffd"  # invalid UTF-8 is coerced to U+FFFD, as Go does
    return f"\\u{ord(c):04x}"


def _json_str(s: str) -> str:
    return '"' + _JSON_SPECIAL_RE.sub(_json_escape_char, s) + '"'


def _json_float(f: float) -> str:
    if math.isnan(f) or math.isinf(f):
        raise JSONError(f"json: unsupported value: {format_float_g(f)}")
    a = abs(f)
    if a != 0 and (a < 1e-6 or a >= 1e21):
        return re.sub(r"e-0(\d)$", r"e-\1", format_float_e(f))
    return format_float_f(f)


def _is_empty(v: Any) -> bool:
    if v is None or v is False:
        return True
    if isinstance(v, int | float) and not isinstance(v, bool):
        return v == 0
    if isinstance(v, str | bytes | bytearray | list | tuple | Mapping):
        return len(v) == 0
    return False


def _json_key(k: Any) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, int) and not isinstance(k, bool):
        return str(k)
    raise JSONError(f"json: unsupported type: map[{go_type_name(k)}]interface {{}}")


def _json_into(v: Any, out: list[str]) -> None:
    if v is None:
        out.append("null")
    elif isinstance(v, str):
        out.append(_json_str(v))
    elif isinstance(v, bool):
        out.append("true" if v else "false")
    elif isinstance(v, int):
        out.append(str(v))
    elif isinstance(v, float):
        out.append(_json_float(v))
    elif isinstance(v, Struct):
        out.append("{")
        first = True
        for go_name, json_name, omit in v.layout:
            value = v.fields[go_name]
            if (omit == OMIT_EMPTY and _is_empty(value)) or (omit == OMIT_NIL and value is None):
                continue
            if not first:
                out.append(",")
            first = False
            out.append(_json_str(json_name) + ":")
            _json_into(value, out)
        out.append("}")
    elif isinstance(v, NamedValue) and (raw := v.go_json()) is not None:
        out.append(raw)
    elif isinstance(v, GoSlice | GoMap) and v.is_nil:
        out.append("null")
    elif isinstance(v, Mapping):
        items = [(_json_key(k), x) for k, x in v.items()]
        if isinstance(v, GoMap) and v.sort_keys:
            items.sort(key=lambda kv: kv[0])
        out.append("{")
        for i, (k, x) in enumerate(items):
            out.append(("," if i else "") + _json_str(k) + ":")
            _json_into(x, out)
        out.append("}")
    elif isinstance(v, bytes | bytearray):
        out.append('"' + base64.b64encode(bytes(v)).decode("ascii") + '"')
    elif isinstance(v, list | tuple):
        out.append("[")
        for i, x in enumerate(v):
            if i:
                out.append(",")
            _json_into(x, out)
        out.append("]")
    else:
        raise JSONError(f"json: unsupported type: {go_type_name(v)}")


def marshal(v: Any) -> str:
    """Go's json.Marshal: compact, HTML-safe; plain dicts keep their key order."""
    out: list[str] = []
    _json_into(v, out)
    return "".join(out)


def marshal_or_empty(v: Any) -> str:
    """``b, _ := json.Marshal(v); string(b)``: how Ollama's json function and String methods marshal.

    They ignore the error, and a failed Marshal returns nil bytes, which print as "".
    """
    try:
        return marshal(v)
    except JSONError:
        return ""
