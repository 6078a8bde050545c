"""Ollama's layer over Go templates (template/template.go): what ``Template.Execute`` renders.

Ollama does more than execute a model's template: it decides between the messages and the
legacy prompt/response form from the names the template uses, appends ``{{ .Response }}`` to
templates that lack it, collates messages, cuts the last legacy turn after ``.Response``, and
hands the template its own structs (templateMessage, templateTool...) whose printing and JSON
are part of the prompt. :func:`render_ollama` reproduces all of it on :mod:`~sidecar.templates.gotemplate`.
"""

from __future__ import annotations

import base64
import json
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from sidecar.templates.gotemplate import (
    ActionNode,
    BranchNode,
    CommandNode,
    FieldNode,
    GoTemplate,
    ListNode,
    PipeNode,
    TemplateError,
    VariableNode,
)
from sidecar.templates.gotemplate.funcs import BUILTINS, DEFAULT_FUNCS, Func
from sidecar.templates.gotemplate.json import marshal
from sidecar.templates.gotemplate.values import (
    KEEP,
    OMIT_EMPTY,
    OMIT_NIL,
    GoMap,
    GoSlice,
    JSONLayout,
    NamedValue,
    Struct,
)

__all__ = ["render_ollama", "template_vars"]


@dataclass(frozen=True, slots=True)
class _OllamaPlan:
    """How Ollama will run a template, worked out once per template."""

    uses_messages: bool
    root: ListNode  # the tree Ollama executes (maybe with {{ .Response }} appended)
    final_root: ListNode | None  # legacy final turn: cut after the first .Response
    final_error: str | None  # why Go would panic building final_root


def _identifiers(node: Any) -> list[str]:
    """Ollama's Identifiers(): field and variable names, not descending into chains."""
    if isinstance(node, ListNode):
        return [name for child in node.nodes for name in _identifiers(child)]
    if isinstance(node, ActionNode):
        return _identifiers(node.pipe)
    if isinstance(node, BranchNode):
        names = _identifiers(node.pipe) + _identifiers(node.body)
        return names + (_identifiers(node.else_body) if node.else_body is not None else [])
    if isinstance(node, PipeNode):
        return [name for cmd in node.cmds for arg in cmd.args for name in _identifiers(arg)]
    if isinstance(node, FieldNode | VariableNode):
        return list(node.idents)
    return []


class _GoPanic(Exception):
    """Where Ollama's Go code would panic."""


def _cut_after_response(root: ListNode) -> ListNode:
    """Ollama's deleteNode(root, ...): drop every node after the first ``.Response`` field.

    Mirrors Go exactly, including what it does not visit (if/with/range conditions) and the
    case where it panics (a cut inside a branch that has an else branch).
    """
    cut = False

    def matches(node: Any) -> bool:
        nonlocal cut
        if isinstance(node, FieldNode) and "Response" in node.idents:
            cut = True
            return False
        return cut

    def walk(node: Any) -> Any:
        if matches(node):
            return None
        if isinstance(node, ListNode):
            return ListNode(node.pos, [w for child in node.nodes if (w := walk(child)) is not None])
        if isinstance(node, BranchNode):
            if matches(node):  # Go walks the embedded BranchNode itself first
                raise _GoPanic
            body = walk(node.body)
            else_body = None
            if node.else_body is not None:
                else_body = walk(node.else_body)
                if else_body is None:
                    raise _GoPanic  # Go: nil.(*parse.ListNode) type assertion
            return BranchNode(node.pos, node.kind, node.pipe, body, else_body)
        if isinstance(node, ActionNode):
            pipe = walk(node.pipe)
            return None if pipe is None else ActionNode(node.pos, pipe)
        if isinstance(node, PipeNode):
            cmds = []
            for cmd in node.cmds:
                args = [w for arg in cmd.args if (w := walk(arg)) is not None]
                if not args:
                    return None
                cmds.append(CommandNode(cmd.pos, args))
            return PipeNode(node.pos, node.decl, node.is_assign, cmds) if cmds else None
        return node

    result = walk(root)
    assert isinstance(result, ListNode)  # the root list is never deleted
    return result


