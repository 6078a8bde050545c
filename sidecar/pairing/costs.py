"""What the daemon measured models to cost while serving them, kept by file for the pairing verdicts.

A probe's agreement holds for good (greedy decoding is deterministic), but its timings are one
small-context measurement, taken once. The serving cost model measures the real thing: the target's
verify curve and the draft's step, at the pair's own settings, at every load that has no cached
curve, and only keeps what it measured on a quiet machine. So where the daemon has served a model,
its measurement prices the probe's agreement instead of the probe's own timings (pairing.probe):
a verdict taken on stale timings is overturned at the next load of the stores (`draft: auto`,
`auto: true`, `sidecar suggest`).

Records are keyed by the file, its role, the llama.cpp build and backends (backend_id) and the
threads; GPU offload is not in the key, as the probe and serving both offload every layer a GPU
build can take unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sidecar.engine.backend import backend_id
from sidecar.models.cache import FileCache
from sidecar.storage import KeyedCache, cache_dir

FORMAT = "spec-sidecar/served-costs-1"


class ServedCosts:
    """One JSON file per (model file, role) under $XDG_CACHE_HOME/spec-sidecar/served (KeyedCache)."""

    def __init__(self, root: Path | None = None) -> None:
        self._cache = KeyedCache(root or cache_dir() / "served", FORMAT)

    @staticmethod
    def _key(path: Path, role: str, threads: int) -> dict[str, Any]:
        """Raises OSError when the file cannot be looked at."""
        return {"model": FileCache.key(path), "role": role, "backend": backend_id(), "threads": threads}

    def put_target(self, path: Path, t_step: Sequence[float], threads: int) -> None:
        """A quiet measurement of the target's verify curve (t_step[n]: seconds for n rows)."""
        self._cache.put(self._key(path, "target", threads), {"t_step": list(t_step)})

    def put_draft(self, path: Path, t_draft: float, threads: int) -> None:
        """A quiet measurement of the draft's one-token step."""
        self._cache.put(self._key(path, "draft", threads), {"t_draft": t_draft})

    def target(self, path: Path, threads: int) -> tuple[float, ...] | None:
        value = self._cache.get(self._key(path, "target", threads))
        try:
            t_step = tuple(float(t) for t in value["t_step"])
        except (TypeError, KeyError, ValueError):
            return None
        return t_step if len(t_step) >= 3 and t_step[1] > 0 else None

    def draft(self, path: Path, threads: int) -> float | None:
        value = self._cache.get(self._key(path, "draft", threads))
        try:
            t_draft = float(value["t_draft"])
        except (TypeError, KeyError, ValueError):
            return None
        return t_draft if t_draft > 0 else None
