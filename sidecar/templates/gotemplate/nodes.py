"""The syntax tree of a Go template (text/template/parse/node.go).

Nodes carry their source offset (``pos``) so execution errors can name a line and column. Go's
IfNode, WithNode and RangeNode are one :class:`BranchNode` with a ``kind``; field chains on
``.`` and on variables are folded into one node, as Go's parser folds them. ``__str__`` renders
an argument the way Go prints it in error messages (``at <.Foo.Bar>``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class TextNode:
    pos: int
    text: str


@dataclass(slots=True, eq=False)
class FieldNode:
    pos: int
    idents: tuple[str, ...]

    def __str__(self) -> str:
        return "".join("." + i for i in self.idents)


@dataclass(slots=True, eq=False)
class VariableNode:
    pos: int
    idents: tuple[str, ...]  # idents[0] is the variable name including "$"

    def __str__(self) -> str:
        return ".".join(self.idents)


@dataclass(slots=True, eq=False)
class DotNode:
    pos: int

    def __str__(self) -> str:
        return "."


@dataclass(slots=True, eq=False)
class NilNode:
    pos: int

    def __str__(self) -> str:
        return "nil"


@dataclass(slots=True, eq=False)
class BoolNode:
    pos: int
    value: bool

    def __str__(self) -> str:
        return "true" if self.value else "false"


@dataclass(slots=True, eq=False)
class NumberNode:
    pos: int
    text: str
    value: int | float

    def __str__(self) -> str:
        return self.text


@dataclass(slots=True, eq=False)
class StringNode:
    pos: int
    quoted: str
    text: str

    def __str__(self) -> str:
        return self.quoted


@dataclass(slots=True, eq=False)
class IdentifierNode:
    pos: int
    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(slots=True, eq=False)
class ChainNode:
    pos: int
    node: ArgNode
    fields: tuple[str, ...]

    def __str__(self) -> str:
        inner = f"({self.node})" if isinstance(self.node, PipeNode) else str(self.node)
        return inner + "".join("." + f for f in self.fields)


@dataclass(slots=True, eq=False)
class CommandNode:
    pos: int
    args: list[ArgNode]

    def __str__(self) -> str:
        return " ".join(f"({a})" if isinstance(a, PipeNode) else str(a) for a in self.args)


@dataclass(slots=True, eq=False)
class PipeNode:
    pos: int
    decl: list[str]
    is_assign: bool
    cmds: list[CommandNode]

    def __str__(self) -> str:
        head = f"{', '.join(self.decl)} {'=' if self.is_assign else ':='} " if self.decl else ""
        return head + " | ".join(str(c) for c in self.cmds)


@dataclass(slots=True, eq=False)
class ActionNode:
    pos: int
    pipe: PipeNode


@dataclass(slots=True, eq=False)
class ListNode:
    pos: int
    nodes: list[Node]


@dataclass(slots=True, eq=False)
class BranchNode:
    """An ``if``, ``with`` or ``range`` block (``kind``), Go's IfNode / WithNode / RangeNode.

    ``{{else if x}}`` (and ``{{else with x}}``) is kept the way Go's parser keeps it: an
    ``else_body`` holding just the nested branch, which shares the outer ``{{end}}``. Walks
    ported from Go therefore see the same tree shape.
    """

    pos: int
    kind: str
    pipe: PipeNode
    body: ListNode
    else_body: ListNode | None


@dataclass(slots=True, eq=False)
class BreakNode:
    pos: int


@dataclass(slots=True, eq=False)
class ContinueNode:
    pos: int


# What a command's argument can be (a parenthesised pipeline is a PipeNode).
ArgNode = (
    FieldNode | VariableNode | DotNode | NilNode | BoolNode | NumberNode | StringNode | IdentifierNode | ChainNode
) | PipeNode
# What a list can hold.
Node = TextNode | ActionNode | ListNode | BranchNode | BreakNode | ContinueNode

