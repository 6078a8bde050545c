"""Go ``text/template`` renderer for Ollama chat templates.

Ollama ships every model's prompt format as a Go ``text/template`` (the Modelfile ``TEMPLATE``).
To serve those models ourselves we must produce *exactly* the prompt text Ollama would: a single
differing byte changes the tokens, which breaks prompt-cache reuse and makes outputs diverge from
what users get from Ollama. So this module reimplements, with Go's semantics, the part of
``text/template`` that chat templates use, plus the Ollama layer around it (:func:`render_ollama`).

Supported template language (as in Go 1.22+):

* text and ``{{ }}`` actions, ``{{-`` / ``-}}`` trim markers, ``{{/* comments */}}``;
* pipelines with ``|``, parenthesised sub-pipelines, ``$x := ...`` / ``$x = ...`` / ``$``;
* field chains (``.A.B``, ``$m.Role``, ``(pipeline).Field``) on mappings and Go-like structs;
* ``if``/``else if``/``else``, ``with``/``else with``/``else``, ``range`` (one or two variables,
  ``else``, ``break``/``continue``, over lists, maps in sorted key order and ints);
* string (interpreted and raw), character, int, float, bool and ``nil`` literals;
* Go's builtins ``and or not len index slice eq ne lt le gt ge print printf println html js
  urlquery`` and Ollama's ``json``, ``currentDate`` and ``yesterdayDate``.

Not supported (parse error): ``define``/``template``/``block``, ``call``, method calls, complex
numbers. Everything else in Go's grammar is accepted and behaves like Go.
"""

from __future__ import annotations

import base64
import bisect
import datetime as _dt
import enum
import json as _pyjson
import math
import re
import unicodedata
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any, Final, NoReturn

__all__ = ["GoTemplate", "TemplateError", "render_ollama"]


class TemplateError(ValueError):
    """A template failed to parse or to execute.

    ``line`` and ``column`` (1-based, in characters) locate the offending source position so a
    broken Modelfile TEMPLATE can be fixed without guesswork; they are ``None`` for errors that
    have no single source position.
    """

    def __init__(self, message: str, *, line: int | None = None, column: int | None = None) -> None:
        super().__init__(message)
        self.line = line
        self.column = column


# ---------------------------------------------------------------------------------------------
# Lexer (mirrors text/template/parse/lex.go so trimming and error positions match Go)
# ---------------------------------------------------------------------------------------------

_SPACE: Final = " \t\r\n"
_SPACE_SET: Final = frozenset(_SPACE)
_LEFT_DELIM: Final = "{{"
_RIGHT_DELIM: Final = "}}"


class _T(enum.Enum):
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
    "block": _T.BLOCK,
    "break": _T.BREAK,
    "continue": _T.CONTINUE,
    "define": _T.DEFINE,
    "else": _T.ELSE,
    "end": _T.END,
    "if": _T.IF,
    "nil": _T.NIL,
    "range": _T.RANGE,
    "template": _T.TEMPLATE,
    "with": _T.WITH,
}
_KEYWORD_TYPES: Final = frozenset({*_KEYWORDS.values(), _T.DOT})
_SINGLE_CHAR_TOKENS: Final = {"=": _T.ASSIGN, "|": _T.PIPE}


@dataclass(frozen=True, slots=True)
class _Token:
    typ: _T
    val: str
    pos: int


def _is_alnum(c: str) -> bool:
    return c == "_" or c.isalpha() or unicodedata.category(c) == "Nd"


def _has_left_trim(s: str, p: int) -> bool:
    return p + 1 < len(s) and s[p] == "-" and s[p + 1] in _SPACE_SET


def _left_trim_len(s: str, p: int) -> int:
    n = p
    while n < len(s) and s[n] in _SPACE_SET:
        n += 1
    return n - p


_State = Callable[[], "_State | None"]


class _Lexer:
    """Turns template source into tokens; a lexical error becomes a final ERROR token.

    Emitting the error as a token (instead of raising) keeps Go's behaviour of reporting the
    first problem the *parser* reaches.
    """

    def __init__(self, src: str) -> None:
        self.src = src
        self.pos = 0
        self.start = 0
        self.paren_depth = 0
        self.tokens: list[_Token] = []

    def run(self) -> list[_Token]:
        state: _State | None = self._text
        while state is not None:
            state = state()
        return self.tokens

    def _emit(self, typ: _T) -> None:
        self.tokens.append(_Token(typ, self.src[self.start : self.pos], self.start))
        self.start = self.pos

    def _fail(self, message: str) -> _State | None:
        """Emit the error token and stop lexing (returns the "no next state" marker)."""
        self.tokens.append(_Token(_T.ERROR, message, self.start))
        return None

    def _text(self) -> _State | None:
        src = self.src
        x = src.find(_LEFT_DELIM, self.pos)
        if x < 0:
            self.pos = len(src)
            if self.pos > self.start:
                self._emit(_T.TEXT)
            self._emit(_T.EOF)
            return None
        end = x
        if _has_left_trim(src, x + len(_LEFT_DELIM)):
            end = self.start + len(src[self.start : x].rstrip(_SPACE))
        if end > self.start:
            self.tokens.append(_Token(_T.TEXT, src[self.start : end], self.start))
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
        self._emit(_T.LEFT)
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
        self._emit(_T.RIGHT)
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
                self._emit(_T.DECLARE)
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
            self._emit(_T.LPAREN)
            return self._inside
        if c == ")":
            self.paren_depth -= 1
            if self.paren_depth < 0:
                return self._fail("unexpected right paren")
            self._emit(_T.RPAREN)
            return self._inside
        if c.isascii() and c.isprintable():
            self._emit(_T.CHAR)
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
        self._emit(_T.SPACE)
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
            self._emit(_T.BOOL)
        else:
            self._emit(_T.IDENT)
        return self._inside

    def _field(self) -> _State | None:
        if self._at_terminator():  # a lone "."
            self._emit(_T.DOT)
            return self._inside
        if not self._scan_word():
            return None
        self._emit(_T.FIELD)
        return self._inside

    def _variable(self) -> _State | None:
        if not self._at_terminator() and not self._scan_word():
            return None
        self._emit(_T.VARIABLE)
        return self._inside

    def _quoted(self, quote: str, typ: _T, what: str) -> _State | None:
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
        return self._quoted('"', _T.STRING, "quoted string")

    def _char(self) -> _State | None:
        return self._quoted("'", _T.CHAR_CONST, "character constant")

    def _raw_quote(self) -> _State | None:
        x = self.src.find("`", self.pos)
        if x < 0:
            return self._fail("unterminated raw quoted string")
        self.pos = x + 1
        self._emit(_T.RAW_STRING)
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
            return self._fail(f"bad number syntax: {_go_quote(self.src[self.start : self.pos])}")
        if self.pos < len(self.src) and self.src[self.pos] in "+-":
            if not self._scan_number() or self.src[self.pos - 1] != "i":
                return self._fail(f"bad number syntax: {_go_quote(self.src[self.start : self.pos])}")
            self._emit(_T.COMPLEX)
            return self._inside
        self._emit(_T.NUMBER)
        return self._inside


# ---------------------------------------------------------------------------------------------
# Syntax tree
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Text:
    pos: int
    text: str


@dataclass(slots=True, eq=False)
class _Field:
    pos: int
    idents: tuple[str, ...]

    def __str__(self) -> str:
        return "".join("." + i for i in self.idents)


@dataclass(slots=True, eq=False)
class _Variable:
    pos: int
    idents: tuple[str, ...]  # idents[0] is the variable name including "$"

    def __str__(self) -> str:
        return ".".join(self.idents)


@dataclass(slots=True, eq=False)
class _Dot:
    pos: int

    def __str__(self) -> str:
        return "."


@dataclass(slots=True, eq=False)
class _Nil:
    pos: int

    def __str__(self) -> str:
        return "nil"


@dataclass(slots=True, eq=False)
class _Bool:
    pos: int
    value: bool

    def __str__(self) -> str:
        return "true" if self.value else "false"


@dataclass(slots=True, eq=False)
class _Number:
    pos: int
    text: str
    value: int | float

    def __str__(self) -> str:
        return self.text


@dataclass(slots=True, eq=False)
class _String:
    pos: int
    quoted: str
    text: str

    def __str__(self) -> str:
        return self.quoted


@dataclass(slots=True, eq=False)
class _Identifier:
    pos: int
    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(slots=True, eq=False)
class _Chain:
    pos: int
    node: _Arg
    fields: tuple[str, ...]

    def __str__(self) -> str:
        inner = f"({self.node})" if isinstance(self.node, _Pipe) else str(self.node)
        return inner + "".join("." + f for f in self.fields)


@dataclass(slots=True, eq=False)
class _Command:
    pos: int
    args: list[_Arg]

    def __str__(self) -> str:
        return " ".join(f"({a})" if isinstance(a, _Pipe) else str(a) for a in self.args)


