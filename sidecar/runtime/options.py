"""Ollama's `options`: types, defaults, merge order, and the checks that keep absurd values out.

Merge order is Ollama's: built-in defaults, then the model's params layer, then the pair's
`parameters`, then the request's `options`. Unknown keys are ignored (Ollama logs them); `null`
values are skipped; integer fields accept any JSON number (truncated), float fields accept ints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sidecar.engine.sampling import SamplingParams

INT, FLOAT, BOOL, ARRAY = "integer", "float32", "boolean", "array"

TYPES: dict[str, str] = {
    "num_keep": INT, "seed": INT, "num_predict": INT, "top_k": INT, "top_p": FLOAT, "min_p": FLOAT,
    "typical_p": FLOAT, "repeat_last_n": INT, "temperature": FLOAT, "repeat_penalty": FLOAT,
    "presence_penalty": FLOAT, "frequency_penalty": FLOAT, "stop": ARRAY, "num_ctx": INT,
    "num_batch": INT, "num_gpu": INT, "main_gpu": INT, "use_mmap": BOOL, "num_thread": INT,
    "draft_num_predict": INT,
}

MAX_CTX = 1 << 20  # no GGUF in circulation trains longer; larger asks are typos or attacks


class OptionError(ValueError):
    """A bad option; the message is what the client sees."""


def coerce(options: Any) -> dict[str, Any]:
    """Type-check a request's options object the way Ollama's Options.FromMap does."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise OptionError("options must be an object")
    out: dict[str, Any] = {}
    for key, value in options.items():
        kind = TYPES.get(key)
        if kind is None or value is None:
            continue
        if kind == INT:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise OptionError(f'option "{key}" must be of type integer')
            value = int(value)
        elif kind == FLOAT:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise OptionError(f'option "{key}" must be of type float32')
            value = float(value)
        elif kind == BOOL and not isinstance(value, bool):
            raise OptionError(f'option "{key}" must be of type boolean')
        elif kind == ARRAY and (not isinstance(value, list) or not all(isinstance(s, str) for s in value)):
            raise OptionError(f'option "{key}" must be of type array')
        out[key] = value
    return out


@dataclass(frozen=True)
class Effective:
    """Everything a generation needs from the merged options."""

    sampling: SamplingParams
    num_predict: int = -1
    stop: list[str] = field(default_factory=list)
    num_ctx: int | None = None
    draft_num_predict: int | None = None


def effective(*layers: dict[str, Any]) -> Effective:
    """Merge option layers (later wins) and validate the values, not only their types."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update({k: v for k, v in layer.items() if v is not None})
    d = SamplingParams()
    temperature = float(merged.get("temperature", d.temperature))
    top_p = float(merged.get("top_p", d.top_p))
    min_p = float(merged.get("min_p", d.min_p))
    top_k = int(merged.get("top_k", d.top_k))
    repeat_penalty = float(merged.get("repeat_penalty", d.repeat_penalty))
    presence = float(merged.get("presence_penalty", d.presence_penalty))
    frequency = float(merged.get("frequency_penalty", d.frequency_penalty))
    for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p),
                    ("repeat_penalty", repeat_penalty), ("presence_penalty", presence),
                    ("frequency_penalty", frequency)):
        if not math.isfinite(v):
            raise OptionError(f'option "{name}" must be a finite number')
    if temperature < 0:
        raise OptionError('option "temperature" must be >= 0')
    if not 0.0 <= top_p <= 1.0:
        raise OptionError('option "top_p" must be between 0 and 1')
    if not 0.0 <= min_p <= 1.0:
        raise OptionError('option "min_p" must be between 0 and 1')
    if top_k < 0:
        raise OptionError('option "top_k" must be >= 0 (0 disables it)')
    if repeat_penalty <= 0:
        raise OptionError('option "repeat_penalty" must be > 0')
    repeat_last_n = int(merged.get("repeat_last_n", d.repeat_last_n))
    if repeat_last_n < -1:
        raise OptionError('option "repeat_last_n" must be >= -1 (-1 = num_ctx, 0 = off)')
    num_predict = int(merged.get("num_predict", -1))
    if num_predict < -2:
        raise OptionError('option "num_predict" must be >= -2 (-1 = no limit, -2 = fill the context)')
    num_ctx = merged.get("num_ctx")
    if num_ctx is not None and not 1 <= int(num_ctx) <= MAX_CTX:
        raise OptionError(f'option "num_ctx" must be between 1 and {MAX_CTX}')
    dnp = merged.get("draft_num_predict")
    if dnp is not None and int(dnp) < 0:
        raise OptionError('option "draft_num_predict" must be >= 0 (0 disables speculation)')
    return Effective(
        sampling=SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, presence_penalty=presence,
            frequency_penalty=frequency, seed=int(merged.get("seed", d.seed)),
        ),
        num_predict=-1 if num_predict < 0 else num_predict,
        stop=list(merged.get("stop") or []),
        num_ctx=int(num_ctx) if num_ctx is not None else None,
        draft_num_predict=int(dnp) if dnp is not None else None,
    )
