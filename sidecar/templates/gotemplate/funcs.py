"""The functions templates can call: Go's builtins (text/template/funcs.go) and Ollama's FuncMap.

Argument checks and error texts follow Go's, since a call Go rejects must fail here too. The
engine exists to render Ollama's templates, so its default set also has Ollama's ``json``,
``currentDate`` and ``yesterdayDate``.
"""

from __future__ import annotations

import datetime as _dt
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from sidecar.templates.gotemplate.fmt import sprint, sprint_value, sprintf
from sidecar.templates.gotemplate.json import marshal_or_empty
from sidecar.templates.gotemplate.values import GoSlice, from_bytes, go_type_name, to_bytes, truth


class FuncError(Exception):
    """A function's own error; reported as ``error calling NAME: ...`` like Go."""


class ArgError(Exception):
    """A bad argument type, detected before the call; reported verbatim like Go."""


@dataclass(frozen=True, slots=True)
class Func:
    """A template function: ``call`` gets the evaluated arguments, after Go's arity check."""

    call: Callable[[list[Any]], Any]
    min_args: int
    variadic: bool
    nil_type: str | None = None  # Go parameter type if a literal nil can't be passed to it


def _basic_kind(v: Any) -> str:
    if v is None:
        return "invalid"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, complex):
        return "complex"
    if isinstance(v, str):
        return "string"
    return "other"


def _eq(args: list[Any]) -> bool:
    """Go 1.18+ eq: true if the first argument equals any of the others."""
    a = args[0]
    if len(args) == 1:
        raise FuncError("missing argument for comparison")
    k1 = _basic_kind(a)
    for b in args[1:]:
        k2 = _basic_kind(b)
        if k1 != k2:
            if a is not None and b is not None:
                raise FuncError("incompatible types for comparison")
            truth = False
        elif k1 == "other":
            if isinstance(a, list | tuple | Mapping | bytes | bytearray):
                raise FuncError(f"non-comparable type {sprint_value(a)}: {go_type_name(a)}")
            if isinstance(b, list | tuple | Mapping | bytes | bytearray):
                raise FuncError(f"non-comparable type {sprint_value(b)}: {go_type_name(b)}")
            truth = a is b or a == b
        else:
            truth = a == b
        if truth:
            return True
    return False


def _lt(args: list[Any]) -> bool:
    a, b = args
    k1, k2 = _basic_kind(a), _basic_kind(b)
    if k1 in ("invalid", "other") or k2 in ("invalid", "other"):
        raise FuncError("invalid type for comparison")
    if k1 != k2:
        raise FuncError("incompatible types for comparison")
    if k1 in ("bool", "complex"):
        raise FuncError("invalid type for comparison")
    return bool(a < b)


def _le(args: list[Any]) -> bool:
    return _lt(args) or _eq(args)


def _length(args: list[Any]) -> int:
    v = args[0]
    if v is None:
        raise FuncError("len of nil pointer")
    if isinstance(v, str):
        return len(to_bytes(v))
    if isinstance(v, bytes | bytearray | list | tuple | Mapping):
        return len(v)
    raise FuncError(f"len of type {go_type_name(v)}")


def _index_arg(ix: Any, limit: int, *, inclusive: bool) -> int:
    if ix is None:
        raise FuncError("cannot index slice/array with nil")
    if isinstance(ix, bool) or not isinstance(ix, int):
        raise FuncError(f"cannot index slice/array with type {go_type_name(ix)}")
    if ix < 0 or ix > limit or (ix == limit and not inclusive):
        raise FuncError(f"index out of range: {ix}")
    return ix


def _index(args: list[Any]) -> Any:
    item = args[0]
    if item is None:
        raise FuncError("index of untyped nil")
    for ix in args[1:]:
        if item is None:
            raise FuncError("index of nil pointer")
        if isinstance(item, str):
            data = to_bytes(item)
            item = data[_index_arg(ix, len(data), inclusive=False)]
        elif isinstance(item, bytes | bytearray | list | tuple):
            item = item[_index_arg(ix, len(item), inclusive=False)]
        elif isinstance(item, Mapping):
            # Template data maps are map[string]any: the key must be a string.
            if ix is None:
                raise FuncError("value is nil; should be of type string")
            if not isinstance(ix, str) and all(isinstance(k, str) for k in item):
                raise FuncError(f"value has type {go_type_name(ix)}; should be string")
            try:
                item = item.get(ix)
            except TypeError:
                raise FuncError(f"value has type {go_type_name(ix)}; not a valid map key") from None
        else:
            raise FuncError(f"can't index item of type {go_type_name(item)}")
    return item


