"""Go's strconv as templates observe it: shortest float formatting and Go-syntax quoting.

Printed numbers and quoted strings end up in prompts and error messages, so they must come out
exactly as Go's ``strconv.FormatFloat`` / ``strconv.Quote`` write them.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Final


def _float_digits(a: float) -> tuple[str, int]:
    """Shortest round-trip digits of a positive finite float and its decimal-point position."""
    _, digits, exp = Decimal(repr(a)).normalize().as_tuple()
    assert isinstance(exp, int)
    text = "".join(map(str, digits))
    return text, len(text) + exp


def float_special(f: float) -> str | None:
    """How strconv spells NaN and the infinities; None for a finite value."""
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    return None


def format_float_e(f: float) -> str:
    """strconv.FormatFloat(f, 'e', -1, 64)."""
    if f == 0:
        return ("-" if math.copysign(1, f) < 0 else "") + "0e+00"
    digits, dp = _float_digits(abs(f))
    mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    exp = dp - 1
    return ("-" if f < 0 else "") + f"{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"


def format_float_f(f: float) -> str:
    """strconv.FormatFloat(f, 'f', -1, 64)."""
    if f == 0:
        return "-0" if math.copysign(1, f) < 0 else "0"
    digits, dp = _float_digits(abs(f))
    if dp <= 0:
        text = "0." + "0" * -dp + digits
    elif dp >= len(digits):
        text = digits + "0" * (dp - len(digits))
    else:
        text = digits[:dp] + "." + digits[dp:]
    return ("-" if f < 0 else "") + text


def format_float_g(f: float) -> str:
    """fmt's %v for float64: shortest digits, exponent form outside [1e-4, 1e6) as in Go."""
    special = float_special(f)
    if special is not None:
        return special
    if f == 0:
        return "-0" if math.copysign(1, f) < 0 else "0"
    _, dp = _float_digits(abs(f))
    exp = dp - 1
    # strconv's %g with shortest precision switches to exponent form outside [1e-4, 1e6).
    if exp < -4 or exp >= 6:
        return format_float_e(f)
    return format_float_f(f)


_GO_QUOTE_ESCAPES: Final = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
    "\\": "\\\\",
    '"': '\\"',
}


def go_quote(s: str) -> str:
    """strconv.Quote."""
    out = ['"']
    for c in s:
        o = ord(c)
        if c in _GO_QUOTE_ESCAPES:
            out.append(_GO_QUOTE_ESCAPES[c])
        elif 0xDC80 <= o <= 0xDCFF:  # an invalid UTF-8 byte (surrogate escape)
            out.append(f"\\x{o - 0xDC00:02x}")
        elif c.isprintable():
            out.append(c)
        elif o < 0x80:
            out.append(f"\\x{o:02x}")
        elif o < 0x10000:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    out.append('"')
    return "".join(out)


def go_quote_rune(n: int) -> str:
    """strconv.QuoteRune."""
    c = chr(n) if 0 <= n <= 0x10FFFF and not 0xD800 <= n <= 0xDFFF else "\ufffd"
    if c == "'":
        return "'\\''"
    if c == '"':
        return "'\"'"
    return "'" + go_quote(c)[1:-1] + "'"
