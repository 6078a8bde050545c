"""Ollama's request bodies as typed models, with Go's decoder errors for the wrong JSON type.

Each model is the Go struct of api/types.go that Ollama decodes the body into (GenerateRequest,
ChatRequest, ShowRequest, Message), with the fields the daemon reads. A field of the wrong JSON
type fails the way Go's encoding/json fails, `json: cannot unmarshal number into Go struct field
GenerateRequest.prompt of type string`, because clients and their tests match on that text. A
`null` is the field's zero value, as in Go. Unknown fields are ignored, as Go ignores them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError, PydanticUseDefault

from sidecar.api.wire import ApiError, json_kind

M = TypeVar("M", bound=BaseModel)


def _go(go: str, ok: Callable[[Any], bool]) -> BeforeValidator:
    """A field of Go type `go`: JSON values `ok` accepts pass, null is the zero value, the rest fail."""

    def check(v: Any, info: ValidationInfo) -> Any:
        if v is None:
            raise PydanticUseDefault
        if not ok(v):
            raise unmarshal_error(v, info.config.get("title", "") if info.config else "", info.field_name or "", go)
        return v

    return BeforeValidator(check)


def unmarshal_error(value: Any, struct: str, field: str, go: str) -> PydanticCustomError:
    return PydanticCustomError(
        "go_type", "json: cannot unmarshal {value} into Go struct field {struct}.{field} of type {go}",
        {"value": json_kind(value), "struct": struct, "field": field, "go": go})


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


String = Annotated[str, _go("string", lambda v: isinstance(v, str))]
OptString = Annotated[str | None, _go("string", lambda v: isinstance(v, str))]  # None: not given
Bool = Annotated[bool, _go("bool", lambda v: isinstance(v, bool))]
Number = Annotated[float, _go("float64", _number)]
List = Annotated[list[Any], _go("[]", lambda v: isinstance(v, list))]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @classmethod
    def read(cls: type[M], body: dict[str, Any]) -> M:
        """The body as this struct, or Go's decoder error as the client's 400."""
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise ApiError(400, e.errors()[0]["msg"]) from None


class Message(_Request):
    """api.Message; the role is lower-cased, as its UnmarshalJSON does."""

    model_config = ConfigDict(title="Message")

    role: String = ""
    content: String = ""
    tool_calls: List = Field(default_factory=list)
    tool_name: String = ""
    tool_call_id: String = ""

    @field_validator("role")
    @classmethod
    def _lower(cls, v: str) -> str:
        return v.lower()

    def as_dict(self) -> dict[str, Any]:
        """The message as the runtime's Prompt carries it: only the fields that are set."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in ("tool_calls", "tool_name", "tool_call_id"):
            if value := getattr(self, key):
                out[key] = value
        return out


def _messages(v: Any, info: ValidationInfo) -> Any:
    """A list of objects; any other element names its index (where Go would stop at it)."""
    if v is None:
        raise PydanticUseDefault
    if not isinstance(v, list):
        raise unmarshal_error(v, "ChatRequest", "messages", "[]")
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise PydanticCustomError(
                "go_type", "json: cannot unmarshal {kind} into Go struct field ChatRequest.messages of type "
                "api.Message (message {i})", {"kind": type(m).__name__, "i": i})
    return v


def _context(v: Any, info: ValidationInfo) -> Any:
    if v is None:
        return v
    if not isinstance(v, list):
        raise unmarshal_error(v, "GenerateRequest", "context", "[]")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise PydanticCustomError(
            "go_type", "json: cannot unmarshal into Go struct field GenerateRequest.context of type int")
    return v


class _Generation(_Request):
    """The fields generate and chat share."""

    model: String = ""
    stream: Bool = True  # Ollama: a missing `stream` means true
    format: Any = None
    keep_alive: Any = None
    options: Any = None
    think: Any = None
    debug_render_only: Bool = Field(False, alias="_debug_render_only")


class GenerateRequest(_Generation):
    model_config = ConfigDict(title="GenerateRequest")

    prompt: String = ""
    suffix: String = ""
    system: OptString = None
    template: OptString = None
    context: Annotated[list[int] | None, BeforeValidator(_context)] = None
    raw: Bool = False
    images: List = Field(default_factory=list)


class ChatRequest(_Generation):
    model_config = ConfigDict(title="ChatRequest")

    messages: Annotated[list[Message], BeforeValidator(_messages)] = Field(default_factory=list)
    tools: List = Field(default_factory=list)


class ShowRequest(_Request):
    model_config = ConfigDict(title="ShowRequest")

    model: String = ""
    name: String = ""
    verbose: Any = None