def _slice(args: list[Any]) -> Any:
    item, indexes = args[0], args[1:]
    if item is None:
        raise FuncError("slice of untyped nil")
    if len(indexes) > 3:
        raise FuncError(f"too many slice indexes: {len(indexes)}")
    if isinstance(item, str):
        if len(indexes) == 3:
            raise FuncError("cannot 3-index slice a string")
        seq: Any = to_bytes(item)
    elif isinstance(item, bytes | bytearray | list | tuple):
        seq = item
    else:
        raise FuncError(f"can't slice item of type {go_type_name(item)}")
    idx = [0, len(seq), len(seq)]
    for i, ix in enumerate(indexes):
        idx[i] = _index_arg(ix, len(seq), inclusive=True)
    if idx[0] > idx[1]:
        raise FuncError(f"invalid slice index: {idx[0]} > {idx[1]}")
    if len(indexes) == 3 and idx[1] > idx[2]:
        raise FuncError(f"invalid slice index: {idx[1]} > {idx[2]}")
    result = seq[idx[0] : idx[1]]
    if isinstance(item, str):
        return from_bytes(result)
    if isinstance(item, GoSlice):
        return GoSlice(result, stringer=item.stringer, type_name=item.type_name)
    return result


def _escaper_input(args: list[Any]) -> str:
    if len(args) == 1 and isinstance(args[0], str):
        return args[0]
    return sprint(args)


_HTML_ESCAPES: Final = {"\0": "\ufffd", '"': "&#34;", "'": "&#39;", "&": "&amp;", "<": "&lt;", ">": "&gt;"}
_JS_ESCAPES: Final = {
    "\\": "\\\\",
    "'": "\\'",
    '"': '\\"',
    "<": "\\u003C",
    ">": "\\u003E",
    "&": "\\u0026",
    "=": "\\u003D",
}


def _html(args: list[Any]) -> str:
    return "".join(_HTML_ESCAPES.get(c, c) for c in _escaper_input(args))


def _js(args: list[Any]) -> str:
    out = []
    for c in _escaper_input(args):
        if c in _JS_ESCAPES:
            out.append(_JS_ESCAPES[c])
        elif c < " " or (ord(c) >= 0x80 and not c.isprintable()):
            out.append(f"\\u{ord(c):04X}")
        else:
            out.append(c)
    return "".join(out)


def _urlquery(args: list[Any]) -> str:
    return urllib.parse.quote_plus(to_bytes(_escaper_input(args)), safe="")


def _printf(args: list[Any]) -> str:
    if not isinstance(args[0], str):
        raise ArgError(f"wrong type for value; expected string; got {go_type_name(args[0])}")
    return sprintf(args[0], args[1:])


def _date_function(days_ago: int) -> Callable[[list[Any]], str]:
    def current(args: list[Any]) -> str:
        # Ollama accepts (and ignores) a layout argument; it must still be a string.
        for a in args:
            if not isinstance(a, str):
                raise ArgError(f"wrong type for value; expected string; got {go_type_name(a)}")
        return (_dt.date.today() - _dt.timedelta(days=days_ago)).isoformat()

    return current


# Go's builtins. "and"/"or" are evaluated lazily by the executor (call is unused).
BUILTINS: Final[Mapping[str, Func]] = {
    "and": Func(lambda a: a[-1], 1, True),
    "or": Func(lambda a: a[-1], 1, True),
    "not": Func(lambda a: not truth(a[0]), 1, False),
    "len": Func(_length, 1, False),
    "index": Func(_index, 1, True),
    "slice": Func(_slice, 1, True),
    "eq": Func(_eq, 1, True),
    "ne": Func(lambda a: not _eq(a), 2, False),
    "lt": Func(_lt, 2, False),
    "le": Func(_le, 2, False),
    "gt": Func(lambda a: not _le(a), 2, False),
    "ge": Func(lambda a: not _lt(a), 2, False),
    "print": Func(sprint, 0, True),
    "printf": Func(_printf, 1, True),
    "println": Func(lambda a: " ".join(sprint_value(x) for x in a) + "\n", 0, True),
    "html": Func(_html, 0, True),
    "js": Func(_js, 0, True),
    "urlquery": Func(_urlquery, 0, True),
}

# Ollama's template.FuncMap (toTypeScriptType is not implemented).
OLLAMA_FUNCS: Final[Mapping[str, Func]] = {
    "json": Func(lambda a: marshal_or_empty(a[0]), 1, False),
    "currentDate": Func(_date_function(0), 0, True, "string"),
    "yesterdayDate": Func(_date_function(1), 0, True, "string"),
}

DEFAULT_FUNCS: Final[Mapping[str, Func]] = {**BUILTINS, **OLLAMA_FUNCS}
