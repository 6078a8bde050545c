"""Go's fmt as templates use it: ``{{ . }}`` printing (%v), print/println and printf verbs.

What an action prints is the prompt, so values print as Go's fmt prints them: floats in their
shortest form, maps with sorted keys, types with a String method through it, and printf's
``%!verb(type=value)`` annotations for mistakes instead of exceptions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from sidecar.templates.gotemplate.json import marshal_or_empty
from sidecar.templates.gotemplate.strconv import float_special, format_float_g, go_quote, go_quote_rune
from sidecar.templates.gotemplate.values import (
    GoMap,
    GoSlice,
    NamedValue,
    Struct,
    from_bytes,
    go_type_name,
    sorted_items,
    to_bytes,
)


def _go_stringer(v: Any) -> str | None:
    """The result of the value's Go String() method, for types that have one."""
    if isinstance(v, NamedValue):
        return v.go_string()
    if isinstance(v, Struct | GoSlice) and v.stringer:
        return marshal_or_empty(v)
    if isinstance(v, GoMap) and v.stringer:
        return "{}" if v.is_nil else marshal_or_empty(v)
    return None


def sprint_value(v: Any) -> str:
    """Go's ``fmt.Sprint`` of one value (the %v verb)."""
    if v is None:
        return "<nil>"
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return format_float_g(v)
    s = _go_stringer(v)
    if s is not None:
        return s
    if isinstance(v, bytes | bytearray):
        return "[" + " ".join(str(b) for b in v) + "]"
    if isinstance(v, Struct):
        return "{" + " ".join(sprint_value(x) for x in v.fields.values()) + "}"
    if isinstance(v, Mapping):
        return "map[" + " ".join(f"{sprint_value(k)}:{sprint_value(x)}" for k, x in sorted_items(v)) + "]"
    if isinstance(v, list | tuple):
        return "[" + " ".join(sprint_value(x) for x in v) + "]"
    if isinstance(v, complex):
        imag = format_float_g(v.imag)
        sign = "" if imag.startswith(("-", "+")) else "+"
        return f"({format_float_g(v.real)}{sign}{imag}i)"
    return str(v)


def sprint(args: Sequence[Any]) -> str:
    """fmt.Sprint: spaces between operands when neither side is a string."""
    out: list[str] = []
    prev_is_string = False
    for i, a in enumerate(args):
        is_string = isinstance(a, str)
        if i and not is_string and not prev_is_string:
            out.append(" ")
        out.append(sprint_value(a))
        prev_is_string = is_string
    return "".join(out)


_PRINTF_RE: Final = re.compile(r"%([-+# 0]*)(\*|\d+)?(?:\.(\*|\d*))?(?:\[(\d+)\])?(.?)", re.DOTALL)


def _bad_verb(verb: str, arg: Any) -> str:
    if arg is None:
        return f"%!{verb}(<nil>)"
    return f"%!{verb}({go_type_name(arg)}={sprint_value(arg)})"


def _pad(text: str, flags: str, width: int | None, *, numeric: bool = False) -> str:
    if width is None or len(text) >= width:
        return text
    fill = width - len(text)
    if "-" in flags:
        return text + " " * fill
    if "0" in flags and numeric:
        sign = text[0] if text[:1] in ("-", "+", " ") else ""
        return sign + "0" * fill + text[len(sign) :]
    return " " * fill + text


def _fmt_int(verb: str, n: int, flags: str, prec: int | None) -> str | None:
    sign = "-" if n < 0 else ("+" if "+" in flags else (" " if " " in flags else ""))
    a = abs(n)
    prefixes = {"x": "0x", "X": "0X", "o": "0", "b": "0b", "O": "0o"}
    if verb in ("d", "v"):
        digits = str(a)
    elif verb in ("x", "X", "o", "b", "O"):
        digits = format(a, {"x": "x", "X": "X", "o": "o", "b": "b", "O": "o"}[verb])
        if "#" in flags or verb == "O":
            digits = prefixes[verb] + digits
    elif verb == "c":
        return chr(n) if 0 <= n <= 0x10FFFF else "\ufffd"
    elif verb == "q":
        return go_quote_rune(n)
    elif verb == "U":
        return f"U+{a:04X}"
    else:
        return None
    if prec is not None:
        digits = digits.rjust(prec, "0")
    return sign + digits


