"""Small files the daemon keeps between runs: where they live, and writing them safely.

Everything here is a cache: a missing, corrupt or foreign file reads as empty, and one that cannot
be written only costs the next run the work it would have saved; neither is ever an error. Files
are replaced atomically (a temporary file, then a rename), so a daemon and a `sidecar suggest`
running at once never see half a file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("sidecar.storage")


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/spec-sidecar, or ~/.cache/spec-sidecar (the XDG spec ignores a relative value)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "spec-sidecar"


def write_json(path: Path, doc: Any) -> bool:
    """Replace `path` with `doc` as JSON; False (logged) when it cannot be written."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, path)
        tmp = None
        return True
    except OSError as e:
        log.warning("could not write the cache file %s: %s", path, e)
        return False
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def read_json(path: Path) -> Any:
    """The JSON value in `path`, or None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class KeyedCache:
    """JSON records under a directory, one file per key (a JSON-able dict), tagged with `format`.

    One file each, so concurrent writers of different keys never lose each other's records; a file
    whose format or key does not match (another version, a hash collision) is a miss."""

    def __init__(self, root: Path, format: str) -> None:
        self.root = root
        self.format = format

    def _file(self, key: dict[str, Any]) -> Path:
        return self.root / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]}.json"

    def get(self, key: dict[str, Any]) -> Any:
        doc = read_json(self._file(key))
        if not isinstance(doc, dict) or doc.get("format") != self.format or doc.get("key") != key:
            return None
        return doc.get("value")

    def put(self, key: dict[str, Any], value: Any) -> None:
        write_json(self._file(key), {"format": self.format, "key": key, "value": value})
