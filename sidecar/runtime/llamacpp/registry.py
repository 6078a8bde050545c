"""Weights shared by reference count, so a GGUF used by several pairs (and slots) is mapped once."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from sidecar.engine.backend import gpu_offload_supported
from sidecar.engine.llama import Weights

log = logging.getLogger("sidecar.runtime")


class WeightsRegistry:
    """Weights shared by reference count, so a GGUF used by several pairs is mapped once."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, int], tuple[Weights, int]] = {}
        # Targets load on to_thread workers and drafts on model threads, and reloads release from
        # several threads at once: without the lock two loads of one file could both map it.
        self._lock = threading.RLock()

    def acquire(self, path: Path, n_gpu_layers: int, role: str = "target") -> Weights:
        with self._lock:
            return self._acquire(path, n_gpu_layers, role)

    def _acquire(self, path: Path, n_gpu_layers: int, role: str) -> Weights:
        key = (str(path.resolve()), n_gpu_layers)
        w, n = self._loaded.get(key, (None, 0))
        if w is None:
            # A big model takes a while to map (and longer to offload): say so before, and after.
            size = path.stat().st_size
            log.info("loading %s model %s (%.1f MiB)", role, path, size / 2**20)
            t0 = time.perf_counter()
            w = Weights(path, n_gpu_layers=n_gpu_layers)
            log.info(
                "%s model loaded: %s in %.2fs, %d of %d layers on the GPU (%s)", role, path.name,
                time.perf_counter() - t0, w.gpu_layers, w.n_layer + 1,
                "GPU offload available" if gpu_offload_supported() else "CPU only",
            )
        else:
            log.info("%s model %s already loaded; shared (%d users)", role, path.name, n + 1)
        self._loaded[key] = (w, n + 1)
        return w

    def release(self, w: Weights) -> None:
        with self._lock:
            self._release(w)

    def _release(self, w: Weights) -> None:
        for key, (held, n) in list(self._loaded.items()):
            if held is w:
                if n <= 1:
                    del self._loaded[key]
                    w.close()
                else:
                    self._loaded[key] = (held, n - 1)
                return

    @property
    def count(self) -> int:
        return len(self._loaded)

    def snapshot(self) -> list[dict[str, Any]]:
        """What is mapped and how many contexts share it (for /sidecar/status)."""
        # No lock: this runs on the event loop, and acquire() holds the lock while a model loads.
        loaded = dict(self._loaded)  # a C-level copy, atomic under the GIL
        return [{"path": path, "num_gpu": gpu, "refs": n} for (path, gpu), (_, n) in loaded.items()]