@dataclass(slots=True, eq=False)
class _Pipe:
    pos: int
    decl: list[str]
    is_assign: bool
    cmds: list[_Command]

    def __str__(self) -> str:
        head = f"{', '.join(self.decl)} {'=' if self.is_assign else ':='} " if self.decl else ""
        return head + " | ".join(str(c) for c in self.cmds)


@dataclass(slots=True, eq=False)
class _Action:
    pos: int
    pipe: _Pipe


@dataclass(slots=True, eq=False)
class _List:
    pos: int
    nodes: list[_Node]


@dataclass(slots=True, eq=False)
class _Branch:
    """An ``if``, ``with`` or ``range`` block (``kind``); ``else if`` nests another branch."""

    pos: int
    kind: str
    pipe: _Pipe
    body: _List
    else_body: _List | None


@dataclass(slots=True, eq=False)
class _Break:
    pos: int


@dataclass(slots=True, eq=False)
class _Continue:
    pos: int


@dataclass(slots=True, eq=False)
class _End:  # parser-internal: {{end}}
    pos: int

    def __str__(self) -> str:
        return "{{end}}"


@dataclass(slots=True, eq=False)
class _Else:  # parser-internal: {{else}}
    pos: int

    def __str__(self) -> str:
        return "{{else}}"


_Arg = _Field | _Variable | _Dot | _Nil | _Bool | _Number | _String | _Identifier | _Chain | _Pipe
_Node = _Text | _Action | _List | _Branch | _Break | _Continue


# ---------------------------------------------------------------------------------------------
# Parser (mirrors text/template/parse/parse.go)
# ---------------------------------------------------------------------------------------------


class _ParseError(Exception):
    def __init__(self, message: str, pos: int) -> None:
        super().__init__(message)
        self.message = message
        self.pos = pos


_OPERAND_START: Final = frozenset(
    {
        _T.BOOL,
        _T.CHAR_CONST,
        _T.COMPLEX,
        _T.DOT,
        _T.FIELD,
        _T.IDENT,
        _T.NUMBER,
        _T.NIL,
        _T.RAW_STRING,
        _T.STRING,
        _T.VARIABLE,
        _T.LPAREN,
    }
)


class _Parser:
    def __init__(self, tokens: list[_Token], funcs: Iterable[str]) -> None:
        self.tokens = tokens
        self.i = 0
        self.funcs = frozenset(funcs)
        self.vars: list[str] = ["$"]
        self.range_depth = 0
        self.last_pos = 0

    # -- token stream ------------------------------------------------------------------------

    def fail(self, message: str, pos: int | None = None) -> NoReturn:
        raise _ParseError(message, self.last_pos if pos is None else pos)

    def next(self) -> _Token:
        tok = self.tokens[min(self.i, len(self.tokens) - 1)]
        self.i += 1
        self.last_pos = tok.pos
        if tok.typ is _T.ERROR:
            self.fail(tok.val, tok.pos)
        return tok

    def backup(self) -> None:
        self.i -= 1

    def peek(self) -> _Token:
        tok = self.next()
        self.backup()
        return tok

    def next_non_space(self) -> _Token:
        tok = self.next()
        while tok.typ is _T.SPACE:
            tok = self.next()
        return tok

    def peek_non_space(self) -> _Token:
        tok = self.next_non_space()
        self.backup()
        return tok

    def expect(self, typ: _T, context: str) -> _Token:
        tok = self.next_non_space()
        if tok.typ is not typ:
            self.unexpected(tok, context)
        return tok

    def unexpected(self, tok: _Token, context: str) -> NoReturn:
        self.fail(f"unexpected {_describe_token(tok)} in {context}", tok.pos)

    # -- grammar -------------------------------------------------------------------------------

    def parse(self) -> _List:
        root = _List(0, [])
        while self.peek().typ is not _T.EOF:
            node = self.text_or_action()
            if isinstance(node, _End | _Else):
                self.fail(f"unexpected {node}", node.pos)
            root.nodes.append(node)
        return root

    def text_or_action(self) -> _Node | _End | _Else:
        tok = self.next_non_space()
        if tok.typ is _T.TEXT:
            return _Text(tok.pos, tok.val)
        if tok.typ is _T.LEFT:
            return self.action()
        self.unexpected(tok, "input")

    def item_list(self) -> tuple[_List, _End | _Else]:
        items = _List(self.peek_non_space().pos, [])
        while self.peek_non_space().typ is not _T.EOF:
            node = self.text_or_action()
            if isinstance(node, _End | _Else):
                return items, node
            items.nodes.append(node)
        self.fail("unexpected EOF")

    def action(self) -> _Node | _End | _Else:
        tok = self.next_non_space()
        typ = tok.typ
        if typ in (_T.BLOCK, _T.DEFINE, _T.TEMPLATE):
            self.fail(f"{{{{{tok.val}}}}} is not supported", tok.pos)
        if typ is _T.BREAK or typ is _T.CONTINUE:
            return self.loop_control(tok)
        if typ is _T.ELSE:
            return self.else_control()
        if typ is _T.END:
            self.expect(_T.RIGHT, "end")
            return _End(tok.pos)
        if typ in (_T.IF, _T.RANGE, _T.WITH):
            return self.branch(tok.val, tok.pos)
        self.backup()
        start = self.peek_non_space().pos
        return _Action(start, self.pipeline("command", _T.RIGHT))

    def loop_control(self, tok: _Token) -> _Break | _Continue:
        nxt = self.next_non_space()
        if nxt.typ is not _T.RIGHT:
            self.unexpected(nxt, f"{{{{{tok.val}}}}}")
        if self.range_depth == 0:
            self.fail(f"{{{{{tok.val}}}}} outside {{{{range}}}}", tok.pos)
        return _Break(tok.pos) if tok.typ is _T.BREAK else _Continue(tok.pos)

    def else_control(self) -> _Else:
        peek = self.peek_non_space()
        if peek.typ in (_T.IF, _T.WITH):
            # "{{else if ...}}" is "{{else}}{{if ...}}...{{end}}" sharing the outer {{end}}.
            return _Else(peek.pos)
        tok = self.expect(_T.RIGHT, "else")
        return _Else(tok.pos)

    def branch(self, kind: str, pos: int) -> _Branch:
        saved_vars = len(self.vars)
        try:
            pipe = self.pipeline(kind, _T.RIGHT)
            if kind == "range":
                self.range_depth += 1
            body, nxt = self.item_list()
            if kind == "range":
                self.range_depth -= 1
            else_body: _List | None = None
            if isinstance(nxt, _Else):
                follow = self.peek().typ
                if (kind, follow) in (("if", _T.IF), ("with", _T.WITH)):
                    tok = self.next()
                    else_body = _List(nxt.pos, [self.branch(kind, tok.pos)])
                else:
                    else_body, nxt = self.item_list()
                    if not isinstance(nxt, _End):
                        self.fail(f"expected end; found {nxt}", nxt.pos)
            return _Branch(pos, kind, pipe, body, else_body)
        finally:
            del self.vars[saved_vars:]

    def pipeline(self, context: str, end: _T) -> _Pipe:
        pipe = _Pipe(self.peek_non_space().pos, [], False, [])
        while self.peek_non_space().typ is _T.VARIABLE:  # declarations
            start = self.i
            var = self.next_non_space()
            nxt = self.peek_non_space()
            if nxt.typ in (_T.ASSIGN, _T.DECLARE):
                pipe.is_assign = nxt.typ is _T.ASSIGN
                self.next_non_space()
                pipe.decl.append(var.val)
                self.vars.append(var.val)
                break
            if nxt.typ is _T.CHAR and nxt.val == ",":
                self.next_non_space()
                pipe.decl.append(var.val)
                self.vars.append(var.val)
                if context == "range" and len(pipe.decl) < 2:
                    if self.peek_non_space().typ in (_T.VARIABLE, _T.RIGHT, _T.RPAREN):
                        continue
                    self.fail("range can only initialize variables")
                self.fail(f"too many declarations in {context}")
            self.i = start  # the variable is an operand, not a declaration
            break
        while True:
            tok = self.next_non_space()
            if tok.typ is end:
                self.check_pipeline(pipe, context)
                return pipe
            if tok.typ in _OPERAND_START:
                self.backup()
                pipe.cmds.append(self.command())
            else:
                self.unexpected(tok, context)

    def check_pipeline(self, pipe: _Pipe, context: str) -> None:
        if not pipe.cmds:
            self.fail(f"missing value for {context}")
        for stage, cmd in enumerate(pipe.cmds[1:], start=2):
            if isinstance(cmd.args[0], _Bool | _Dot | _Nil | _Number | _String):
                self.fail(f"non executable command in pipeline stage {stage}", cmd.pos)

    def command(self) -> _Command:
        cmd = _Command(self.peek_non_space().pos, [])
        while True:
            self.peek_non_space()
            operand = self.operand()
            if operand is not None:
                cmd.args.append(operand)
            tok = self.next()
            if tok.typ is _T.SPACE:
                continue
            if tok.typ in (_T.RIGHT, _T.RPAREN):
                self.backup()
            elif tok.typ is not _T.PIPE:
                self.unexpected(tok, "operand")
            break
        if not cmd.args:
            self.fail("empty command", cmd.pos)
        return cmd

    def operand(self) -> _Arg | None:
        node = self.term()
        if node is None or self.peek().typ is not _T.FIELD:
            return node
        fields: list[str] = []
        while self.peek().typ is _T.FIELD:
            fields.append(self.next().val[1:])
        if isinstance(node, _Field):
            return _Field(node.pos, node.idents + tuple(fields))
        if isinstance(node, _Variable):
            return _Variable(node.pos, node.idents + tuple(fields))
        if isinstance(node, _Bool | _String | _Number | _Nil | _Dot):
            self.fail(f"unexpected . after term {_go_quote(str(node))}", node.pos)
        return _Chain(node.pos, node, tuple(fields))

    def term(self) -> _Arg | None:
        tok = self.next_non_space()
        typ = tok.typ
        if typ is _T.IDENT:
            if tok.val not in self.funcs:
                self.fail(f"function {_go_quote(tok.val)} not defined", tok.pos)
            return _Identifier(tok.pos, tok.val)
        if typ is _T.DOT:
            return _Dot(tok.pos)
        if typ is _T.NIL:
            return _Nil(tok.pos)
        if typ is _T.VARIABLE:
            if tok.val not in self.vars:
                self.fail(f"undefined variable {_go_quote(tok.val)}", tok.pos)
            return _Variable(tok.pos, (tok.val,))
        if typ is _T.FIELD:
            return _Field(tok.pos, (tok.val[1:],))
        if typ is _T.BOOL:
            return _Bool(tok.pos, tok.val == "true")
        if typ in (_T.CHAR_CONST, _T.COMPLEX, _T.NUMBER):
            return _Number(tok.pos, tok.val, self.number_value(tok))
        if typ is _T.LPAREN:
            return self.pipeline("parenthesized pipeline", _T.RPAREN)
        if typ in (_T.STRING, _T.RAW_STRING):
            return _String(tok.pos, tok.val, self.unquote(tok))
        self.backup()
        return None

    def number_value(self, tok: _Token) -> int | float:
        text = tok.val
        if tok.typ is _T.CHAR_CONST:
            return self.unquote_char(tok)
        if tok.typ is _T.COMPLEX:
            self.fail("complex constants are not supported", tok.pos)
        clean = text.replace("_", "")
        negative = clean.startswith("-")
        body = clean.lstrip("+-")
        prefix = body[:2].lower()
        try:
            if prefix == "0x" and "p" in body.lower():
                return float.fromhex(clean)
            if prefix != "0x" and any(c in body for c in ".eE"):
                return float(clean)
            if prefix in ("0x", "0o", "0b"):
                value = int(body, 0)
            elif len(body) > 1 and body[0] == "0":
                value = int(body, 8)  # Go: a leading 0 means octal
            else:
                value = int(body, 10)
        except ValueError:
            self.fail(f"illegal number syntax: {_go_quote(text)}", tok.pos)
        return -value if negative else value  # range-checked when evaluated, as in Go

    def unquote(self, tok: _Token) -> str:
        text = tok.val
        if tok.typ is _T.RAW_STRING:
            return text[1:-1].replace("\r", "")  # strconv.Unquote drops CRs from raw strings
        try:
            return _unquote_escapes(text[1:-1], '"')
        except ValueError:
            self.fail(f"invalid syntax in string {text}", tok.pos)

    def unquote_char(self, tok: _Token) -> int:
        body = tok.val[1:-1]
        try:
            if body.startswith("\\"):
                raw = _unquote_escapes(body, "'").encode("utf-8", "surrogateescape")
                if len(raw) == 1:
                    return raw[0]
                decoded = raw.decode("utf-8")
            else:
                decoded = body
            if len(decoded) != 1:
                raise ValueError(body)
        except (ValueError, UnicodeError):
            self.fail(f"malformed character constant: {tok.val}", tok.pos)
        return ord(decoded)


