"""Go's text/template lexer (text/template/parse/lex.go).

Trim markers, comments and error positions must behave exactly as in Go: the text between
actions becomes the prompt, so one whitespace character trimmed differently changes the tokens.
"""

from __future__ import annotations

import enum
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from sidecar.templates.gotemplate.strconv import go_quote

_SPACE: Final = " \t\r\n"
_SPACE_SET: Final = frozenset(_SPACE)
_LEFT_DELIM: Final = "{{"
_RIGHT_DELIM: Final = "}}"


class TokenType(enum.Enum):
    TEXT = enum.auto()
    LEFT = enum.auto()
    RIGHT = enum.auto()
    SPACE = enum.auto()
    FIELD = enum.auto()
    VARIABLE = enum.auto()
    IDENT = enum.auto()
    BOOL = enum.auto()
    NUMBER = enum.auto()
    CHAR_CONST = enum.auto()
    COMPLEX = enum.auto()
    STRING = enum.auto()
    RAW_STRING = enum.auto()
    PIPE = enum.auto()
    ASSIGN = enum.auto()
    DECLARE = enum.auto()
    LPAREN = enum.auto()
    RPAREN = enum.auto()
    CHAR = enum.auto()
    EOF = enum.auto()
    ERROR = enum.auto()
    # keywords
    DOT = enum.auto()
    NIL = enum.auto()
    BLOCK = enum.auto()
    BREAK = enum.auto()
    CONTINUE = enum.auto()
    DEFINE = enum.auto()
    ELSE = enum.auto()
    END = enum.auto()
    IF = enum.auto()
    RANGE = enum.auto()
    TEMPLATE = enum.auto()
    WITH = enum.auto()


_KEYWORDS: Final = {
    "block": TokenType.BLOCK,
    "break": TokenType.BREAK,
    "continue": TokenType.CONTINUE,
    "define": TokenType.DEFINE,
    "else": TokenType.ELSE,
    "end": TokenType.END,
    "if": TokenType.IF,
    "nil": TokenType.NIL,
    "range": TokenType.RANGE,
    "template": TokenType.TEMPLATE,
    "with": TokenType.WITH,
}
_KEYWORD_TYPES: Final = frozenset({*_KEYWORDS.values(), TokenType.DOT})
_SINGLE_CHAR_TOKENS: Final = {"=": TokenType.ASSIGN, "|": TokenType.PIPE}


@dataclass(frozen=True, slots=True)
class Token:
    typ: TokenType
    val: str
    pos: int  # offset in the source, in characters

    def __str__(self) -> str:
        """The token as Go's parse errors name it (``<if>``, ``"foo"``, ``EOF``)."""
        if self.typ is TokenType.EOF:
            return "EOF"
        if self.typ is TokenType.ERROR:
            return self.val
        if self.typ in _KEYWORD_TYPES:
            return f"<{self.val}>"
        if len(self.val) > 10:
            return go_quote(self.val[:10]) + "..."
        return go_quote(self.val)


def _is_alnum(c: str) -> bool:
    return c == "_" or c.isalpha() or unicodedata.category(c) == "Nd"


def _has_left_trim(s: str, p: int) -> bool:
    return p + 1 < len(s) and s[p] == "-" and s[p + 1] in _SPACE_SET


def _left_trim_len(s: str, p: int) -> int:
    n = p
    while n < len(s) and s[n] in _SPACE_SET:
        n += 1
    return n - p


def _go_rune(c: str) -> str:
    """fmt's %#U: ``U+0041 'A'``."""
    return f"U+{ord(c):04X}" + (f" '{c}'" if c.isprintable() else "")


_State = Callable[[], "_State | None"]


