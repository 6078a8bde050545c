"""Go's text/template execution (text/template/exec.go).

Evaluation follows Go step by step (pipelines, variable scopes, lazy and/or, range over lists,
sorted maps and ints, break/continue), and failures carry Go's messages, because a template that
fails under Ollama must fail here the same way rather than render something else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, NoReturn

from sidecar.templates.gotemplate.fmt import sprint_value
from sidecar.templates.gotemplate.funcs import ArgError, Func, FuncError
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
from sidecar.templates.gotemplate.values import Struct, go_type_name, sorted_items, static_type, truth


class ExecError(Exception):
    """An execution error at ``pos`` (None: no single position); Go's template.ExecError.
    ``context`` is the node Go's message names (``at <...>``), where there is one."""

    def __init__(self, message: str, pos: int | None, context: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.pos = pos
        self.context = context


def execute(root: ListNode, data: Any, funcs: Mapping[str, Func], nil_text: str) -> str:
    """Run ``root`` with ``data`` as ``.`` and ``$``; a nil value prints as ``nil_text``.

    Raises :class:`ExecError` at the first failure, as Go stops at it.
    """
    state = _Exec(data, funcs, nil_text)
    state.walk(data, root)
    return _repair_utf8("".join(state.out))


class _Missing:
    """Marks "no value piped in" (Go's missingVal)."""


_MISSING: Final = _Missing()


class _BreakSignal(Exception):
    """{{break}}: unwinds to the innermost range."""


class _ContinueSignal(Exception):
    """{{continue}}: unwinds to the innermost range's next iteration."""


class _Exec:
    """exec.go's state: the variable stack, the output, and the node being evaluated."""

    def __init__(self, data: Any, funcs: Mapping[str, Func], nil_text: str) -> None:
        self.funcs = funcs
        self.nil_text = nil_text
        self.vars: list[list[Any]] = [["$", data]]
        self.out: list[str] = []
        self.at: Any = None  # node being evaluated, for error messages

    def fail(self, message: str) -> NoReturn:
        pos = getattr(self.at, "pos", None)
        raise ExecError(message, pos, str(self.at) if isinstance(self.at, ArgNode | CommandNode) else None)

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

    def walk(self, dot: Any, node: Node) -> None:
        if isinstance(node, TextNode):
            self.out.append(node.text)
        elif isinstance(node, ActionNode):
            value = self.eval_pipeline(dot, node.pipe)
            if not node.pipe.decl:
                self.out.append(self.nil_text if value is None else sprint_value(value))
        elif isinstance(node, ListNode):
            for child in node.nodes:
                self.walk(dot, child)
        elif isinstance(node, BranchNode):
            if node.kind == "range":
                self.walk_range(dot, node)
            else:
                self.walk_if_or_with(dot, node)
        elif isinstance(node, BreakNode):
            raise _BreakSignal
        elif isinstance(node, ContinueNode):
            raise _ContinueSignal

    def walk_if_or_with(self, dot: Any, node: BranchNode) -> None:
        mark = len(self.vars)
        try:
            value = self.eval_pipeline(dot, node.pipe)
            if truth(value):
                self.walk(value if node.kind == "with" else dot, node.body)
            elif node.else_body is not None:
                self.walk(dot, node.else_body)
        finally:
            del self.vars[mark:]

    def walk_range(self, dot: Any, node: BranchNode) -> None:
        mark = len(self.vars)
        try:
            value = self.eval_pipeline(dot, node.pipe)
            items: Iterable[tuple[Any, Any]]
            if isinstance(value, list | tuple | bytes | bytearray):
                items = enumerate(value)
            elif isinstance(value, Mapping):
                items = sorted_items(value)
            elif isinstance(value, int) and not isinstance(value, bool):
                if len(node.pipe.decl) > 1:
                    self.fail(f"can't use {value} to iterate over more than one variable")
                items = ((i, i) for i in range(value))
            elif value is None:
                items = ()
            else:
                self.fail(f"range can't iterate over {sprint_value(value)}")
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

    def one_iteration(self, node: BranchNode, index: Any, elem: Any, body_mark: int) -> None:
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

    def eval_pipeline(self, dot: Any, pipe: PipeNode) -> Any:
        value: Any = _MISSING
        for cmd in pipe.cmds:
            value = self.eval_command(dot, cmd, value)
        for name in pipe.decl:
            if pipe.is_assign:
                self.set_var(name, value)
            else:
                self.vars.append([name, value])
        return value

    def eval_command(self, dot: Any, cmd: CommandNode, final: Any) -> Any:
        first = cmd.args[0]
        if isinstance(first, FieldNode):
            return self.eval_field_chain(dot, dot, first, first.idents, cmd.args, final)
        if isinstance(first, ChainNode):
            return self.eval_chain(dot, first, cmd.args, final)
        if isinstance(first, IdentifierNode):
            return self.eval_function(dot, first, cmd, cmd.args[1:], final)
        if isinstance(first, VariableNode):
            return self.eval_variable(dot, first, cmd.args, final)
        self.at = first
        if len(cmd.args) > 1 or final is not _MISSING:
            self.fail(f"can't give argument to non-function {first}")
        if isinstance(first, PipeNode):
            return self.eval_pipeline(dot, first)
        if isinstance(first, BoolNode):
            return first.value
        if isinstance(first, DotNode):
            return dot
        if isinstance(first, NilNode):
            self.fail("nil is not a command")
        if isinstance(first, NumberNode):
            return self.number(first)
        assert isinstance(first, StringNode)
        return first.text

    def eval_variable(self, dot: Any, var: VariableNode, args: Sequence[ArgNode] | None, final: Any) -> Any:
        self.at = var
        value = self.var_value(var.idents[0])
        if len(var.idents) == 1:
            if (args is not None and len(args) > 1) or final is not _MISSING:
                self.fail(f"can't give argument to non-function {var}")
            return value
        return self.eval_field_chain(dot, value, var, var.idents[1:], args, final)

    def eval_chain(self, dot: Any, chain: ChainNode, args: Sequence[ArgNode] | None, final: Any) -> Any:
        self.at = chain
        if isinstance(chain.node, NilNode):
            self.fail(f"indirection through explicit nil in {chain}")
        receiver = self.eval_arg(dot, chain.node, None)
        return self.eval_field_chain(dot, receiver, chain, chain.fields, args, final)

    def eval_field_chain(
        self,
        dot: Any,
        receiver: Any,
        node: ArgNode,
        idents: Sequence[str],
        args: Sequence[ArgNode] | None,
        final: Any,
    ) -> Any:
        # Go names a receiver's static type in its errors: the first is the value itself (data,
        # a variable, a pipeline: concrete), the ones after it what they were looked up in.
        static = None
        for name in idents[:-1]:
            receiver, static = self.eval_field(name, node, None, _MISSING, receiver, static), static_type(receiver)
        return self.eval_field(idents[-1], node, args, final, receiver, static)

    def eval_field(
        self, name: str, node: ArgNode, args: Sequence[ArgNode] | None, final: Any, receiver: Any,
        static: str | None = None,
    ) -> Any:
        """Go's evalField; `static`: the receiver's type as Go's errors name it (exec.go takes
        receiver.Type() before indirect), where that is not the value's own type."""
        self.at = node
        if receiver is None:
            # A missing/nil value has no fields; like a zero struct, yield an empty value.
            return None
        has_args = (args is not None and len(args) > 1) or final is not _MISSING
        if isinstance(receiver, Struct):
            if name not in receiver.fields:
                self.fail(f"can't evaluate field {name} in type {static or receiver.type_name}")
            if has_args:
                self.fail(f"{name} has arguments but cannot be invoked as function")
            return receiver.fields[name]
        if isinstance(receiver, Mapping):
            if has_args:
                self.fail(f"{name} is not a method but has arguments")
            return receiver.get(name)
        self.fail(f"can't evaluate field {name} in type {static or go_type_name(receiver)}")

    def eval_function(self, dot: Any, ident: IdentifierNode, cmd: CommandNode | IdentifierNode,
                      arg_nodes: Sequence[ArgNode], final: Any) -> Any:
        """Go's evalFunction; `cmd` is the command that calls it (the identifier itself where it
        stands as an argument), which a failing call is reported at (evalCall)."""
        self.at = ident
        name = ident.name
        fn = self.funcs.get(name)
        if fn is None:
            self.fail(f"{go_quote(name)} is not a defined function")
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
                if truth(value) == want:
                    return value
            return value if final is _MISSING else final
        values = [self.eval_arg(dot, node, fn.nil_type) for node in arg_nodes]
        if final is not _MISSING:
            values.append(final)
        self.at = ident
        try:
            return fn.call(values)
        except ArgError as e:
            self.fail(str(e))
        except FuncError as e:
            self.at = cmd
            self.fail(f"error calling {name}: {e}")

    def eval_arg(self, dot: Any, node: ArgNode, nil_type: str | None) -> Any:
        self.at = node
        if isinstance(node, DotNode):
            return dot
        if isinstance(node, NilNode):
            if nil_type is not None:
                self.fail(f"cannot assign nil to {nil_type}")
            return None
        if isinstance(node, FieldNode):
            return self.eval_field_chain(dot, dot, node, node.idents, [node], _MISSING)
        if isinstance(node, VariableNode):
            return self.eval_variable(dot, node, None, _MISSING)
        if isinstance(node, PipeNode):
            return self.eval_pipeline(dot, node)
        if isinstance(node, IdentifierNode):
            return self.eval_function(dot, node, node, (), _MISSING)
        if isinstance(node, ChainNode):
            return self.eval_chain(dot, node, None, _MISSING)
        if isinstance(node, BoolNode):
            return node.value
        if isinstance(node, NumberNode):
            return self.number(node)
        return node.text

    def number(self, node: NumberNode) -> int | float:
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
