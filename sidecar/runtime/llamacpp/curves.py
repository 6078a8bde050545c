"""The measured costs of a model on this machine, kept between loads.

The schedule needs what verifying n rows costs here (the target's verify curve) and what a draft
step and a catch-up token cost (the draft's timing). Measuring them takes seconds on a quiet CPU
and minutes on a busy one, and the numbers only depend on the model file, the build, the threads
and the batch and cache settings, so a load measures them once and later loads read them back
(keyed by all of those, with num_ctx in power-of-two buckets). A measurement that looked disturbed
is provisional: it is used, the cost model's fit replaces it, and it is never cached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sidecar.engine.backend import backend_id, default_threads
from sidecar.engine.cost import CostModel
from sidecar.engine.llama import Context
from sidecar.engine.seqview import SeqView
from sidecar.models.cache import FileCache
from sidecar.storage import KeyedCache, cache_dir

FORMAT = "spec-sidecar/cost-curve-1"


def curve_key(path: Path, ctx: Context | SeqView, gpu_layers: int, role: str, rows: int = 0) -> dict[str, Any]:
    """What fixes a model's timings here; `rows` is how much of the verify curve is wanted."""
    p = ctx.params
    bucket = 1 << max(0, ctx.n_ctx - 1).bit_length()
    return {"model": FileCache.key(path), "role": role, "backend": backend_id(),
            "threads": p.n_threads or default_threads(), "batch": ctx.n_batch, "flash_attn": p.flash_attn,
            "kv": [p.type_k, p.type_v], "ctx": bucket, "gpu": gpu_layers, "rows": rows}


class CurveCache:
    def __init__(self, root: Path | None = None) -> None:
        self._cache = KeyedCache(root or cache_dir() / "curves", FORMAT)

    def target(self, key: dict[str, Any], rows: int) -> CostModel | None:
        value = self._cache.get(key)
        try:
            t_step = [float(x) for x in value["t_step"]]
            t_switch = float(value["t_switch"])
        except (TypeError, KeyError, ValueError):
            return None
        if len(t_step) != rows + 1 or t_step[1] <= 0:
            return None
        cost = CostModel(rows)
        cost.t_step, cost.t_switch = t_step, t_switch
        return cost

    def put_target(self, key: dict[str, Any], cost: CostModel) -> None:
        self._cache.put(key, {"t_step": cost.t_step, "t_switch": cost.t_switch})

    def draft(self, key: dict[str, Any]) -> tuple[float, float] | None:
        value = self._cache.get(key)
        try:
            step, catchup = float(value["t_draft"]), float(value["t_catchup"])
        except (TypeError, KeyError, ValueError):
            return None
        return (step, catchup) if step > 0 else None

    def put_draft(self, key: dict[str, Any], cost: CostModel) -> None:
        self._cache.put(key, {"t_draft": cost.t_draft, "t_catchup": cost.t_catchup})