class _Lexer:
    """lex.go's state machine: each state consumes input and returns the next state."""

    def __init__(self, src: str) -> None:
        self.src = src
        self.pos = 0
        self.start = 0
        self.paren_depth = 0
        self.tokens: list[Token] = []

    def run(self) -> list[Token]:
        state: _State | None = self._text
        while state is not None:
            state = state()
        return self.tokens

    def _emit(self, typ: TokenType) -> None:
        self.tokens.append(Token(typ, self.src[self.start : self.pos], self.start))
        self.start = self.pos

    def _fail(self, message: str) -> _State | None:
        """Emit the error token and stop lexing (returns the "no next state" marker)."""
        self.tokens.append(Token(TokenType.ERROR, message, self.start))
        return None

    def _text(self) -> _State | None:
        src = self.src
        x = src.find(_LEFT_DELIM, self.pos)
        if x < 0:
            self.pos = len(src)
            if self.pos > self.start:
                self._emit(TokenType.TEXT)
            self._emit(TokenType.EOF)
            return None
        end = x
        if _has_left_trim(src, x + len(_LEFT_DELIM)):
            end = self.start + len(src[self.start : x].rstrip(_SPACE))
        if end > self.start:
            self.tokens.append(Token(TokenType.TEXT, src[self.start : end], self.start))
        self.pos = self.start = x
        return self._left_delim

    def _left_delim(self) -> _State | None:
        src = self.src
        self.pos += len(_LEFT_DELIM)
        after_marker = 2 if _has_left_trim(src, self.pos) else 0
        if src.startswith("/*", self.pos + after_marker):
            self.pos += after_marker
            self.start = self.pos
            return self._comment
        self._emit(TokenType.LEFT)
        self.pos += after_marker
        self.start = self.pos
        self.paren_depth = 0
        return self._inside

    def _comment(self) -> _State | None:
        self.pos += 2
        x = self.src.find("*/", self.pos)
        if x < 0:
            return self._fail("unclosed comment")
        self.pos = x + 2
        delim, trim = self._at_right_delim()
        if not delim:
            return self._fail("comment ends before closing delimiter")
        self.pos += (2 if trim else 0) + len(_RIGHT_DELIM)
        if trim:
            self.pos += _left_trim_len(self.src, self.pos)
        self.start = self.pos
        return self._text

    def _at_right_delim(self) -> tuple[bool, bool]:
        s, p = self.src, self.pos
        if p + 1 < len(s) and s[p] in _SPACE_SET and s[p + 1] == "-" and s.startswith(_RIGHT_DELIM, p + 2):
            return True, True
        return s.startswith(_RIGHT_DELIM, p), False

    def _right_delim(self) -> _State | None:
        _, trim = self._at_right_delim()
        if trim:
            self.pos += 2
            self.start = self.pos
        self.pos += len(_RIGHT_DELIM)
        self._emit(TokenType.RIGHT)
        if trim:
            self.pos += _left_trim_len(self.src, self.pos)
            self.start = self.pos
        return self._text

    def _inside(self) -> _State | None:
        delim, _ = self._at_right_delim()
        if delim:
            if self.paren_depth == 0:
                return self._right_delim
            return self._fail("unclosed left paren")
        src = self.src
        if self.pos >= len(src):
            return self._fail("unclosed action")
        c = src[self.pos]
        self.pos += 1
        if c in _SPACE_SET:
            self.pos -= 1
            return self._space
        if c in _SINGLE_CHAR_TOKENS:
            self._emit(_SINGLE_CHAR_TOKENS[c])
            return self._inside
        if c == ":":
            if self.pos < len(src) and src[self.pos] == "=":
                self.pos += 1
                self._emit(TokenType.DECLARE)
                return self._inside
            return self._fail("expected :=")
        if c == '"':
            return self._quote
        if c == "`":
            return self._raw_quote
        if c == "$":
            return self._variable
        if c == "'":
            return self._char
        if c == "." and self.pos < len(src) and not ("0" <= src[self.pos] <= "9"):
            return self._field
        if c in "+-." or "0" <= c <= "9":
            self.pos -= 1
            return self._number
        if _is_alnum(c):
            self.pos -= 1
            return self._identifier
        if c == "(":
            self.paren_depth += 1
            self._emit(TokenType.LPAREN)
            return self._inside
        if c == ")":
            self.paren_depth -= 1
            if self.paren_depth < 0:
                return self._fail("unexpected right paren")
            self._emit(TokenType.RPAREN)
            return self._inside
        if c.isascii() and c.isprintable():
            self._emit(TokenType.CHAR)
            return self._inside
        return self._fail(f"unrecognized character in action: {_go_rune(c)}")

    def _space(self) -> _State | None:
        src = self.src
        count = 0
        while self.pos < len(src) and src[self.pos] in _SPACE_SET:
            self.pos += 1
            count += 1
        # A trim-marked closing delimiter (" -}}") owns the last space before the '-'.
        if src.startswith("-" + _RIGHT_DELIM, self.pos):
            self.pos -= 1
            if count == 1:
                return self._right_delim
        self._emit(TokenType.SPACE)
        return self._inside

    def _at_terminator(self) -> bool:
        s, p = self.src, self.pos
        if p >= len(s):
            return True
        return s[p] in _SPACE_SET or s[p] in ".,|:()" or s.startswith(_RIGHT_DELIM, p)

    def _scan_word(self) -> bool:
        src = self.src
        while self.pos < len(src) and _is_alnum(src[self.pos]):
            self.pos += 1
        if not self._at_terminator():
            self._fail(f"bad character {_go_rune(src[self.pos])}")
            return False
        return True

    def _identifier(self) -> _State | None:
        if not self._scan_word():
            return None
        word = self.src[self.start : self.pos]
        if word in _KEYWORDS:
            self._emit(_KEYWORDS[word])
        elif word in ("true", "false"):
            self._emit(TokenType.BOOL)
        else:
            self._emit(TokenType.IDENT)
        return self._inside

    def _field(self) -> _State | None:
        if self._at_terminator():  # a lone "."
            self._emit(TokenType.DOT)
            return self._inside
        if not self._scan_word():
            return None
        self._emit(TokenType.FIELD)
        return self._inside

    def _variable(self) -> _State | None:
        if not self._at_terminator() and not self._scan_word():
            return None
        self._emit(TokenType.VARIABLE)
        return self._inside

    def _quoted(self, quote: str, typ: TokenType, what: str) -> _State | None:
        src = self.src
        while True:
            if self.pos >= len(src):
                return self._fail(f"unterminated {what}")
            c = src[self.pos]
            self.pos += 1
            if c == "\\":
                if self.pos < len(src) and src[self.pos] != "\n":
                    self.pos += 1
                    continue
                return self._fail(f"unterminated {what}")
            if c == "\n":
                return self._fail(f"unterminated {what}")
            if c == quote:
                break
        self._emit(typ)
        return self._inside

    def _quote(self) -> _State | None:
        return self._quoted('"', TokenType.STRING, "quoted string")

    def _char(self) -> _State | None:
        return self._quoted("'", TokenType.CHAR_CONST, "character constant")

    def _raw_quote(self) -> _State | None:
        x = self.src.find("`", self.pos)
        if x < 0:
            return self._fail("unterminated raw quoted string")
        self.pos = x + 1
        self._emit(TokenType.RAW_STRING)
        return self._inside

    def _accept(self, valid: str) -> bool:
        if self.pos < len(self.src) and self.src[self.pos] in valid:
            self.pos += 1
            return True
        return False

    def _accept_run(self, valid: str) -> None:
        while self._accept(valid):
            pass

    def _scan_number(self) -> bool:
        self._accept("+-")
        digits = "0123456789_"
        if self._accept("0"):
            if self._accept("xX"):
                digits = "0123456789abcdefABCDEF_"
            elif self._accept("oO"):
                digits = "01234567_"
            elif self._accept("bB"):
                digits = "01_"
        self._accept_run(digits)
        if self._accept("."):
            self._accept_run(digits)
        if len(digits) == 11 and self._accept("eE"):
            self._accept("+-")
            self._accept_run("0123456789_")
        if len(digits) == 23 and self._accept("pP"):
            self._accept("+-")
            self._accept_run("0123456789_")
        self._accept("i")
        if self.pos < len(self.src) and _is_alnum(self.src[self.pos]):
            self.pos += 1
            return False
        return True

    def _number(self) -> _State | None:
        if not self._scan_number():
            return self._fail(f"bad number syntax: {go_quote(self.src[self.start : self.pos])}")
        if self.pos < len(self.src) and self.src[self.pos] in "+-":
            if not self._scan_number() or self.src[self.pos - 1] != "i":
                return self._fail(f"bad number syntax: {go_quote(self.src[self.start : self.pos])}")
            self._emit(TokenType.COMPLEX)
            return self._inside
        self._emit(TokenType.NUMBER)
        return self._inside


def lex(src: str) -> list[Token]:
    """All tokens of ``src``, ending in EOF, or in an ERROR token at the first lexical error.

    Emitting the error as a token (instead of raising) keeps Go's behaviour of reporting the
    first problem the *parser* reaches.
    """
    return _Lexer(src).run()
