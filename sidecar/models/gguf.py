"""Read a GGUF file's key/value metadata without loading the model.

/api/show, /api/tags and `sidecar check` need the architecture, context length and chat template
of models that may not be loaded; llama.cpp would map the whole file to tell us. Arrays are kept
only when short (the tokenizer's 50k-entry lists are skipped, recorded by length).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
ARRAY_KEEP = 64


class GGUFError(ValueError):
    pass


class ArrayInfo:
    """Stands in for an array too long to keep."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __repr__(self) -> str:
        return f"<array of {self.length}>"


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    if n > 1 << 30:
        raise GGUFError("corrupt string length")
    return f.read(n).decode("utf-8", "replace")


def _value(f: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        etype, n = _read(f, "<I"), _read(f, "<Q")
        if n <= ARRAY_KEEP:
            return [_value(f, etype) for _ in range(n)]
        if etype in _SCALARS:
            f.seek(n * struct.calcsize(_SCALARS[etype]), 1)
        else:
            for _ in range(n):
                _value(f, etype)
        return ArrayInfo(n)
    raise GGUFError(f"unknown GGUF value type {vtype}")


def read_metadata(path: str | Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise GGUFError(f"{path}: GGUF version {version} is too old")
        _n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = _string(f)
            meta[key] = _value(f, _read(f, "<I"))
        return meta
