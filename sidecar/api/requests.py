"""Ollama's request bodies as typed models, with Go's decoder errors for the wrong JSON type.

Each model is the Go struct of api/types.go that Ollama decodes the body into (GenerateRequest,
ChatRequest, ShowRequest, Message), with the fields the daemon reads. A field of the wrong JSON
type fails the way Go's encoding/json fails, `json: cannot unmarshal number into Go struct field
GenerateRequest.prompt of type string`, because clients and their tests match on that text. A
`null` is the field's zero value, as in Go. Unknown fields are ignored, as Go ignores them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError, PydanticUseDefault

from sidecar.api.wire import ApiError, json_kind

M = TypeVar("M", bound=BaseModel)


def _go(go: str, ok: Callable[[Any], bool], path: str | None = None) -> BeforeValidator:
    """A field of Go type `go`: JSON values `ok` accepts pass, null is the zero value, the rest fail.

    `path` is the field's JSON path from the body when it is nested (Go reports `messages.role`)."""

    def check(v: Any, info: ValidationInfo) -> Any:
        if v is None:
            raise PydanticUseDefault
        if not ok(v):
            struct = info.config.get("title", "") if info.config else ""
            raise unmarshal_error(v, struct, path or info.field_name or "", go)
        return v

    return BeforeValidator(check)


def unmarshal_error(value: Any, struct: str, field: str, go: str) -> PydanticCustomError:
    """encoding/json's UnmarshalTypeError: the innermost struct, the field's path, the Go type."""
    kind = json_kind(value)
    if go == "int" and kind == "number":
        kind = f"number {value}"  # Go names the literal that is no integer
    return PydanticCustomError(
        "go_type", "json: cannot unmarshal {value} into Go struct field {struct}.{field} of type {go}",
        {"value": kind, "struct": struct, "field": field, "go": go})


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_list(v: Any) -> bool:
    return isinstance(v, list)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


String = Annotated[str, _go("string", _is_str)]
OptString = Annotated[str | None, _go("string", _is_str)]  # None: not given
Bool = Annotated[bool, _go("bool", lambda v: isinstance(v, bool))]
OptBool = Annotated[bool | None, _go("bool", lambda v: isinstance(v, bool))]  # None: Ollama's default
Int = Annotated[int, _go("int", _is_int)]
Object = Annotated[dict[str, Any] | None, _go("map[string]interface {}", lambda v: isinstance(v, dict))]


