"""The cross-request suffix caches (engine.suffix), kept for the daemon's lifetime.

A cache learns from every finished request of the pairs that use it, so it outlives their engines:
a reload that rebuilds a pair's drafter keeps what the pair learnt. Scope `pair` gives each pair its
own; `global` shares one among every pair on the same vocabulary (token ids must mean the same
text for a continuation learnt from one model to draft for another); `off` drafts without one. A
`cache_file` is read when the cache is made and written when the daemon unloads models or stops.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from sidecar.config.entries import PairEntry
from sidecar.engine.llama import Weights
from sidecar.engine.suffix import SuffixCache
from sidecar.pairing.vocab import vocab_id

log = logging.getLogger("sidecar.runtime")


class SuffixCaches:
    def __init__(self) -> None:
        self._caches: dict[str, tuple[SuffixCache, Path | None]] = {}
        self._lock = threading.Lock()  # pairs load on several threads

    def for_pair(self, entry: PairEntry, weights: Weights) -> SuffixCache | None:
        """The cache the pair drafts from beside its n-gram drafter, or None (no n-gram drafter, or off)."""
        spec = entry.config.speculative
        if spec.cache == "off" or entry.ngram is None:
            return None
        vocab = vocab_id(weights) if spec.cache == "global" else None  # tens of ms: only when needed
        key = f"pair:{entry.name}" if vocab is None else f"vocab:{vocab}"
        path = (entry.base / spec.cache_file) if spec.cache_file and entry.base else \
            Path(spec.cache_file).expanduser() if spec.cache_file else None
        with self._lock:
            held = self._caches.get(key)
            if held is None:
                cache = SuffixCache(capacity=spec.cache_tokens, vocab=vocab or vocab_id(weights))
                if path is not None and cache.load(path):
                    log.info("suffix cache for %s: %d tokens from %s", entry.name, cache.size, path)
                held = self._caches[key] = (cache, path)
            return held[0]

    def save(self) -> None:
        """Write every cache that has a file (blocking)."""
        with self._lock:
            held = list(self._caches.values())
        for cache, path in held:
            if path is not None:
                cache.save(path)
