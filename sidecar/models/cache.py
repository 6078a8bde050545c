"""Facts derived from GGUF files, cached on disk per file so a store is rescanned without reading them.

Scanning a store for drafts (pairing.catalog) reads every GGUF's header, and a load's measured cost
curves (runtime.llamacpp.curves) key on the model file; both key a file by what fixes its content.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sidecar.storage import cache_dir, read_json, write_json

_BLOB_RE = re.compile(r"^sha256-[0-9a-f]{64}$")
CACHE_FORMAT = "spec-sidecar/gguf-facts"
CACHE_VERSION = 1


class FileCache:
    """Facts derived from GGUF files, keyed by what fixes a file's content, kept as one JSON file.

    An Ollama blob is named by its sha256, so that name is the key and holds wherever the store
    lives; any other file is keyed by (resolved path, size, mtime_ns), which changes whenever the
    file does. Records are the caller's JSON values. A missing, corrupt or foreign cache file is an
    empty cache, and a cache that cannot be written only costs the next scan its speed: neither is
    ever an error."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_dir() / "gguf-facts.json"
        self._entries = self._load()
        self._used: set[str] = set()
        self._dirty = False
        self.hits = self.misses = 0

    def _load(self) -> dict[str, Any]:
        doc = read_json(self.path)
        ok = isinstance(doc, dict) and doc.get("format") == CACHE_FORMAT and doc.get("version") == CACHE_VERSION
        entries = doc.get("entries") if ok else None
        return entries if isinstance(entries, dict) else {}

    @staticmethod
    def key(path: Path) -> str:
        """Raises OSError when the file cannot be looked at."""
        if _BLOB_RE.match(path.name):
            return path.name
        st = path.stat()
        return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"

    def get(self, key: str) -> Any:
        """The record stored under key, or None."""
        self._used.add(key)
        record = self._entries.get(key)
        if record is None:
            self.misses += 1
        else:
            self.hits += 1
        return record

    def put(self, key: str, record: Any) -> None:
        self._used.add(key)
        self._entries[key] = record
        self._dirty = True

    def save(self, *, prune: bool = False) -> None:
        """Write the cache atomically (temporary file, then rename); `prune` drops entries not used
        since this cache was opened, so files gone from the stores leave it too."""
        if prune and set(self._entries) - self._used:
            self._entries = {k: v for k, v in self._entries.items() if k in self._used}
            self._dirty = True
        if not self._dirty:
            return
        doc = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "entries": self._entries}
        if write_json(self.path, doc):
            self._dirty = False