# Plans per template, made on first use; a template's plan goes when the template does.
_PLANS: Final[weakref.WeakKeyDictionary[GoTemplate, _OllamaPlan]] = weakref.WeakKeyDictionary()


def _ollama_plan(template: GoTemplate) -> _OllamaPlan:
    """What Ollama's Parse makes of the template; two threads racing here just build it twice."""
    plan = _PLANS.get(template)
    if plan is None:
        names = {name.lower() for name in _identifiers(template.root)}
        root = template.root
        if "messages" not in names and "response" not in names:
            response = ActionNode(
                len(template.source), PipeNode(0, [], False, [CommandNode(0, [FieldNode(0, ("Response",))])])
            )
            root = ListNode(root.pos, [*root.nodes, response])
        try:
            final_root, final_error = _cut_after_response(root), None
        except _GoPanic:
            final_root, final_error = None, "Ollama cannot render this legacy template (Go panics cutting it)"
        plan = _OllamaPlan("messages" in names, root, final_root, final_error)
        _PLANS[template] = plan
    return plan


def template_vars(template: GoTemplate) -> set[str]:
    """Ollama's ``Template.Vars()``: every field and variable name, lower-cased.

    Ollama reads capabilities off it (``tools`` when a template names .Tools, ``insert`` for
    .Suffix). Like Ollama it looks at the parsed template, so a legacy one also has the
    ``response`` that parsing appended.
    """
    return {name.lower() for name in _identifiers(_ollama_plan(template).root)}


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
        return GoMap({str(k): _go_any(x) for k, x in v.items()})
    if isinstance(v, list | tuple):
        return [_go_any(x) for x in v]
    if isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    return v


class _PropertyType(NamedValue, list[str]):
    """Ollama's ``api.PropertyType``: a JSON-schema type, one name or a list of them.

    Its String and MarshalJSON methods write a single type as a bare string.
    """

    __slots__ = ()
    type_name = "api.PropertyType"

    def go_string(self) -> str:
        if not self:
            return ""
        return self[0] if len(self) == 1 else "[" + " ".join(self) + "]"

    def go_json(self) -> str | None:
        return marshal(self[0]) if len(self) == 1 else None


def _string_slice(v: Any) -> GoSlice:
    if v is None:
        return GoSlice(is_nil=True, type_name="[]string")
    return GoSlice((str(x) for x in v), type_name="[]string")


_TOOL_LAYOUT: Final[JSONLayout] = (
    ("Type", "type", KEEP),
    ("Items", "items", OMIT_NIL),
    ("Function", "function", KEEP),
)
_TOOL_FUNCTION_LAYOUT: Final[JSONLayout] = (
    ("Name", "name", KEEP),
    ("Description", "description", KEEP),
    ("Parameters", "parameters", KEEP),
)
_TOOL_PARAMETERS_LAYOUT: Final[JSONLayout] = (
    ("Type", "type", KEEP),
    ("Defs", "$defs", OMIT_NIL),
    ("Items", "items", OMIT_NIL),
    ("Required", "required", OMIT_EMPTY),
    ("Properties", "properties", KEEP),
)
_TOOL_PROPERTY_LAYOUT: Final[JSONLayout] = (
    ("AnyOf", "anyOf", OMIT_EMPTY),
    ("Type", "type", OMIT_EMPTY),
    ("Items", "items", OMIT_NIL),
    ("Description", "description", OMIT_EMPTY),
    ("Enum", "enum", OMIT_EMPTY),
    ("Properties", "properties", OMIT_NIL),
    ("Required", "required", OMIT_EMPTY),
)


def _tool_property(p: Mapping[str, Any]) -> Struct:
    any_of, enum_values, props, typ = p.get("anyOf"), p.get("enum"), p.get("properties"), p.get("type")
    types = [] if typ is None else [typ] if isinstance(typ, str) else [str(t) for t in typ]
    fields = {
        "AnyOf": GoSlice(
            (_tool_property(x) for x in any_of or ()), is_nil=any_of is None, type_name="[]api.ToolProperty"
        ),
        "Type": _PropertyType(types),
        "Items": _go_any(p.get("items")),
        "Description": _str_field(p, "description"),
        "Enum": GoSlice((_go_any(x) for x in enum_values or ()), is_nil=enum_values is None),
        # *api.ToolPropertiesMap keeps the caller's key order.
        "Properties": None
        if props is None
        else GoMap(
            {k: _tool_property(v) for k, v in props.items()},
            sort_keys=False,
            type_name="*api.ToolPropertiesMap",
            elem=None,
        ),
        "Required": _string_slice(p.get("required")),
    }
    return Struct("api.ToolProperty", fields, _TOOL_PROPERTY_LAYOUT)