_SIMPLE_ESCAPES: Final = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\\": "\\",
}


def _unquote_escapes(body: str, quote: str) -> str:
    """Decode Go escape sequences; ``\\x``/octal escapes may yield raw (non-UTF-8) bytes."""
    out = bytearray()
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out += c.encode("utf-8", "surrogatepass")
            i += 1
            continue
        if i + 1 >= len(body):
            raise ValueError("trailing backslash")
        e = body[i + 1]
        i += 2
        if e in _SIMPLE_ESCAPES:
            out += _SIMPLE_ESCAPES[e].encode()
        elif e == quote:
            out += e.encode()
        elif e in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[e]
            digits = body[i : i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise ValueError("bad hex escape")
            value = int(digits, 16)
            i += width
            if e == "x":
                out.append(value)
            else:
                if value > 0x10FFFF or 0xD800 <= value <= 0xDFFF:
                    raise ValueError("bad unicode escape")
                out += chr(value).encode()
        elif e in "01234567":
            digits = body[i - 1 : i + 2]
            if len(digits) != 3 or any(d not in "01234567" for d in digits) or int(digits, 8) > 255:
                raise ValueError("bad octal escape")
            out.append(int(digits, 8))
            i += 2
        else:
            raise ValueError(f"unknown escape \\{e}")
    return out.decode("utf-8", "surrogateescape")


def _describe_token(tok: _Token) -> str:
    """Render a token the way Go's parse errors do (``<if>``, ``"foo"``, ``EOF``)."""
    if tok.typ is _T.EOF:
        return "EOF"
    if tok.typ is _T.ERROR:
        return tok.val
    if tok.typ in _KEYWORD_TYPES:
        return f"<{tok.val}>"
    if len(tok.val) > 10:
        return _go_quote(tok.val[:10]) + "..."
    return _go_quote(tok.val)


# ---------------------------------------------------------------------------------------------
# Go value model: structs, typed slices and maps, fmt and encoding/json behaviour
# ---------------------------------------------------------------------------------------------

# How a struct field is omitted by encoding/json: never, when its typed value is empty
# ("omitempty" on a string/slice/map/number), or only when nil (omitempty on an `any` field).
_KEEP: Final = 0
_OMIT_EMPTY: Final = 1
_OMIT_NIL: Final = 2
_JSONLayout = tuple[tuple[str, str, int], ...]


class _Struct:
    """A Go struct value: template field access by Go name, JSON by its struct tags.

    Unlike a mapping, a struct is always truthy, can't be ranged over, and accessing a field it
    doesn't have is an execution error, as in Go.
    """

    __slots__ = ("fields", "layout", "stringer", "type_name")

    def __init__(
        self,
        type_name: str,
        fields: dict[str, Any],
        layout: _JSONLayout | None = None,
        *,
        stringer: bool = False,
    ) -> None:
        self.type_name = type_name
        self.fields = fields
        self.layout = layout if layout is not None else tuple((k, k, _KEEP) for k in fields)
        self.stringer = stringer  # has a String() method that prints its JSON


class _GoSlice(list[Any]):
    """A Go slice: nil marshals to JSON ``null`` (empty to ``[]``); may print via String()."""

    __slots__ = ("is_nil", "stringer", "type_name")

    def __init__(
        self,
        items: Iterable[Any] = (),
        *,
        is_nil: bool = False,
        stringer: bool = False,
        type_name: str = "[]interface {}",
    ) -> None:
        super().__init__(items)
        self.is_nil = is_nil and not self
        self.stringer = stringer
        self.type_name = type_name


class _GoMap(dict[str, Any]):
    """A Go map (JSON keys sorted, like encoding/json) or an ordered map (``sort_keys=False``)."""

    __slots__ = ("is_nil", "sort_keys", "stringer", "type_name")

    def __init__(
        self,
        items: Mapping[str, Any] | None = None,
        *,
        sort_keys: bool = True,
        stringer: bool = False,
        type_name: str = "map[string]interface {}",
    ) -> None:
        super().__init__(items or {})
        self.is_nil = items is None
        self.sort_keys = sort_keys
        self.stringer = stringer
        self.type_name = type_name


class _PropertyType(list[str]):
    """Ollama's ``api.PropertyType``: one JSON-schema type prints/marshals as a bare string."""

    __slots__ = ()


def _type_name(v: Any) -> str:
    if v is None:
        return "<nil>"
    if isinstance(v, _Struct | _GoSlice | _GoMap):
        return v.type_name
    if isinstance(v, _PropertyType):
        return "api.PropertyType"
    names: tuple[tuple[type | tuple[type, ...], str], ...] = (
        (bool, "bool"),
        (int, "int"),
        (float, "float64"),
        (complex, "complex128"),
        (str, "string"),
        ((bytes, bytearray), "[]uint8"),
        ((list, tuple), "[]interface {}"),
        (Mapping, "map[string]interface {}"),
    )
    for types, name in names:
        if isinstance(v, types):
            return name
    return type(v).__name__


def _truth(v: Any) -> bool:
    """Go's template truthiness: false, 0, nil and empty strings/slices/maps are false."""
    if v is None:
        return False
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float | complex):
        return v != 0
    if isinstance(v, str | bytes | bytearray | list | tuple | Mapping):
        return len(v) > 0
    return True


