"""The tags Ollama reads off a model's Go template: what opens tool calls and what wraps thinking.

Ollama does not configure these per model; it walks the template's parse tree. To parse model
output the way Ollama does we must find the same tags, so these are faithful ports of those walks
(tools/template.go and thinking/template.go) over our tree, which has Go's shape: an ``{{ else
if }}`` is an else list holding the nested ``if``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from sidecar.templates.gotemplate import (
    ActionNode,
    ArgNode,
    BranchNode,
    CommandNode,
    FieldNode,
    GoTemplate,
    ListNode,
    Node,
    PipeNode,
    TextNode,
)

__all__ = ["find_tool_call_node", "infer_think_tags", "tool_call_tag"]

# What Go's strings.TrimSpace / bytes.TrimSpace trim (unicode.IsSpace); str.strip() would also
# trim the separators U+001C-U+001F, which Go keeps.
_GO_SPACE: Final = "\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(map(chr, range(0x2000, 0x200B)))

_TreeNode = Node | PipeNode | CommandNode | ArgNode


def _trim_space(s: str) -> str:
    return s.strip(_GO_SPACE)


# -- tools/template.go ---------------------------------------------------------------------------


def tool_call_tag(template: GoTemplate) -> str:
    """Ollama's parseTag: the text a model writes before its tool calls, "{" for bare JSON calls.

    It is the first non-blank text inside the first ``{{ if }}`` on ``.ToolCalls`` (searching
    nested if/range/with blocks and their else branches), cut before any "{" and trimmed.
    """
    node = find_tool_call_node(template.root.nodes)
    if node is None:
        return "{"
    text = _find_text_node(node.body.nodes)
    if text is None:
        return "{"
    tag = text.text.replace("\r\n", "\n")
    # What follows a "{" may be the call itself; a tag-less template keeps "{" to mean "JSON calls".
    tag = _trim_space(tag.split("{", 1)[0])
    return tag or "{"


def find_tool_call_node(nodes: Sequence[Node]) -> BranchNode | None:
    """Ollama's findToolCallNode: the first ``if`` whose condition names a field ``ToolCalls``.

    Only ``if`` conditions count (``{{ range .ToolCalls }}`` alone is not found), and only field
    nodes (``.ToolCalls``, ``.Message.ToolCalls``), not variables such as ``$m.ToolCalls``.
    """
    for node in nodes:
        if isinstance(node, BranchNode):
            if node.kind == "if" and _is_tool_calls_node(node):
                return node
            found = find_tool_call_node(node.body.nodes)
            if found is None and node.else_body is not None:
                found = find_tool_call_node(node.else_body.nodes)
            if found is not None:
                return found
        elif isinstance(node, ListNode):
            found = find_tool_call_node(node.nodes)
            if found is not None:
                return found
    return None


def _is_tool_calls_node(node: BranchNode) -> bool:
    return any(
        isinstance(arg, FieldNode) and "ToolCalls" in arg.idents for cmd in node.pipe.cmds for arg in cmd.args
    )


def _find_text_node(nodes: Sequence[Node]) -> TextNode | None:
    """Ollama's findTextNode: the first non-blank text, depth first, up to the first action.

    A nested block is searched (body, then else branch) but ends the search either way, so no
    text after a construct is taken for the tag.
    """
    for node in nodes:
        if isinstance(node, TextNode):
            if _trim_space(node.text):
                return node
        elif isinstance(node, BranchNode):
            found = _find_text_node(node.body.nodes)
            if found is None and node.else_body is not None:
                found = _find_text_node(node.else_body.nodes)
            return found
        elif isinstance(node, ListNode):
            found = _find_text_node(node.nodes)
            if found is not None:
                return found
        elif isinstance(node, ActionNode):
            return None
    return None


# -- thinking/template.go ------------------------------------------------------------------------


def infer_think_tags(template: GoTemplate) -> tuple[str, str]:
    """Ollama's InferTags: the (opening, closing) tags around thinking, ("", "") when none.

    For each ``.Thinking`` inside a ``range`` over ``.Messages`` (the nearest enclosing range),
    the nearest enclosing list's first and last nodes, when they are text, give the tags; a later
    match overrides an earlier one, tag by tag.
    """
    opening = closing = ""
    ancestors: list[_TreeNode] = []

    def enter(node: _TreeNode) -> None:
        nonlocal opening, closing
        ancestors.append(node)
        if not (isinstance(node, FieldNode) and node.idents[0] == "Thinking"):
            return
        ranges = (a for a in reversed(ancestors) if isinstance(a, BranchNode) and a.kind == "range")
        innermost_range = next(ranges, None)
        if innermost_range is None or not _range_uses_field(innermost_range, "Messages"):
            return
        for ancestor in reversed(ancestors):
            if isinstance(ancestor, ListNode):
                first, last = ancestor.nodes[0], ancestor.nodes[-1]
                if isinstance(first, TextNode):
                    opening = _trim_space(first.text)
                if isinstance(last, TextNode):
                    closing = _trim_space(last.text)
                break

    def leave(_: _TreeNode) -> None:
        ancestors.pop()

    _visit(template.root, enter, leave)
    return opening, closing


def _range_uses_field(node: BranchNode, field: str) -> bool:
    """Ollama's rangeUsesField: the range's own pipeline names ``field`` (first identifier)."""
    found = False

    def enter(n: _TreeNode) -> None:
        nonlocal found
        if isinstance(n, FieldNode) and n.idents[0] == field:
            found = True

    _visit(node.pipe, enter, lambda _: None)
    return found


def _visit(node: _TreeNode, enter: Callable[[_TreeNode], None], leave: Callable[[_TreeNode], None]) -> None:
    """thinking's templateVisit: pre-order over lists, blocks, actions, pipelines and commands.

    Arguments are leaves except parenthesised pipelines; a chain such as ``(.X).Thinking`` is
    not entered, as in Go.
    """
    enter(node)
    children: Sequence[_TreeNode] = ()
    if isinstance(node, ListNode):
        children = node.nodes
    elif isinstance(node, BranchNode):
        children = [node.pipe, node.body] if node.else_body is None else [node.pipe, node.body, node.else_body]
    elif isinstance(node, ActionNode):
        children = [node.pipe]
    elif isinstance(node, PipeNode):
        children = node.cmds
    elif isinstance(node, CommandNode):
        children = node.args
    for child in children:
        _visit(child, enter, leave)
    leave(node)