def _think(v: Any) -> Any:
    """api.ThinkValue's UnmarshalJSON: a bool, or one of the level names."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, str):
        if v not in THINK_LEVELS:
            raise PydanticCustomError(
                "go_type", 'invalid think value: "{v}" (must be "high", "medium", "low", "max", true, or false)',
                {"v": v})
        return v
    raise PydanticCustomError(
        "go_type", 'think must be a boolean or string ("high", "medium", "low", "max", true, or false)')


THINK_LEVELS = ("high", "medium", "low", "max")
Think = Annotated[bool | str | None, BeforeValidator(_think)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @classmethod
    def read(cls: type[M], body: dict[str, Any]) -> M:
        """The body as this struct, or Go's decoder error as the client's 400."""
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise ApiError(400, e.errors()[0]["msg"]) from None


# api.ToolCall and api.ToolCallFunction: each field's JSON check and Go type.
_TOOL_CALL = {"id": (_is_str, "string"), "function": (lambda v: isinstance(v, dict), "api.ToolCallFunction")}
_TOOL_FUNCTION = {"index": (_is_int, "int"), "name": (_is_str, "string")}
# api.ToolCallFunctionArguments decodes through an ordered map (internal/orderedmap over
# wk8/go-ordered-map, whose UnmarshalJSON is buger/jsonparser's ObjectEach): anything but an object
# fails with jsonparser's MalformedObjectError, not a json.UnmarshalTypeError.
_NOT_AN_OBJECT = "Value looks like object, but can't find closing '}' symbol"


def _tool_calls(calls: list[Any]) -> list[Any]:
    """An earlier turn's tool calls as Go decodes them: a field of the wrong JSON type fails as
    api.ToolCall's or api.ToolCallFunction's (null is the zero value); unknown fields pass."""
    path = "messages.tool_calls"
    # Go saves a type error and decodes on, but an UnmarshalJSON error stops it: bad arguments win.
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if arguments is not None and not isinstance(arguments, dict):
            raise ApiError(400, _NOT_AN_OBJECT)
    for call in calls:
        if not isinstance(call, dict):
            raise unmarshal_error(call, "Message", path, "api.ToolCall")
        for struct, fields, obj, where in (("ToolCall", _TOOL_CALL, call, path),
                                           ("ToolCallFunction", _TOOL_FUNCTION, call.get("function") or {},
                                            f"{path}.function")):
            for key, (ok, go) in fields.items():
                if obj.get(key) is not None and not ok(obj[key]):
                    raise unmarshal_error(obj[key], struct, f"{where}.{key}", go)
    return calls


class Message(_Request):
    """api.Message; the role is lower-cased, as its UnmarshalJSON does."""

    model_config = ConfigDict(title="Message")

    role: Annotated[str, _go("string", _is_str, "messages.role")] = ""
    content: Annotated[str, _go("string", _is_str, "messages.content")] = ""
    thinking: Annotated[str, _go("string", _is_str, "messages.thinking")] = ""
    images: Annotated[list[Any], _go("[]api.ImageData", _is_list, "messages.images")] = Field(default_factory=list)
    tool_calls: Annotated[list[Any], _go("[]api.ToolCall", _is_list, "messages.tool_calls"),
                          AfterValidator(_tool_calls)] = Field(default_factory=list)
    tool_name: Annotated[str, _go("string", _is_str, "messages.tool_name")] = ""
    tool_call_id: Annotated[str, _go("string", _is_str, "messages.tool_call_id")] = ""

    @field_validator("role")
    @classmethod
    def _lower(cls, v: str) -> str:
        return v.lower()

    def as_dict(self) -> dict[str, Any]:
        """The message as the runtime's Prompt carries it: only the fields that are set."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in ("thinking", "tool_calls", "tool_name", "tool_call_id"):
            if value := getattr(self, key):
                out[key] = value
        return out


def _list_of(struct: str, field: str, go: str, element: str, ok: Callable[[Any], bool]) -> BeforeValidator:
    """A Go slice: not a list fails as the slice, a wrong element as the element type."""

    def check(v: Any) -> Any:
        if v is None:
            raise PydanticUseDefault
        if not isinstance(v, list):
            raise unmarshal_error(v, struct, field, go)
        for item in v:
            if not ok(item):
                raise unmarshal_error(item, struct, field, element)
        return v

    return BeforeValidator(check)


class _Generation(_Request):
    """The fields generate and chat share."""

    model: String = ""
    stream: Bool = True  # Ollama: a missing `stream` means true
    format: Any = None
    keep_alive: Any = None
    options: Object = None
    think: Think = None
    truncate: OptBool = None  # trim the prompt (chat: the oldest messages) to fit; default true
    shift: OptBool = None  # shift the context when generation fills it; default true
    logprobs: Bool = False
    top_logprobs: Int = 0
    debug_render_only: Bool = Field(False, alias="_debug_render_only")

    @field_validator("top_logprobs")
    @classmethod
    def _top(cls, v: int) -> int:
        if not 0 <= v <= 20:
            raise PydanticCustomError("go_type", "top_logprobs must be between 0 and 20")
        return v


class GenerateRequest(_Generation):
    model_config = ConfigDict(title="GenerateRequest")

    prompt: String = ""
    suffix: String = ""
    system: OptString = None
    template: OptString = None
    context: Annotated[list[int] | None, _list_of("GenerateRequest", "context", "[]int", "int", _is_int)] = None
    raw: Bool = False
    images: Annotated[list[Any], _go("[]api.ImageData", _is_list)] = Field(default_factory=list)


class ChatRequest(_Generation):
    model_config = ConfigDict(title="ChatRequest")

    messages: Annotated[list[Message], _list_of("ChatRequest", "messages", "[]api.Message", "api.Message",
                                                lambda m: isinstance(m, dict))] = Field(default_factory=list)
    tools: Annotated[list[Any], _list_of("ChatRequest", "tools", "api.Tools", "api.Tool",
                                         lambda t: isinstance(t, dict))] = Field(default_factory=list)


class ShowRequest(_Request):
    model_config = ConfigDict(title="ShowRequest")

    model: String = ""
    name: String = ""
    verbose: Bool = False