def _sort_key(k: Any) -> tuple[int, Any]:
    # fmtsort: keys of one kind compare naturally; mixed kinds (impossible in Go) group by kind.
    if isinstance(k, bool):
        return (0, k)
    if isinstance(k, int | float):
        return (1, k)
    if isinstance(k, str):
        return (2, k)
    return (3, repr(k))


def _sorted_items(m: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    return [(k, m[k]) for k in sorted(m, key=_sort_key)]


def _to_bytes(s: str) -> bytes:
    """Go strings are bytes; invalid UTF-8 survives as surrogate escapes."""
    try:
        return s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogatepass")


def _from_bytes(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def _float_digits(a: float) -> tuple[str, int]:
    """Shortest round-trip digits of a positive finite float and its decimal-point position."""
    _, digits, exp = Decimal(repr(a)).normalize().as_tuple()
    assert isinstance(exp, int)
    text = "".join(map(str, digits))
    return text, len(text) + exp


def _float_special(f: float) -> str | None:
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    return None


def _fmt_float_e(f: float) -> str:
    """strconv.FormatFloat(f, 'e', -1, 64)."""
    if f == 0:
        return ("-" if math.copysign(1, f) < 0 else "") + "0e+00"
    digits, dp = _float_digits(abs(f))
    mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    exp = dp - 1
    return ("-" if f < 0 else "") + f"{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"


def _fmt_float_f(f: float) -> str:
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


def _fmt_float_g(f: float) -> str:
    """fmt's %v for float64: shortest digits, exponent form outside [1e-4, 1e6) as in Go."""
    special = _float_special(f)
    if special is not None:
        return special
    if f == 0:
        return "-0" if math.copysign(1, f) < 0 else "0"
    _, dp = _float_digits(abs(f))
    exp = dp - 1
    # strconv's %g with shortest precision switches to exponent form outside [1e-4, 1e6).
    if exp < -4 or exp >= 6:
        return _fmt_float_e(f)
    return _fmt_float_f(f)


def _go_stringer(v: Any) -> str | None:
    """The result of the value's Go String() method, for types that have one."""
    if isinstance(v, _PropertyType):
        if not v:
            return ""
        return v[0] if len(v) == 1 else "[" + " ".join(v) + "]"
    if isinstance(v, _Struct | _GoSlice) and v.stringer:
        return _json_or_empty(v)
    if isinstance(v, _GoMap) and v.stringer:
        return "{}" if v.is_nil else _json_or_empty(v)
    return None


def _fmt_v(v: Any) -> str:
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
        return _fmt_float_g(v)
    s = _go_stringer(v)
    if s is not None:
        return s
    if isinstance(v, bytes | bytearray):
        return "[" + " ".join(str(b) for b in v) + "]"
    if isinstance(v, _Struct):
        return "{" + " ".join(_fmt_v(x) for x in v.fields.values()) + "}"
    if isinstance(v, Mapping):
        return "map[" + " ".join(f"{_fmt_v(k)}:{_fmt_v(x)}" for k, x in _sorted_items(v)) + "]"
    if isinstance(v, list | tuple):
        return "[" + " ".join(_fmt_v(x) for x in v) + "]"
    if isinstance(v, complex):
        imag = _fmt_float_g(v.imag)
        sign = "" if imag.startswith(("-", "+")) else "+"
        return f"({_fmt_float_g(v.real)}{sign}{imag}i)"
    return str(v)


# -- encoding/json ------------------------------------------------------------------------------


class _JSONError(Exception):
    pass


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
        raise _JSONError(f"json: unsupported value: {_fmt_float_g(f)}")
    a = abs(f)
    if a != 0 and (a < 1e-6 or a >= 1e21):
        return re.sub(r"e-0(\d)$", r"e-\1", _fmt_float_e(f))
    return _fmt_float_f(f)


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
    raise _JSONError(f"json: unsupported type: map[{_type_name(k)}]interface {{}}")


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
    elif isinstance(v, _Struct):
        out.append("{")
        first = True
        for go_name, json_name, omit in v.layout:
            value = v.fields[go_name]
            if (omit == _OMIT_EMPTY and _is_empty(value)) or (omit == _OMIT_NIL and value is None):
                continue
            if not first:
                out.append(",")
            first = False
            out.append(_json_str(json_name) + ":")
            _json_into(value, out)
        out.append("}")
    elif isinstance(v, _PropertyType) and len(v) == 1:
        out.append(_json_str(v[0]))
    elif isinstance(v, _GoSlice | _GoMap) and v.is_nil:
        out.append("null")
    elif isinstance(v, Mapping):
        items = [(_json_key(k), x) for k, x in v.items()]
        if isinstance(v, _GoMap) and v.sort_keys:
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
        raise _JSONError(f"json: unsupported type: {_type_name(v)}")


def _json_encode(v: Any) -> str:
    """Go's json.Marshal: compact, HTML-safe; plain dicts keep their key order."""
    out: list[str] = []
    _json_into(v, out)
    return "".join(out)


def _json_or_empty(v: Any) -> str:
    # Ollama (and its String() methods) ignore marshalling errors: string(nil) == "".
    try:
        return _json_encode(v)
    except _JSONError:
        return ""


# -- fmt: quoting, Sprint, Sprintf ----------------------------------------------------------

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


def _go_quote(s: str) -> str:
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


def _go_quote_rune(n: int) -> str:
    """strconv.QuoteRune."""
    c = chr(n) if 0 <= n <= 0x10FFFF and not 0xD800 <= n <= 0xDFFF else "\ufffd"
    if c == "'":
        return "'\\''"
    if c == '"':
        return "'\"'"
    return "'" + _go_quote(c)[1:-1] + "'"


def _go_rune(c: str) -> str:
    """fmt's %#U: ``U+0041 'A'``."""
    return f"U+{ord(c):04X}" + (f" '{c}'" if c.isprintable() else "")


def _sprint(args: Sequence[Any]) -> str:
    """fmt.Sprint: spaces between operands when neither side is a string."""
    out: list[str] = []
    prev_is_string = False
    for i, a in enumerate(args):
        is_string = isinstance(a, str)
        if i and not is_string and not prev_is_string:
            out.append(" ")
        out.append(_fmt_v(a))
        prev_is_string = is_string
    return "".join(out)


_PRINTF_RE: Final = re.compile(r"%([-+# 0]*)(\*|\d+)?(?:\.(\*|\d*))?(?:\[(\d+)\])?(.?)", re.DOTALL)


def _bad_verb(verb: str, arg: Any) -> str:
    if arg is None:
        return f"%!{verb}(<nil>)"
    return f"%!{verb}({_type_name(arg)}={_fmt_v(arg)})"


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
        return _go_quote_rune(n)
    elif verb == "U":
        return f"U+{a:04X}"
    else:
        return None
    if prec is not None:
        digits = digits.rjust(prec, "0")
    return sign + digits


def _fmt_float(verb: str, f: float, flags: str, prec: int | None) -> str | None:
    special = _float_special(f)
    if special is not None:
        text = special
    elif verb in ("v", "g", "G") and prec is None:
        text = _fmt_float_g(f)
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
            text = _go_quote(arg if prec is None else arg[:prec])
        elif verb in ("x", "X"):
            text = _to_bytes(arg).hex()
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
        return _fmt_one(verb, _from_bytes(bytes(arg)), flags, width, prec)
    if isinstance(arg, Mapping):
        inner = " ".join(
            f"{_fmt_one(verb, k, flags, width, prec)}:{_fmt_one(verb, x, flags, width, prec)}"
            for k, x in _sorted_items(arg)
        )
        return f"map[{inner}]"
    if isinstance(arg, list | tuple | bytes | bytearray):
        return "[" + " ".join(_fmt_one(verb, x, flags, width, prec) for x in arg) + "]"
    if isinstance(arg, _Struct):
        return "{" + " ".join(_fmt_one(verb, x, flags, width, prec) for x in arg.fields.values()) + "}"
    return _pad(_fmt_v(arg), flags, width) if verb in ("v", "s") else _bad_verb(verb, arg)


def _sprintf(fmt: str, args: Sequence[Any]) -> str:
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
        out.append(_type_name(arg) if verb == "T" else _fmt_one(verb, arg, flags, width, prec))
        argi += 1
    if argi < len(args) and not reordered:
        extra = ", ".join("<nil>" if a is None else f"{_type_name(a)}={_fmt_v(a)}" for a in args[argi:])
        out.append(f"%!(EXTRA {extra})")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Functions
# ---------------------------------------------------------------------------------------------


class _FuncError(Exception):
    """A function's own error; reported as ``error calling NAME: ...`` like Go."""


class _ArgError(Exception):
    """A bad argument type, detected before the call; reported verbatim like Go."""


@dataclass(frozen=True, slots=True)
class _Func:
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
        raise _FuncError("missing argument for comparison")
    k1 = _basic_kind(a)
    for b in args[1:]:
        k2 = _basic_kind(b)
        if k1 != k2:
            if a is not None and b is not None:
                raise _FuncError("incompatible types for comparison")
            truth = False
        elif k1 == "other":
            if isinstance(a, list | tuple | Mapping | bytes | bytearray):
                raise _FuncError(f"non-comparable type {_fmt_v(a)}: {_type_name(a)}")
            if isinstance(b, list | tuple | Mapping | bytes | bytearray):
                raise _FuncError(f"non-comparable type {_fmt_v(b)}: {_type_name(b)}")
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
        raise _FuncError("invalid type for comparison")
    if k1 != k2:
        raise _FuncError("incompatible types for comparison")
    if k1 in ("bool", "complex"):
        raise _FuncError("invalid type for comparison")
    return bool(a < b)


def _le(args: list[Any]) -> bool:
    return _lt(args) or _eq(args)


def _length(args: list[Any]) -> int:
    v = args[0]
    if v is None:
        raise _FuncError("len of nil pointer")
    if isinstance(v, str):
        return len(_to_bytes(v))
    if isinstance(v, bytes | bytearray | list | tuple | Mapping):
        return len(v)
    raise _FuncError(f"len of type {_type_name(v)}")


def _index_arg(ix: Any, limit: int, *, inclusive: bool) -> int:
    if ix is None:
        raise _FuncError("cannot index slice/array with nil")
    if isinstance(ix, bool) or not isinstance(ix, int):
        raise _FuncError(f"cannot index slice/array with type {_type_name(ix)}")
    if ix < 0 or ix > limit or (ix == limit and not inclusive):
        raise _FuncError(f"index out of range: {ix}")
    return ix


def _index(args: list[Any]) -> Any:
    item = args[0]
    if item is None:
        raise _FuncError("index of untyped nil")
    for ix in args[1:]:
        if item is None:
            raise _FuncError("index of nil pointer")
        if isinstance(item, str):
            data = _to_bytes(item)
            item = data[_index_arg(ix, len(data), inclusive=False)]
        elif isinstance(item, bytes | bytearray | list | tuple):
            item = item[_index_arg(ix, len(item), inclusive=False)]
        elif isinstance(item, Mapping):
            # Template data maps are map[string]any: the key must be a string.
            if ix is None:
                raise _FuncError("value is nil; should be of type string")
            if not isinstance(ix, str) and all(isinstance(k, str) for k in item):
                raise _FuncError(f"value has type {_type_name(ix)}; should be string")
            try:
                item = item.get(ix)
            except TypeError:
                raise _FuncError(f"value has type {_type_name(ix)}; not a valid map key") from None
        else:
            raise _FuncError(f"can't index item of type {_type_name(item)}")
    return item


def _slice(args: list[Any]) -> Any:
    item, indexes = args[0], args[1:]
    if item is None:
        raise _FuncError("slice of untyped nil")
    if len(indexes) > 3:
        raise _FuncError(f"too many slice indexes: {len(indexes)}")
    if isinstance(item, str):
        if len(indexes) == 3:
            raise _FuncError("cannot 3-index slice a string")
        seq: Any = _to_bytes(item)
    elif isinstance(item, bytes | bytearray | list | tuple):
        seq = item
    else:
        raise _FuncError(f"can't slice item of type {_type_name(item)}")
    idx = [0, len(seq), len(seq)]
    for i, ix in enumerate(indexes):
        idx[i] = _index_arg(ix, len(seq), inclusive=True)
    if idx[0] > idx[1]:
        raise _FuncError(f"invalid slice index: {idx[0]} > {idx[1]}")
    if len(indexes) == 3 and idx[1] > idx[2]:
        raise _FuncError(f"invalid slice index: {idx[1]} > {idx[2]}")
    result = seq[idx[0] : idx[1]]
    if isinstance(item, str):
        return _from_bytes(result)
    if isinstance(item, _GoSlice):
        return _GoSlice(result, stringer=item.stringer, type_name=item.type_name)
    return result


def _escaper_input(args: list[Any]) -> str:
    if len(args) == 1 and isinstance(args[0], str):
        return args[0]
    return _sprint(args)


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
    return urllib.parse.quote_plus(_to_bytes(_escaper_input(args)), safe="")


def _printf(args: list[Any]) -> str:
    if not isinstance(args[0], str):
        raise _ArgError(f"wrong type for value; expected string; got {_type_name(args[0])}")
    return _sprintf(args[0], args[1:])


def _date_function(days_ago: int) -> Callable[[list[Any]], str]:
    def current(args: list[Any]) -> str:
        # Ollama accepts (and ignores) a layout argument; it must still be a string.
        for a in args:
            if not isinstance(a, str):
                raise _ArgError(f"wrong type for value; expected string; got {_type_name(a)}")
        return (_dt.date.today() - _dt.timedelta(days=days_ago)).isoformat()

    return current


# Go's builtins. "and"/"or" are evaluated lazily by the executor (call is unused).
_BUILTINS: Final[Mapping[str, _Func]] = {
    "and": _Func(lambda a: a[-1], 1, True),
    "or": _Func(lambda a: a[-1], 1, True),
    "not": _Func(lambda a: not _truth(a[0]), 1, False),
    "len": _Func(_length, 1, False),
    "index": _Func(_index, 1, True),
    "slice": _Func(_slice, 1, True),
    "eq": _Func(_eq, 1, True),
    "ne": _Func(lambda a: not _eq(a), 2, False),
    "lt": _Func(_lt, 2, False),
    "le": _Func(_le, 2, False),
    "gt": _Func(lambda a: not _le(a), 2, False),
    "ge": _Func(lambda a: not _lt(a), 2, False),
    "print": _Func(_sprint, 0, True),
    "printf": _Func(_printf, 1, True),
    "println": _Func(lambda a: " ".join(_fmt_v(x) for x in a) + "\n", 0, True),
    "html": _Func(_html, 0, True),
    "js": _Func(_js, 0, True),
    "urlquery": _Func(_urlquery, 0, True),
}

# Ollama's template.FuncMap (toTypeScriptType is not implemented).
_OLLAMA_FUNCS: Final[Mapping[str, _Func]] = {
    "json": _Func(lambda a: _json_or_empty(a[0]), 1, False),
    "currentDate": _Func(_date_function(0), 0, True, "string"),
    "yesterdayDate": _Func(_date_function(1), 0, True, "string"),
}

_ALL_FUNCS: Final[Mapping[str, _Func]] = {**_BUILTINS, **_OLLAMA_FUNCS}


# ---------------------------------------------------------------------------------------------
# Executor (mirrors text/template/exec.go)
# ---------------------------------------------------------------------------------------------


class _Missing:
    """Marks "no value piped in" (Go's missingVal)."""


_MISSING: Final = _Missing()


class _BreakSignal(Exception):
    pass


class _ContinueSignal(Exception):
    pass


class _Exec:
    def __init__(self, template: GoTemplate, data: Any, funcs: Mapping[str, _Func], nil_text: str) -> None:
        self.template = template
        self.funcs = funcs
        self.nil_text = nil_text
        self.vars: list[list[Any]] = [["$", data]]
        self.out: list[str] = []
        self.at: Any = None  # node being evaluated, for error messages

    def fail(self, message: str) -> NoReturn:
        pos = getattr(self.at, "pos", None)
        where = f"at <{self.at}>: " if isinstance(self.at, _Arg | _Command) else ""
        raise self.template._error(f"executing {where}{message}", pos)

    # -- variables ------------------------------------------------------------------------------

    def var_value(self, name: str) -> Any:
        for entry in reversed(self.vars):
            if entry[0] == name:
                return entry[1]
        self.fail(f"undefined variable: {name}")

    def set_var(self, name: str, value: Any) -> None:
        for entry in reversed(self.vars):
            if entry[0] == name:
                entry[1] = value
                return
        self.fail(f"undefined variable: {name}")

    # -- statements -----------------------------------------------------------------------------

    def walk(self, dot: Any, node: _Node) -> None:
        if isinstance(node, _Text):
            self.out.append(node.text)
        elif isinstance(node, _Action):
            value = self.eval_pipeline(dot, node.pipe)
            if not node.pipe.decl:
                self.out.append(self.nil_text if value is None else _fmt_v(value))
        elif isinstance(node, _List):
            for child in node.nodes:
                self.walk(dot, child)
        elif isinstance(node, _Branch):
            if node.kind == "range":
                self.walk_range(dot, node)
            else:
                self.walk_if_or_with(dot, node)
        elif isinstance(node, _Break):
            raise _BreakSignal
        elif isinstance(node, _Continue):
            raise _ContinueSignal

    def walk_if_or_with(self, dot: Any, node: _Branch) -> None:
        mark = len(self.vars)
        try:
            value = self.eval_pipeline(dot, node.pipe)
            if _truth(value):
                self.walk(value if node.kind == "with" else dot, node.body)
            elif node.else_body is not None:
                self.walk(dot, node.else_body)
        finally:
            del self.vars[mark:]

    def walk_range(self, dot: Any, node: _Branch) -> None:
        mark = len(self.vars)
        try:
            value = self.eval_pipeline(dot, node.pipe)
            items: Iterable[tuple[Any, Any]]
            if isinstance(value, list | tuple | bytes | bytearray):
                items = enumerate(value)
            elif isinstance(value, Mapping):
                items = _sorted_items(value)
            elif isinstance(value, int) and not isinstance(value, bool):
                if len(node.pipe.decl) > 1:
                    self.fail(f"can't use {value} to iterate over more than one variable")
                items = ((i, i) for i in range(value))
            elif value is None:
                items = ()
            else:
                self.fail(f"range can't iterate over {_fmt_v(value)}")
            body_mark = len(self.vars)
            ran = False
            try:
                for index, elem in items:
                    ran = True
                    self.one_iteration(node, index, elem, body_mark)
            except _BreakSignal:
                pass
            if not ran and node.else_body is not None:
                self.walk(dot, node.else_body)
        finally:
            del self.vars[mark:]

    def one_iteration(self, node: _Branch, index: Any, elem: Any, body_mark: int) -> None:
        decl, assign = node.pipe.decl, node.pipe.is_assign
        if decl:
            if assign:
                self.set_var(decl[0], index if len(decl) > 1 else elem)
            else:
                self.vars[-1][1] = elem  # the last declared variable gets the element
        if len(decl) > 1:
            if assign:
                self.set_var(decl[1], elem)
            else:
                self.vars[-2][1] = index
        try:
            self.walk(elem, node.body)
        except _ContinueSignal:
            pass
        finally:
            del self.vars[body_mark:]

    # -- expressions ----------------------------------------------------------------------------

    def eval_pipeline(self, dot: Any, pipe: _Pipe) -> Any:
        value: Any = _MISSING
        for cmd in pipe.cmds:
            value = self.eval_command(dot, cmd, value)
        for name in pipe.decl:
            if pipe.is_assign:
                self.set_var(name, value)
            else:
                self.vars.append([name, value])
        return value

    def eval_command(self, dot: Any, cmd: _Command, final: Any) -> Any:
        first = cmd.args[0]
        if isinstance(first, _Field):
            return self.eval_field_chain(dot, dot, first, first.idents, cmd.args, final)
        if isinstance(first, _Chain):
            return self.eval_chain(dot, first, cmd.args, final)
        if isinstance(first, _Identifier):
            return self.eval_function(dot, first, cmd.args[1:], final)
        if isinstance(first, _Variable):
            return self.eval_variable(dot, first, cmd.args, final)
        self.at = first
        if len(cmd.args) > 1 or final is not _MISSING:
            self.fail(f"can't give argument to non-function {first}")
        if isinstance(first, _Pipe):
            return self.eval_pipeline(dot, first)
        if isinstance(first, _Bool):
            return first.value
        if isinstance(first, _Dot):
            return dot
        if isinstance(first, _Nil):
            self.fail("nil is not a command")
        if isinstance(first, _Number):
            return self.number(first)
        assert isinstance(first, _String)
        return first.text

    def eval_variable(self, dot: Any, var: _Variable, args: Sequence[_Arg] | None, final: Any) -> Any:
        self.at = var
        value = self.var_value(var.idents[0])
        if len(var.idents) == 1:
            if (args is not None and len(args) > 1) or final is not _MISSING:
                self.fail(f"can't give argument to non-function {var}")
            return value
        return self.eval_field_chain(dot, value, var, var.idents[1:], args, final)

    def eval_chain(self, dot: Any, chain: _Chain, args: Sequence[_Arg] | None, final: Any) -> Any:
        self.at = chain
        if isinstance(chain.node, _Nil):
            self.fail(f"indirection through explicit nil in {chain}")
        receiver = self.eval_arg(dot, chain.node, None)
        return self.eval_field_chain(dot, receiver, chain, chain.fields, args, final)

    def eval_field_chain(
        self,
        dot: Any,
        receiver: Any,
        node: _Arg,
        idents: Sequence[str],
        args: Sequence[_Arg] | None,
        final: Any,
    ) -> Any:
        for name in idents[:-1]:
            receiver = self.eval_field(name, node, None, _MISSING, receiver)
        return self.eval_field(idents[-1], node, args, final, receiver)

    def eval_field(
        self, name: str, node: _Arg, args: Sequence[_Arg] | None, final: Any, receiver: Any
    ) -> Any:
        self.at = node
        if receiver is None:
            # A missing/nil value has no fields; like a zero struct, yield an empty value.
            return None
        has_args = (args is not None and len(args) > 1) or final is not _MISSING
        if isinstance(receiver, _Struct):
            if name not in receiver.fields:
                self.fail(f"can't evaluate field {name} in type {receiver.type_name}")
            if has_args:
                self.fail(f"{name} has arguments but cannot be invoked as function")
            return receiver.fields[name]
        if isinstance(receiver, Mapping):
            if has_args:
                self.fail(f"{name} is not a method but has arguments")
            return receiver.get(name)
        self.fail(f"can't evaluate field {name} in type {_type_name(receiver)}")

    def eval_function(self, dot: Any, ident: _Identifier, arg_nodes: Sequence[_Arg], final: Any) -> Any:
        self.at = ident
        name = ident.name
        fn = self.funcs.get(name)
        if fn is None:
            self.fail(f"{_go_quote(name)} is not a defined function")
        num_in = len(arg_nodes) + (0 if final is _MISSING else 1)
        if fn.variadic and num_in < fn.min_args:
            self.fail(f"wrong number of args for {name}: want at least {fn.min_args} got {len(arg_nodes)}")
        if not fn.variadic and num_in != fn.min_args:
            self.fail(f"wrong number of args for {name}: want {fn.min_args} got {num_in}")
        if name in ("and", "or"):
            # Go 1.18+: evaluate lazily and return the deciding operand itself.
            want = name == "or"
            value: Any = None
            for node in arg_nodes:
                value = self.eval_arg(dot, node, fn.nil_type)
                if _truth(value) == want:
                    return value
            return value if final is _MISSING else final
        values = [self.eval_arg(dot, node, fn.nil_type) for node in arg_nodes]
        if final is not _MISSING:
            values.append(final)
        self.at = ident
        try:
            return fn.call(values)
        except _ArgError as e:
            self.fail(str(e))
        except _FuncError as e:
            self.fail(f"error calling {name}: {e}")

    def eval_arg(self, dot: Any, node: _Arg, nil_type: str | None) -> Any:
        self.at = node
        if isinstance(node, _Dot):
            return dot
        if isinstance(node, _Nil):
            if nil_type is not None:
                self.fail(f"cannot assign nil to {nil_type}")
            return None
        if isinstance(node, _Field):
            return self.eval_field_chain(dot, dot, node, node.idents, [node], _MISSING)
        if isinstance(node, _Variable):
            return self.eval_variable(dot, node, None, _MISSING)
        if isinstance(node, _Pipe):
            return self.eval_pipeline(dot, node)
        if isinstance(node, _Identifier):
            return self.eval_function(dot, node, (), _MISSING)
        if isinstance(node, _Chain):
            return self.eval_chain(dot, node, None, _MISSING)
        if isinstance(node, _Bool):
            return node.value
        if isinstance(node, _Number):
            return self.number(node)
        return node.text

    def number(self, node: _Number) -> int | float:
        value = node.value
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            self.fail(f"{node.text} overflows int")
        return value


def _repair_utf8(text: str) -> str:
    """Join bytes split by byte-wise string ops; leftover invalid bytes become U+FFFD."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:
        return text


# ---------------------------------------------------------------------------------------------
# Public template object
# ---------------------------------------------------------------------------------------------


class GoTemplate:
    """A Go ``text/template``, parsed once and executable many times (thread-safe).

    Parsing validates everything Go validates at parse time (syntax, declared variables, known
    functions) and raises :class:`TemplateError` naming the line and column.
    """

    def __init__(self, source: str, *, name: str = "") -> None:
        self._source = source
        self._name = name
        self._line_starts = [0, *(m.end() for m in re.finditer("\n", source))]
        self._ollama: _OllamaPlan | None = None
        try:
            self._root = _Parser(_Lexer(source).run(), _ALL_FUNCS).parse()
        except _ParseError as e:
            raise self._error(e.message, e.pos) from None

    @property
    def source(self) -> str:
        """The template text as given."""
        return self._source

    @property
    def name(self) -> str:
        """Name used to prefix error messages (may be empty)."""
        return self._name

    def execute(self, data: Mapping[str, Any]) -> str:
        """Render with ``data`` as both ``.`` and ``$``.

        Mapping keys are looked up by exact (Go-style, capitalised) field name; a missing key
        yields an empty value that prints as "" (the zero value templates expect), never an error.
        Raises :class:`TemplateError` on execution errors (bad index, wrong types, ...).
        """
        return self._run(self._root, data, _ALL_FUNCS, nil_text="")

    def _run(self, root: _List, data: Any, funcs: Mapping[str, _Func], *, nil_text: str) -> str:
        state = _Exec(self, data, funcs, nil_text)
        state.walk(data, root)
        return _repair_utf8("".join(state.out))

    def _error(self, message: str, pos: int | None) -> TemplateError:
        prefix = f"{self._name}: " if self._name else ""
        if pos is None:
            return TemplateError(f"template: {prefix}{message}")
        line = bisect.bisect_right(self._line_starts, pos)
        column = pos - self._line_starts[line - 1] + 1
        return TemplateError(
            f"template: {prefix}line {line}, column {column}: {message}", line=line, column=column
        )

    def __repr__(self) -> str:
        return f"GoTemplate(name={self._name!r}, source={self._source[:40]!r}...)"


# ---------------------------------------------------------------------------------------------
# Ollama semantics (template/template.go: Parse, Vars, Execute, collate, deleteNode)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _OllamaPlan:
    uses_messages: bool
    root: _List  # the tree Ollama executes (maybe with {{ .Response }} appended)
    final_root: _List | None  # legacy final turn: cut after the first .Response
    final_error: str | None  # why Go would panic building final_root


def _identifiers(node: Any) -> list[str]:
    """Ollama's Identifiers(): field and variable names, not descending into chains."""
    if isinstance(node, _List):
        return [name for child in node.nodes for name in _identifiers(child)]
    if isinstance(node, _Action):
        return _identifiers(node.pipe)
    if isinstance(node, _Branch):
        names = _identifiers(node.pipe) + _identifiers(node.body)
        return names + (_identifiers(node.else_body) if node.else_body is not None else [])
    if isinstance(node, _Pipe):
        return [name for cmd in node.cmds for arg in cmd.args for name in _identifiers(arg)]
    if isinstance(node, _Field | _Variable):
        return list(node.idents)
    return []


class _GoPanic(Exception):
    pass


def _cut_after_response(root: _List) -> _List:
    """Ollama's deleteNode(root, ...): drop every node after the first ``.Response`` field.

    Mirrors Go exactly, including what it does not visit (if/with/range conditions) and the
    case where it panics (a cut inside a branch that has an else branch).
    """
    cut = False

    def matches(node: Any) -> bool:
        nonlocal cut
        if isinstance(node, _Field) and "Response" in node.idents:
            cut = True
            return False
        return cut

    def walk(node: Any) -> Any:
        if matches(node):
            return None
        if isinstance(node, _List):
            return _List(node.pos, [w for child in node.nodes if (w := walk(child)) is not None])
        if isinstance(node, _Branch):
            if matches(node):  # Go walks the embedded BranchNode itself first
                raise _GoPanic
            body = walk(node.body)
            else_body = None
            if node.else_body is not None:
                else_body = walk(node.else_body)
                if else_body is None:
                    raise _GoPanic  # Go: nil.(*parse.ListNode) type assertion
            return _Branch(node.pos, node.kind, node.pipe, body, else_body)
        if isinstance(node, _Action):
            pipe = walk(node.pipe)
            return None if pipe is None else _Action(node.pos, pipe)
        if isinstance(node, _Pipe):
            cmds = []
            for cmd in node.cmds:
                args = [w for arg in cmd.args if (w := walk(arg)) is not None]
                if not args:
                    return None
                cmds.append(_Command(cmd.pos, args))
            return _Pipe(node.pos, node.decl, node.is_assign, cmds) if cmds else None
        return node

    result = walk(root)
    assert isinstance(result, _List)  # the root list is never deleted
    return result


def _ollama_plan(template: GoTemplate) -> _OllamaPlan:
    plan = template._ollama
    if plan is None:
        names = {name.lower() for name in _identifiers(template._root)}
        root = template._root
        if "messages" not in names and "response" not in names:
            response = _Action(
                len(template.source), _Pipe(0, [], False, [_Command(0, [_Field(0, ("Response",))])])
            )
            root = _List(root.pos, [*root.nodes, response])
        try:
            final_root, final_error = _cut_after_response(root), None
        except _GoPanic:
            final_root, final_error = None, "Ollama cannot render this legacy template (Go panics cutting it)"
        plan = _OllamaPlan("messages" in names, root, final_root, final_error)
        template._ollama = plan
    return plan


@dataclass(frozen=True, slots=True)
class _Message:
    """api.Message as decoded from Ollama's JSON API."""

    role: str
    content: str
    thinking: str = ""
    images: tuple[bytes, ...] | None = None
    tool_calls: tuple[Mapping[str, Any], ...] | None = None
    tool_name: str = ""
    tool_call_id: str = ""


def _str_field(m: Mapping[str, Any], key: str) -> str:
    value = m.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"{key!r} must be a string, got {type(value).__name__}")
    return value


def _decode_image(image: Any) -> bytes:
    if isinstance(image, bytes | bytearray):
        return bytes(image)
    if isinstance(image, str):
        return base64.b64decode(image)
    raise TypeError(f"images must be base64 strings or bytes, got {type(image).__name__}")


def _api_message(m: Mapping[str, Any]) -> _Message:
    images = m.get("images")
    tool_calls = m.get("tool_calls")
    return _Message(
        role=_str_field(m, "role").lower(),  # api.Message.UnmarshalJSON lower-cases the role
        content=_str_field(m, "content"),
        thinking=_str_field(m, "thinking"),
        images=None if images is None else tuple(_decode_image(i) for i in images),
        tool_calls=None if tool_calls is None else tuple(tool_calls),
        tool_name=_str_field(m, "tool_name"),
        tool_call_id=_str_field(m, "tool_call_id"),
    )


def _collate(messages: Sequence[_Message]) -> tuple[str, list[_Message]]:
    """Ollama's collate(): all system contents joined, consecutive same-role turns merged."""
    system: list[str] = []
    collated: list[_Message] = []
    for m in messages:
        if m.role == "system":
            system.append(m.content)
        if collated and collated[-1].role == m.role and m.role != "tool":
            collated[-1] = replace(collated[-1], content=collated[-1].content + "\n\n" + m.content)
        else:
            collated.append(m)
    return "\n\n".join(system), collated


def _go_any(v: Any) -> Any:
    """A JSON value as Go decodes it into ``any``: numbers are float64, objects are maps."""
    if isinstance(v, Mapping):
        return _GoMap({str(k): _go_any(x) for k, x in v.items()})
    if isinstance(v, list | tuple):
        return [_go_any(x) for x in v]
    if isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    return v


def _string_slice(v: Any) -> _GoSlice:
    if v is None:
        return _GoSlice(is_nil=True, type_name="[]string")
    return _GoSlice((str(x) for x in v), type_name="[]string")


_TOOL_LAYOUT: Final[_JSONLayout] = (
    ("Type", "type", _KEEP),
    ("Items", "items", _OMIT_NIL),
    ("Function", "function", _KEEP),
)
_TOOL_FUNCTION_LAYOUT: Final[_JSONLayout] = (
    ("Name", "name", _KEEP),
    ("Description", "description", _KEEP),
    ("Parameters", "parameters", _KEEP),
)
_TOOL_PARAMETERS_LAYOUT: Final[_JSONLayout] = (
    ("Type", "type", _KEEP),
    ("Defs", "$defs", _OMIT_NIL),
    ("Items", "items", _OMIT_NIL),
    ("Required", "required", _OMIT_EMPTY),
    ("Properties", "properties", _KEEP),
)
_TOOL_PROPERTY_LAYOUT: Final[_JSONLayout] = (
    ("AnyOf", "anyOf", _OMIT_EMPTY),
    ("Type", "type", _OMIT_EMPTY),
    ("Items", "items", _OMIT_NIL),
    ("Description", "description", _OMIT_EMPTY),
    ("Enum", "enum", _OMIT_EMPTY),
    ("Properties", "properties", _OMIT_NIL),
)


def _tool_property(p: Mapping[str, Any]) -> _Struct:
    any_of, enum_values, props, typ = p.get("anyOf"), p.get("enum"), p.get("properties"), p.get("type")
    types = [] if typ is None else [typ] if isinstance(typ, str) else [str(t) for t in typ]
    fields = {
        "AnyOf": _GoSlice(
            (_tool_property(x) for x in any_of or ()), is_nil=any_of is None, type_name="[]api.ToolProperty"
        ),
        "Type": _PropertyType(types),
        "Items": _go_any(p.get("items")),
        "Description": _str_field(p, "description"),
        "Enum": _GoSlice((_go_any(x) for x in enum_values or ()), is_nil=enum_values is None),
        # *api.ToolPropertiesMap keeps the caller's key order.
        "Properties": None
        if props is None
        else _GoMap(
            {k: _tool_property(v) for k, v in props.items()},
            sort_keys=False,
            type_name="*api.ToolPropertiesMap",
        ),
    }
    return _Struct("api.ToolProperty", fields, _TOOL_PROPERTY_LAYOUT)


def _template_tools(tools: Sequence[Mapping[str, Any]] | None) -> _GoSlice:
    """convertToolsForTemplate(): Tools prints as JSON; Properties become a sorted Go map."""
    result = _GoSlice(is_nil=tools is None, stringer=True, type_name="template.templateTools")
    for tool in tools or ():
        function = tool.get("function") or {}
        params = function.get("parameters") or {}
        props = params.get("properties")
        parameters = _Struct(
            "template.templateToolFunctionParameters",
            {
                "Type": _str_field(params, "type"),
                "Defs": _go_any(params.get("$defs")),
                "Items": _go_any(params.get("items")),
                "Required": _string_slice(params.get("required")),
                "Properties": _GoMap(
                    None if props is None else {k: _tool_property(v) for k, v in props.items()},
                    stringer=True,
                    type_name="template.templateProperties",
                ),
            },
            _TOOL_PARAMETERS_LAYOUT,
        )
        fn = _Struct(
            "template.templateToolFunction",
            {
                "Name": _str_field(function, "name"),
                "Description": _str_field(function, "description"),
                "Parameters": parameters,
            },
            _TOOL_FUNCTION_LAYOUT,
        )
        result.append(
            _Struct(
                "template.templateTool",
                {"Type": _str_field(tool, "type"), "Items": _go_any(tool.get("items")), "Function": fn},
                _TOOL_LAYOUT,
            )
        )
    return result


def _template_tool_call(call: Mapping[str, Any]) -> _Struct:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):  # OpenAI-style JSON text; Ollama's API carries an object
        arguments = _pyjson.loads(arguments) if arguments.strip() else None
    args = _GoMap(
        None if arguments is None else {str(k): _go_any(v) for k, v in arguments.items()},
        stringer=True,
        type_name="template.templateArgs",
    )
    index = function.get("index") or 0
    fn = _Struct(
        "template.templateToolCallFunction",
        {"Index": int(index), "Name": _str_field(function, "name"), "Arguments": args},
    )
    return _Struct("template.templateToolCall", {"ID": _str_field(call, "id"), "Function": fn})