def _template_tools(tools: Sequence[Mapping[str, Any]] | None) -> GoSlice:
    """convertToolsForTemplate(): Tools prints as JSON; Properties become a sorted Go map.

    What prints as JSON is exactly what has a String() method in Ollama's template/template.go:
    templateTools, templateTool (``{{ range .Tools }}{{ . }}{{ end }}``) and templateProperties.
    templateToolFunction and templateToolFunctionParameters have none, so ``{{ .Function }}`` prints
    Go's struct syntax in Ollama too (ollama#14601); matching that keeps prompts byte-identical.
    """
    result = GoSlice(is_nil=tools is None, stringer=True, type_name="template.templateTools")
    for tool in tools or ():
        function = tool.get("function") or {}
        params = function.get("parameters") or {}
        props = params.get("properties")
        parameters = Struct(
            "template.templateToolFunctionParameters",
            {
                "Type": _str_field(params, "type"),
                "Defs": _go_any(params.get("$defs")),
                "Items": _go_any(params.get("items")),
                "Required": _string_slice(params.get("required")),
                "Properties": GoMap(
                    None if props is None else {k: _tool_property(v) for k, v in props.items()},
                    stringer=True,
                    type_name="template.templateProperties",
                    elem=None,
                ),
            },
            _TOOL_PARAMETERS_LAYOUT,
        )
        fn = Struct(
            "template.templateToolFunction",
            {
                "Name": _str_field(function, "name"),
                "Description": _str_field(function, "description"),
                "Parameters": parameters,
            },
            _TOOL_FUNCTION_LAYOUT,
        )
        result.append(
            Struct(
                "template.templateTool",
                {"Type": _str_field(tool, "type"), "Items": _go_any(tool.get("items")), "Function": fn},
                _TOOL_LAYOUT,
                stringer=True,  # func (t templateTool) String(): json.Marshal(t)
            )
        )
    return result


def _template_tool_call(call: Mapping[str, Any]) -> Struct:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):  # OpenAI-style JSON text; Ollama's API carries an object
        arguments = json.loads(arguments) if arguments.strip() else None
    args = GoMap(
        None if arguments is None else {str(k): _go_any(v) for k, v in arguments.items()},
        stringer=True,
        type_name="template.templateArgs",
    )
    index = function.get("index") or 0
    fn = Struct(
        "template.templateToolCallFunction",
        {"Index": int(index), "Name": _str_field(function, "name"), "Arguments": args},
    )
    return Struct("template.templateToolCall", {"ID": _str_field(call, "id"), "Function": fn})


def _template_message(m: _Message) -> Struct:
    """convertMessagesForTemplate(): the struct templates see as an element of .Messages."""
    calls = [_template_tool_call(c) for c in m.tool_calls or ()]
    return Struct(
        "*template.templateMessage",
        {
            "Role": m.role,
            "Content": m.content,
            "Thinking": m.thinking,
            "Images": GoSlice(m.images or (), is_nil=m.images is None, type_name="[]api.ImageData"),
            "ToolCalls": GoSlice(calls, is_nil=True, type_name="[]template.templateToolCall"),
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
    if think in ("high", "medium", "low", "max"):
        return True, think, True
    raise ValueError(f'invalid think value: {think!r} (must be "high", "medium", "low", "max", true, or false)')


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

    def run(root: ListNode, data: dict[str, Any], funcs: Mapping[str, Func] = DEFAULT_FUNCS) -> str:
        # Ollama passes map[string]any: a missing key (or nil interface) prints "<no value>".
        return template.execute_tree(root, GoMap(data), funcs=funcs, nil_text="<no value>")

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
            "Messages": GoSlice((_template_message(m) for m in collated), is_nil=True),
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
    out.append(run(plan.final_root, {**turn, **common}, BUILTINS))
    return "".join(out)
