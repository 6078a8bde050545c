"""Read a GGUF file's header (key/value metadata, tensor infos) without loading the model.

/api/show, /api/tags and `sidecar check` need the architecture, context length and chat template
of models that may not be loaded, and draft suggestions need the tokenizer of every model in the
stores; llama.cpp would load the whole vocabulary (and more) to tell us. The file is memory-mapped
and walked in place, so only the header's pages are ever read. Arrays are kept only when short,
or when named in `keep_strings` (the tokenizer's token texts); other long arrays are skipped and
recorded by length.
"""

from __future__ import annotations

import mmap
import struct
from array import array
from collections.abc import Collection
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
ARRAY_KEEP = 64

# llama.cpp's llama_ftype (llama.h): what `general.file_type` says the weights are stored as.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0", 41: "Q2_0",
}


class GGUFError(ValueError):
    pass


class ArrayInfo:
    """Stands in for an array too long to keep."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __repr__(self) -> str:
        return f"<array of {self.length}>"


class StringArray:
    """A long GGUF string array kept as the bytes it was stored as, plus where each item starts.

    One buffer instead of 150k `bytes` objects, and `serialized` hands out the stored form of a run
    of items (u64 length + bytes each), an unambiguous encoding to hash without re-encoding."""

    def __init__(self, data: bytes, starts: array) -> None:
        self._data = data
        self._starts = starts  # len(items) + 1 entries; the last is len(data)

    def __len__(self) -> int:
        return len(self._starts) - 1

    def __getitem__(self, i: int) -> bytes:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._data[self._starts[i] + 8 : self._starts[i + 1]]

    def tolist(self) -> list[bytes]:
        """Every item at once, several times faster than indexing one by one."""
        data, starts = self._data, self._starts
        return [data[a + 8 : b] for a, b in pairwise(starts)]

    def serialized(self, start: int, end: int) -> memoryview:
        """The stored form of items [start, end)."""
        return memoryview(self._data)[self._starts[start] : self._starts[end]]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo] = field(default_factory=list)  # filled only when asked for
    strings: dict[str, StringArray] = field(default_factory=dict)  # the `keep_strings` arrays found


class _Reader:
    """A cursor over the mapped file; every read is bounds-checked so a corrupt header is a GGUFError."""

    def __init__(self, buf: mmap.mmap, keep_strings: Collection[str], keep_arrays: bool = False) -> None:
        self.buf = buf
        self.pos = 0
        self.keep_strings = keep_strings
        self.keep_arrays = keep_arrays
        self.strings: dict[str, StringArray] = {}

    def unpack(self, fmt: str | struct.Struct) -> Any:
        s = fmt if isinstance(fmt, struct.Struct) else struct.Struct(fmt)
        try:
            value = s.unpack_from(self.buf, self.pos)[0]
        except struct.error:
            raise GGUFError("truncated GGUF header") from None
        self.pos += s.size
        return value

    def unpack_many(self, s: struct.Struct) -> tuple[Any, ...]:
        try:
            values = s.unpack_from(self.buf, self.pos)
        except struct.error:
            raise GGUFError("truncated GGUF header") from None
        self.pos += s.size
        return values

    def string(self) -> str:
        n = self.unpack(_U64)
        if n > len(self.buf) - self.pos:
            raise GGUFError("corrupt string length")
        self.pos += n
        return self.buf[self.pos - n : self.pos].decode("utf-8", "replace")

    def _walk_strings(self, n: int, starts: array | None) -> None:
        """Step over n strings, noting where each starts (relative to the first) when given `starts`."""
        first, buf, unpack = self.pos, self.buf, _U64.unpack_from
        pos = first
        try:
            for i in range(n):
                if starts is not None:
                    starts[i] = pos - first
                pos += 8 + unpack(buf, pos)[0]
        except struct.error:
            raise GGUFError("truncated GGUF header") from None
        if pos > len(buf):
            raise GGUFError("corrupt string length")
        self.pos = pos

    def kept_strings(self, n: int) -> StringArray:
        first, starts = self.pos, array("Q", bytes(8 * (n + 1)))
        self._walk_strings(n, starts)
        starts[n] = self.pos - first
        return StringArray(self.buf[first : self.pos], starts)

    def value(self, vtype: int, key: str | None = None) -> Any:
        """One value; `key` is set for top-level values only (nested arrays are never kept whole)."""
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise GGUFError(f"unknown GGUF value type {vtype}")
        etype, n = self.unpack(_U32), self.unpack(_U64)
        if etype == _STRING and key is not None and key in self.keep_strings:
            self.strings[key] = self.kept_strings(n)
        elif n <= ARRAY_KEEP or (self.keep_arrays and etype == _STRING):
            return [self.value(etype) for _ in range(n)]
        elif self.keep_arrays and etype in _SCALARS:
            fmt = struct.Struct(f"<{n}{_SCALARS[etype][1]}")
            return list(self.unpack_many(fmt))
        elif etype in _SCALARS:
            size = n * struct.calcsize(_SCALARS[etype])
            if size > len(self.buf) - self.pos:
                raise GGUFError("truncated GGUF header")
            self.pos += size
        elif etype == _STRING:
            self._walk_strings(n, None)
        else:
            for _ in range(n):
                self.value(etype)
        return ArrayInfo(n)


def read_header(path: str | Path, *, keep_strings: Collection[str] = (), tensors: bool = False,
                keep_arrays: bool = False) -> Header:
    """The metadata, plus the tensor infos when `tensors`, plus the `keep_strings` arrays in full
    (as StringArray), or with `keep_arrays` every array in full, as lists (what `ollama show
    --verbose` prints).

    A kept array still appears in `metadata`, as an ArrayInfo, so key lookups do not depend on what
    was kept."""
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError:  # mmap refuses an empty file
        raise GGUFError(f"{path} is not a GGUF file") from None
    try:
        if buf[:4] != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file")
        r = _Reader(buf, keep_strings, keep_arrays)
        r.pos = 4
        version = r.unpack(_U32)
        if version < 2:
            raise GGUFError(f"{path}: GGUF version {version} is too old")
        n_tensors, n_kv = r.unpack(_U64), r.unpack(_U64)
        header = Header(version, {}, strings=r.strings)
        for _ in range(n_kv):
            key = r.string()
            header.metadata[key] = r.value(r.unpack(_U32), key)
        if tensors:
            for _ in range(n_tensors):
                name = r.string()
                n_dims = r.unpack(_U32)
                if n_dims > 8:
                    raise GGUFError(f"{path}: tensor {name} has {n_dims} dimensions")
                shape = tuple(r.unpack(_U64) for _ in range(n_dims))
                ggml_type = r.unpack(_U32)
                r.unpack(_U64)  # data offset
                header.tensors.append(TensorInfo(name, shape, ggml_type))
        return header
    finally:
        buf.close()


def read_metadata(path: str | Path, *, full: bool = False) -> dict[str, Any]:
    """The key/value metadata; long arrays as ArrayInfo unless `full`."""
    return read_header(path, keep_arrays=full).metadata
