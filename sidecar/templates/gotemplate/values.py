"""The Go values templates see: structs, typed slices and maps, and Go's rules on them.

Python dicts and lists stand in for Go maps and slices; these types add what Go's reflection
would know (type name, nil vs empty, struct field order and JSON tags, String methods) so that
printing, ``encoding/json`` and errors come out as Go's would.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Final

# How a struct field is omitted by encoding/json: never, when its typed value is empty
# ("omitempty" on a string/slice/map/number), or only when nil (omitempty on an `any` field).
KEEP: Final = 0
OMIT_EMPTY: Final = 1
OMIT_NIL: Final = 2
JSONLayout = tuple[tuple[str, str, int], ...]


class Struct:
    """A Go struct value: template field access by Go name, JSON by its struct tags.

    Unlike a mapping, a struct is always truthy, can't be ranged over, and accessing a field it
    doesn't have is an execution error, as in Go.
    """

    __slots__ = ("fields", "layout", "stringer", "type_name")

    def __init__(
        self,
        type_name: str,
        fields: dict[str, Any],
        layout: JSONLayout | None = None,
        *,
        stringer: bool = False,
    ) -> None:
        self.type_name = type_name
        self.fields = fields
        self.layout = layout if layout is not None else tuple((k, k, KEEP) for k in fields)
        self.stringer = stringer  # has a String() method that prints its JSON


class GoSlice(list[Any]):
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


class GoMap(dict[str, Any]):
    """A Go map (JSON keys sorted, like encoding/json) or an ordered map (``sort_keys=False``).

    ``elem`` is the static type of a value looked up in it, which Go's field errors name
    (``interface {}`` for ``map[string]any``); None where the element type is the value's own."""

    __slots__ = ("elem", "is_nil", "sort_keys", "stringer", "type_name")

    def __init__(
        self,
        items: Mapping[str, Any] | None = None,
        *,
        sort_keys: bool = True,
        stringer: bool = False,
        type_name: str = "map[string]interface {}",
        elem: str | None = "interface {}",
    ) -> None:
        super().__init__(items or {})
        self.is_nil = items is None
        self.sort_keys = sort_keys
        self.stringer = stringer
        self.type_name = type_name
        self.elem = elem


def static_type(container: Any) -> str | None:
    """The static type of a field looked up in `container`, where Go's errors name that type and
    not the value's: a map's element type (a plain mapping is ``map[string]any``); None for a
    struct's fields, which are typed here by their values."""
    if isinstance(container, GoMap):
        return container.elem
    return "interface {}" if isinstance(container, Mapping) else None


class NamedValue:
    """Base of a value whose Go type has its own ``String`` / ``MarshalJSON`` methods.

    A subclass mixes this into the Python type it is built on (a list ranges and indexes like a
    slice) and says how its methods print and marshal it.
    """

    __slots__ = ()
    type_name: ClassVar[str]  # as %T prints it

    def go_string(self) -> str | None:
        """What the type's String() returns; None when it has no String method."""
        return None

    def go_json(self) -> str | None:
        """What the type's MarshalJSON() returns; None to marshal the underlying value."""
        return None


def go_type_name(v: Any) -> str:
    """The value's Go type as ``%T`` and error messages print it."""
    if v is None:
        return "<nil>"
    if isinstance(v, Struct | GoSlice | GoMap | NamedValue):
        return v.type_name
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


def truth(v: Any) -> bool:
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


def sorted_items(m: Mapping[Any, Any]) -> list[tuple[Any, Any]]:
    """A map's entries in the order Go's fmt and ``range`` visit them: sorted by key."""
    return [(k, m[k]) for k in sorted(m, key=_sort_key)]


def to_bytes(s: str) -> bytes:
    """Go strings are bytes; invalid UTF-8 survives as surrogate escapes."""
    try:
        return s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogatepass")


def from_bytes(b: bytes) -> str:
    """The inverse of :func:`to_bytes`."""
    return b.decode("utf-8", "surrogateescape")
