"""Go's text/template parser (text/template/parse/parse.go).

It validates what Go validates at parse time (syntax, declared variables, known function names)
with Go's error messages, so a Modelfile TEMPLATE that Ollama rejects is rejected here too.
``define``/``template``/``block`` and complex numbers are refused: chat templates don't use them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, NoReturn

from sidecar.templates.gotemplate.lex import Token, TokenType, lex
from sidecar.templates.gotemplate.nodes import (
    ActionNode,
    ArgNode,
    BoolNode,
    BranchNode,
    BreakNode,
    ChainNode,
    CommandNode,
    ContinueNode,
    DotNode,
    FieldNode,
    IdentifierNode,
    ListNode,
    NilNode,
    Node,
    NumberNode,
    PipeNode,
    StringNode,
    TextNode,
    VariableNode,
)
from sidecar.templates.gotemplate.strconv import go_quote


def parse(source: str, funcs: Iterable[str]) -> ListNode:
    """The tree of ``source``; ``funcs`` are the function names it may call.

    Raises :class:`ParseError` at the first error, as Go does.
    """
    return _Parser(lex(source), funcs, source).parse()


class ParseError(Exception):
    """A syntax error at ``pos``; the template turns it into a TemplateError with line and column."""

    def __init__(self, message: str, pos: int) -> None:
        super().__init__(message)
        self.message = message
        self.pos = pos


_OPERAND_START: Final = frozenset(
    {
        TokenType.BOOL,
        TokenType.CHAR_CONST,
        TokenType.COMPLEX,
        TokenType.DOT,
        TokenType.FIELD,
        TokenType.IDENT,
        TokenType.NUMBER,
        TokenType.NIL,
        TokenType.RAW_STRING,
        TokenType.STRING,
        TokenType.VARIABLE,
        TokenType.LPAREN,
    }
)


@dataclass(slots=True, eq=False)
class _End:  # {{end}}: closes a list, never part of the tree
    pos: int

    def __str__(self) -> str:
        return "{{end}}"


@dataclass(slots=True, eq=False)
class _Else:  # {{else}}: closes a list, never part of the tree
    pos: int

    def __str__(self) -> str:
        return "{{else}}"


class _Parser:
    """parse.go's recursive descent over the token list, with its checks and error messages."""

    def __init__(self, tokens: list[Token], funcs: Iterable[str], source: str) -> None:
        self.tokens = tokens
        self.i = 0
        self.funcs = frozenset(funcs)
        self.vars: list[str] = ["$"]
        self.range_depth = 0
        self.last_pos = 0
        self.source = source
        self.action_at: int | None = None  # where the {{ of the action being parsed is (Tree.actionLine)

    # -- token stream ------------------------------------------------------------------------

    def fail(self, message: str, pos: int | None = None) -> NoReturn:
        raise ParseError(message, self.last_pos if pos is None else pos)

    def next(self) -> Token:
        tok = self.tokens[min(self.i, len(self.tokens) - 1)]
        self.i += 1
        self.last_pos = tok.pos
        if tok.typ is TokenType.ERROR:
            # A lexer error in an action begun on an earlier line says where it began (Tree.unexpected).
            line, extra = self.line(tok.pos), ""
            began = self.line(self.action_at) if self.action_at is not None else line
            if began != line:
                extra = f" in action started at :{began}"
                if tok.val.endswith(" action"):
                    extra = extra.removeprefix(" in action")  # not "action in action"
            self.fail(tok.val + extra, tok.pos)
        return tok

    def line(self, pos: int) -> int:
        return self.source.count("\n", 0, pos) + 1

    def backup(self) -> None:
        self.i -= 1

    def peek(self) -> Token:
        tok = self.next()
        self.backup()
        return tok

    def next_non_space(self) -> Token:
        tok = self.next()
        while tok.typ is TokenType.SPACE:
            tok = self.next()
        return tok

    def peek_non_space(self) -> Token:
        tok = self.next_non_space()
        self.backup()
        return tok

    def expect(self, typ: TokenType, context: str) -> Token:
        tok = self.next_non_space()
        if tok.typ is not typ:
            self.unexpected(tok, context)
        return tok

    def unexpected(self, tok: Token, context: str) -> NoReturn:
        self.fail(f"unexpected {tok} in {context}", tok.pos)

    # -- grammar -------------------------------------------------------------------------------

    def parse(self) -> ListNode:
        root = ListNode(0, [])
        while self.peek().typ is not TokenType.EOF:
            node = self.text_or_action()
            if isinstance(node, _End | _Else):
                self.fail(f"unexpected {node}", node.pos)
            root.nodes.append(node)
        return root

    def text_or_action(self) -> Node | _End | _Else:
        tok = self.next_non_space()
        if tok.typ is TokenType.TEXT:
            return TextNode(tok.pos, tok.val)
        if tok.typ is TokenType.LEFT:
            self.action_at = tok.pos  # its line is counted only if an error needs it
            try:
                return self.action()
            finally:
                self.action_at = None  # as Go clears it once the action is parsed
        self.unexpected(tok, "input")

    def item_list(self) -> tuple[ListNode, _End | _Else]:
        items = ListNode(self.peek_non_space().pos, [])
        while self.peek_non_space().typ is not TokenType.EOF:
            node = self.text_or_action()
            if isinstance(node, _End | _Else):
                return items, node
            items.nodes.append(node)
        self.fail("unexpected EOF")

    def action(self) -> Node | _End | _Else:
        tok = self.next_non_space()
        typ = tok.typ
        if typ in (TokenType.BLOCK, TokenType.DEFINE, TokenType.TEMPLATE):
            self.fail(f"{{{{{tok.val}}}}} is not supported", tok.pos)
        if typ is TokenType.BREAK or typ is TokenType.CONTINUE:
            return self.loop_control(tok)
        if typ is TokenType.ELSE:
            return self.else_control()
        if typ is TokenType.END:
            self.expect(TokenType.RIGHT, "end")
            return _End(tok.pos)
        if typ in (TokenType.IF, TokenType.RANGE, TokenType.WITH):
            return self.branch(tok.val, tok.pos)
        self.backup()
        start = self.peek_non_space().pos
        return ActionNode(start, self.pipeline("command", TokenType.RIGHT))

    def loop_control(self, tok: Token) -> BreakNode | ContinueNode:
        nxt = self.next_non_space()
        if nxt.typ is not TokenType.RIGHT:
            self.unexpected(nxt, f"{{{{{tok.val}}}}}")
        if self.range_depth == 0:
            self.fail(f"{{{{{tok.val}}}}} outside {{{{range}}}}", tok.pos)
        return BreakNode(tok.pos) if tok.typ is TokenType.BREAK else ContinueNode(tok.pos)

    def else_control(self) -> _Else:
        peek = self.peek_non_space()
        if peek.typ in (TokenType.IF, TokenType.WITH):
            # "{{else if ...}}" is "{{else}}{{if ...}}...{{end}}" sharing the outer {{end}}.
            return _Else(peek.pos)
        tok = self.expect(TokenType.RIGHT, "else")
        return _Else(tok.pos)

    def branch(self, kind: str, pos: int) -> BranchNode:
        saved_vars = len(self.vars)
        try:
            pipe = self.pipeline(kind, TokenType.RIGHT)
            if kind == "range":
                self.range_depth += 1
            body, nxt = self.item_list()
            if kind == "range":
                self.range_depth -= 1
            else_body: ListNode | None = None
            if isinstance(nxt, _Else):
                follow = self.peek().typ
                if (kind, follow) in (("if", TokenType.IF), ("with", TokenType.WITH)):
                    tok = self.next()
                    else_body = ListNode(nxt.pos, [self.branch(kind, tok.pos)])
                else:
                    else_body, nxt = self.item_list()
                    if not isinstance(nxt, _End):
                        self.fail(f"expected end; found {nxt}", nxt.pos)
            return BranchNode(pos, kind, pipe, body, else_body)
        finally:
            del self.vars[saved_vars:]

    def pipeline(self, context: str, end: TokenType) -> PipeNode:
        pipe = PipeNode(self.peek_non_space().pos, [], False, [])
        while self.peek_non_space().typ is TokenType.VARIABLE:  # declarations
            start = self.i
            var = self.next_non_space()
            nxt = self.peek_non_space()
            if nxt.typ in (TokenType.ASSIGN, TokenType.DECLARE):
                pipe.is_assign = nxt.typ is TokenType.ASSIGN
                self.next_non_space()
                pipe.decl.append(var.val)
                self.vars.append(var.val)
                break
            if nxt.typ is TokenType.CHAR and nxt.val == ",":
                self.next_non_space()
                pipe.decl.append(var.val)
                self.vars.append(var.val)
                if context == "range" and len(pipe.decl) < 2:
                    if self.peek_non_space().typ in (TokenType.VARIABLE, TokenType.RIGHT, TokenType.RPAREN):
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

    def check_pipeline(self, pipe: PipeNode, context: str) -> None:
        if not pipe.cmds:
            self.fail(f"missing value for {context}")
        for stage, cmd in enumerate(pipe.cmds[1:], start=2):
            if isinstance(cmd.args[0], BoolNode | DotNode | NilNode | NumberNode | StringNode):
                self.fail(f"non executable command in pipeline stage {stage}", cmd.pos)

    def command(self) -> CommandNode:
        cmd = CommandNode(self.peek_non_space().pos, [])
        while True:
            self.peek_non_space()
            operand = self.operand()
            if operand is not None:
                cmd.args.append(operand)
            tok = self.next()
            if tok.typ is TokenType.SPACE:
                continue
            if tok.typ in (TokenType.RIGHT, TokenType.RPAREN):
                self.backup()
            elif tok.typ is not TokenType.PIPE:
                self.unexpected(tok, "operand")
            break
        if not cmd.args:
            self.fail("empty command", cmd.pos)
        return cmd

    def operand(self) -> ArgNode | None:
        node = self.term()
        if node is None or self.peek().typ is not TokenType.FIELD:
            return node
        # Go places the whole chain at its first added field (parse.go, operand: newChain at the
        # peeked token), which execution errors then name: `.Prompt.Nope` fails at `.Nope`.
        at = self.peek().pos
        fields: list[str] = []
        while self.peek().typ is TokenType.FIELD:
            fields.append(self.next().val[1:])
        if isinstance(node, FieldNode):
            return FieldNode(at, node.idents + tuple(fields))
        if isinstance(node, VariableNode):
            return VariableNode(at, node.idents + tuple(fields))
        if isinstance(node, BoolNode | StringNode | NumberNode | NilNode | DotNode):
            self.fail(f"unexpected . after term {go_quote(str(node))}", node.pos)
        return ChainNode(at, node, tuple(fields))

    def term(self) -> ArgNode | None:
        tok = self.next_non_space()
        typ = tok.typ
        if typ is TokenType.IDENT:
            if tok.val not in self.funcs:
                self.fail(f"function {go_quote(tok.val)} not defined", tok.pos)
            return IdentifierNode(tok.pos, tok.val)
        if typ is TokenType.DOT:
            return DotNode(tok.pos)
        if typ is TokenType.NIL:
            return NilNode(tok.pos)
        if typ is TokenType.VARIABLE:
            if tok.val not in self.vars:
                self.fail(f"undefined variable {go_quote(tok.val)}", tok.pos)
            return VariableNode(tok.pos, (tok.val,))
        if typ is TokenType.FIELD:
            return FieldNode(tok.pos, (tok.val[1:],))
        if typ is TokenType.BOOL:
            return BoolNode(tok.pos, tok.val == "true")
        if typ in (TokenType.CHAR_CONST, TokenType.COMPLEX, TokenType.NUMBER):
            return NumberNode(tok.pos, tok.val, self.number_value(tok))
        if typ is TokenType.LPAREN:
            return self.pipeline("parenthesized pipeline", TokenType.RPAREN)
        if typ in (TokenType.STRING, TokenType.RAW_STRING):
            return StringNode(tok.pos, tok.val, self.unquote(tok))
        self.backup()
        return None

    def number_value(self, tok: Token) -> int | float:
        text = tok.val
        if tok.typ is TokenType.CHAR_CONST:
            return self.unquote_char(tok)
        if tok.typ is TokenType.COMPLEX:
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
            self.fail(f"illegal number syntax: {go_quote(text)}", tok.pos)
        return -value if negative else value  # range-checked when evaluated, as in Go

    def unquote(self, tok: Token) -> str:
        text = tok.val
        if tok.typ is TokenType.RAW_STRING:
            return text[1:-1].replace("\r", "")  # strconv.Unquote drops CRs from raw strings
        try:
            return _unquote_escapes(text[1:-1], '"')
        except ValueError:
            self.fail(f"invalid syntax in string {text}", tok.pos)

    def unquote_char(self, tok: Token) -> int:
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