def _fmt_float(verb: str, f: float, flags: str, prec: int | None) -> str | None:
    special = float_special(f)
    if special is not None:
        text = special
    elif verb in ("v", "g", "G") and prec is None:
        text = format_float_g(f)
    elif verb in ("e", "E", "f", "F", "g", "G"):
        p = 6 if prec is None else prec
        text = format(f, f".{p}{verb.lower() if verb in 'fF' else verb}")
    else:
        return None
    if verb in ("E", "G"):
        text = text.upper()
    if text[0] not in "+-" and ("+" in flags or " " in flags):
        text = ("+" if "+" in flags else " ") + text
    return text


def _fmt_one(verb: str, arg: Any, flags: str, width: int | None, prec: int | None) -> str:
    """One printf directive for the verbs chat templates use (%v %s %d %q %t %f %e %g %x %c)."""
    if arg is None:
        return _pad("<nil>", flags, width) if verb == "v" else _bad_verb(verb, arg)
    stringer = _go_stringer(arg)
    if stringer is not None and verb in ("v", "s", "q"):
        arg = stringer
    if isinstance(arg, str):
        if verb in ("v", "s"):
            text = arg if prec is None else arg[:prec]
        elif verb == "q":
            text = go_quote(arg if prec is None else arg[:prec])
        elif verb in ("x", "X"):
            text = to_bytes(arg).hex()
            text = text.upper() if verb == "X" else text
        else:
            return _bad_verb(verb, arg)
        return _pad(text, flags, width)
    if isinstance(arg, bool):
        if verb not in ("v", "t"):
            return _bad_verb(verb, arg)
        return _pad("true" if arg else "false", flags, width)
    if isinstance(arg, int):
        text_or_none = _fmt_int(verb, arg, flags, prec)
        if text_or_none is None:
            return _bad_verb(verb, arg)
        return _pad(text_or_none, flags, width, numeric=verb not in ("c", "q", "U"))
    if isinstance(arg, float):
        text_or_none = _fmt_float(verb, arg, flags, prec)
        if text_or_none is None:
            return _bad_verb(verb, arg)
        return _pad(text_or_none, flags, width, numeric=True)
    if isinstance(arg, bytes | bytearray) and verb in ("s", "q", "x", "X"):
        return _fmt_one(verb, from_bytes(bytes(arg)), flags, width, prec)
    if isinstance(arg, Mapping):
        inner = " ".join(
            f"{_fmt_one(verb, k, flags, width, prec)}:{_fmt_one(verb, x, flags, width, prec)}"
            for k, x in sorted_items(arg)
        )
        return f"map[{inner}]"
    if isinstance(arg, list | tuple | bytes | bytearray):
        return "[" + " ".join(_fmt_one(verb, x, flags, width, prec) for x in arg) + "]"
    if isinstance(arg, Struct):
        return "{" + " ".join(_fmt_one(verb, x, flags, width, prec) for x in arg.fields.values()) + "}"
    return _pad(sprint_value(arg), flags, width) if verb in ("v", "s") else _bad_verb(verb, arg)


def sprintf(fmt: str, args: Sequence[Any]) -> str:
    """fmt.Sprintf for the common verbs, with Go's %!verb(...) error annotations."""
    out: list[str] = []
    argi = 0
    pos = 0
    reordered = False
    while True:
        j = fmt.find("%", pos)
        if j < 0:
            out.append(fmt[pos:])
            break
        out.append(fmt[pos:j])
        m = _PRINTF_RE.match(fmt, j)
        assert m is not None
        flags, width_s, prec_s, arg_index, verb = m.groups()
        pos = m.end()
        if arg_index is not None:  # %[n]d picks the n-th (1-based) argument
            argi = int(arg_index) - 1
            reordered = True
        width: int | None = None
        prec: int | None = None
        for spec, is_width in ((width_s, True), (prec_s, False)):
            if spec is None:
                continue
            if spec == "*":
                star = args[argi] if argi < len(args) else None
                argi += 1
                value = star if isinstance(star, int) and not isinstance(star, bool) else None
                if value is None:
                    out.append("%!(BADWIDTH)" if is_width else "%!(BADPREC)")
            else:
                value = int(spec) if spec else 0
            if is_width:
                width = value
            else:
                prec = value
        if verb == "":
            out.append("%!(NOVERB)")
            break
        if verb == "%":
            out.append("%")
            continue
        if not 0 <= argi < len(args):
            out.append(f"%!{verb}(BADINDEX)" if reordered else f"%!{verb}(MISSING)")
            continue
        arg = args[argi]
        out.append(go_type_name(arg) if verb == "T" else _fmt_one(verb, arg, flags, width, prec))
        argi += 1
    if argi < len(args) and not reordered:
        extra = ", ".join("<nil>" if a is None else f"{go_type_name(a)}={sprint_value(a)}" for a in args[argi:])
        out.append(f"%!(EXTRA {extra})")
    return "".join(out)
