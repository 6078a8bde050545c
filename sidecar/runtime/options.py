"""The merged options of one generation, in the engine's terms.

Merge order is Ollama's: built-in defaults (config.options.Options), then the model's params
layer, then the pair's `parameters`, then the request's `options`. A later layer wins, and a
`null` never erases an earlier value. Only the merged result is range-checked, so a bad default
that a request overrides is harmless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sidecar.config.options import validate
from sidecar.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Effective:
    """Everything a generation needs from the merged options."""

    sampling: SamplingParams
    num_predict: int = -1
    stop: list[str] = field(default_factory=list)
    num_ctx: int | None = None
    num_gpu: int = -1  # the target's layers on the GPUs; -1: the pair's (runtime.manager)
    draft_num_predict: int | None = None
    num_keep: int = 4  # tokens a truncated prompt or a context shift keeps at the start


def effective(*layers: dict[str, Any]) -> Effective:
    """Merge option layers (later wins) and validate the values, not only their types."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update({k: v for k, v in layer.items() if v is not None})
    o = validate(merged)
    o.check()
    return Effective(
        sampling=SamplingParams(
            temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, min_p=o.min_p,
            repeat_penalty=o.repeat_penalty, repeat_last_n=o.repeat_last_n, presence_penalty=o.presence_penalty,
            frequency_penalty=o.frequency_penalty, seed=o.seed,
        ),
        num_predict=-1 if o.num_predict < 0 else o.num_predict,
        stop=list(o.stop),
        num_ctx=o.num_ctx,
        num_gpu=max(o.num_gpu, -1),
        draft_num_predict=o.draft_num_predict,
        num_keep=o.num_keep,
    )