def _template_message(m: _Message) -> _Struct:
    """convertMessagesForTemplate(): the struct templates see as an element of .Messages."""
    calls = [_template_tool_call(c) for c in m.tool_calls or ()]
    return _Struct(
        "*template.templateMessage",
        {
            "Role": m.role,
            "Content": m.content,
            "Thinking": m.thinking,
            "Images": _GoSlice(m.images or (), is_nil=m.images is None, type_name="[]api.ImageData"),
            "ToolCalls": _GoSlice(calls, is_nil=True, type_name="[]template.templateToolCall"),
            "ToolName": m.tool_name,
            "ToolCallID": m.tool_call_id,
        },
    )


def _think_values(think: bool | str | None) -> tuple[bool, str, bool]:
    """(Think, ThinkLevel, IsThinkSet) exactly as Ollama derives them from ``think``."""
    if think is None:
        return False, "", False
    if isinstance(think, bool):
        return think, "medium" if think else "", True
    if think in ("high", "medium", "low"):
        return True, think, True
    raise ValueError(f'invalid think value: {think!r} (must be "high", "medium", "low", true, or false)')


def render_ollama(
    template: GoTemplate,
    messages: Sequence[Mapping[str, Any]] = (),
    *,
    system: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    prompt: str = "",
    suffix: str = "",
    think: bool | str | None = None,
) -> str:
    """Render a chat exactly as Ollama's ``Template.Execute`` does.

    ``messages`` use Ollama's JSON API shape (``role``, ``content``, ``thinking``, ``images``,
    ``tool_calls``, ``tool_name``, ``tool_call_id``); ``tools`` likewise. Emulated behaviour:

    * Input assembly like the HTTP handlers: ``system`` is prepended as a system message unless
      the conversation already starts with one; ``prompt`` is appended as a user message
      (``/api/generate``); roles are lower-cased. With ``suffix`` (fill-in-the-middle) the
      template instead gets ``.Prompt``/``.Suffix`` and no messages.
    * ``collate``: ``.System`` is every system message joined by a blank line, and consecutive
      messages of the same role (except ``tool``) are merged with ``"\\n\\n"``.
    * Path selection: if ``prompt`` and ``suffix`` are both set, the FIM data is used. Else, if
      the template references ``messages`` anywhere (any field/variable name, case-insensitive),
      it runs once with ``.System .Messages .Tools`` and ``.Response == ""``.
    * Legacy templates: at parse time ``{{ .Response }}`` is appended when the template names
      neither ``messages`` nor ``response``. The template then runs once per turn with
      ``.System``/``.Prompt``/``.Response`` (a system message after a prompt or response, or a
      user message after a response, flushes the turn; tool messages are ignored), and the final
      turn runs on a copy of the tree with every node after the first ``.Response`` removed, so
      the prompt ends where the model's reply begins. That final pass has only Go's builtin
      functions (``json`` and ``currentDate`` fail there, as in Ollama).
    * Data shapes: messages/tools become the structs Ollama hands the template
      (``templateMessage``, ``templateTool``...): ``.Function.Arguments`` and ``.Tools`` print
      as JSON, Go maps marshal with sorted keys, JSON numbers are float64, fields that don't
      exist are errors, and a missing key or nil interface prints ``<no value>``.
    * ``think``: ``.Think``, ``.ThinkLevel`` (``true`` means "medium") and ``.IsThinkSet``.

    Not emulated: context-window truncation and ``[img-N]`` image tags, which Ollama's server
    applies to the messages before calling ``Template.Execute``.
    """
    if suffix and messages:
        raise ValueError("fill-in-the-middle rendering (suffix) takes prompt, not messages")
    think_on, think_level, think_set = _think_values(think)
    common = {"Think": think_on, "ThinkLevel": think_level, "IsThinkSet": think_set}
    plan = _ollama_plan(template)

    def run(root: _List, data: dict[str, Any], funcs: Mapping[str, _Func] = _ALL_FUNCS) -> str:
        # Ollama passes map[string]any: a missing key (or nil interface) prints "<no value>".
        return template._run(root, _GoMap(data), funcs, nil_text="<no value>")

    api_messages = [_api_message(m) for m in messages]
    if not suffix:
        if system and (not api_messages or api_messages[0].role != "system"):
            api_messages.insert(0, _Message(role="system", content=system))
        if prompt:
            api_messages.append(_Message(role="user", content=prompt))
    values_prompt = prompt if suffix else ""
    system_text, collated = _collate(api_messages)

    if values_prompt and suffix:
        return run(plan.root, {"Prompt": values_prompt, "Suffix": suffix, "Response": "", **common})
    if plan.uses_messages:
        data = {
            "System": system_text,
            "Messages": _GoSlice((_template_message(m) for m in collated), is_nil=True),
            "Tools": _template_tools(tools),
            "Response": "",
            **common,
        }
        return run(plan.root, data)

    out: list[str] = []
    turn = {"System": "", "Prompt": "", "Response": ""}

    def flush() -> None:
        out.append(run(plan.root, {**turn, **common}))
        turn.update(System="", Prompt="", Response="")

    for m in collated:
        if m.role == "system":
            if turn["Prompt"] or turn["Response"]:
                flush()
            turn["System"] = m.content
        elif m.role == "user":
            if turn["Response"]:
                flush()
            turn["Prompt"] = m.content
        elif m.role == "assistant":
            turn["Response"] = m.content
    if plan.final_root is None:
        raise TemplateError(plan.final_error or "cannot cut template")
    out.append(run(plan.final_root, {**turn, **common}, _BUILTINS))
    return "".join(out)
