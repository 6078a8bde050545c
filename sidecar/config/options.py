"""Ollama's `options`, declared once: types, defaults and the checks that keep absurd values out.

The same model types a request's `options` (sidecar.api), a pair's `parameters` in pairs.yaml
(config.schema.Parameters) and the Ollama params layer of a model, and it is what they merge into
(runtime.options.effective). Types follow Ollama's Options.FromMap (api/types.go): integer fields
accept any finite JSON number (truncated), float fields accept integers, and a wrong type is
`option "k" must be of type integer|float32|boolean|array`. Unknown keys are ignored, and `null`
values are skipped. Defaults are Ollama's DefaultOptions; the sampling ones are the engine's
SamplingParams, which documents them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from sidecar.engine.sampling import SamplingParams
from sidecar.errors import ClientError

MAX_CTX = 1 << 20  # no GGUF in circulation trains longer; larger asks are typos or attacks

_S = SamplingParams()


class OptionError(ClientError):
    """A bad option; the message is what the client sees."""


def _type_error(kind: str) -> PydanticCustomError:
    return PydanticCustomError("option_type", "must be of type {kind}", {"kind": kind})


def _as_int(v: Any) -> Any:
    if v is None:
        return v
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _type_error("integer")
    return int(v)


def _as_float(v: Any) -> Any:
    if v is None:
        return v
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _type_error("float32")
    return float(v)


def _as_bool(v: Any) -> Any:
    if v is not None and not isinstance(v, bool):
        raise _type_error("boolean")
    return v


def _as_strings(v: Any) -> Any:
    if v is not None and (not isinstance(v, list) or not all(isinstance(s, str) for s in v)):
        raise _type_error("array")
    return v


GoInt = Annotated[int, BeforeValidator(_as_int)]
GoFloat = Annotated[float, BeforeValidator(_as_float)]
GoBool = Annotated[bool, BeforeValidator(_as_bool)]
Strings = Annotated[list[str], BeforeValidator(_as_strings)]


class Options(BaseModel):
    """Ollama's Options (api/types.go) with Ollama's defaults."""

    model_config = ConfigDict(extra="ignore")

    num_keep: GoInt = 4
    seed: GoInt = _S.seed
    num_predict: GoInt = -1  # -1: no limit; -2: fill the context
    top_k: GoInt = _S.top_k
    top_p: GoFloat = _S.top_p
    min_p: GoFloat = _S.min_p
    typical_p: GoFloat = 1.0
    repeat_last_n: GoInt = _S.repeat_last_n
    temperature: GoFloat = _S.temperature
    repeat_penalty: GoFloat = _S.repeat_penalty
    presence_penalty: GoFloat = _S.presence_penalty
    frequency_penalty: GoFloat = _S.frequency_penalty
    stop: Strings = Field(default_factory=list)
    # Load-time options. num_ctx None: the pair's default. num_gpu -1: the pair's (its `runtime:`
    # num_gpu, else the memory plan's count); a count reloads the target with that many layers on the
    # GPUs where the loaded one has another (Ollama's needsReload, server/sched.go; -1 never reloads).
    # The others are the pair's `runtime:` settings here (a request cannot change how a shared model
    # was loaded), accepted and ignored.
    num_ctx: GoInt | None = None
    num_batch: GoInt = 512
    num_gpu: GoInt = -1
    main_gpu: GoInt | None = None
    use_mmap: GoBool | None = None
    num_thread: GoInt = 0
    draft_num_predict: GoInt | None = None  # max draft tokens per round; 0 turns speculation off

    def check(self) -> None:
        """Raise OptionError for the first value no generation could use."""
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise OptionError(f'option "{name}" must be a finite number')
        if self.temperature < 0:
            raise OptionError('option "temperature" must be >= 0')
        if not 0.0 <= self.top_p <= 1.0:
            raise OptionError('option "top_p" must be between 0 and 1')
        if not 0.0 <= self.min_p <= 1.0:
            raise OptionError('option "min_p" must be between 0 and 1')
        if self.top_k < 0:
            raise OptionError('option "top_k" must be >= 0 (0 disables it)')
        if self.repeat_penalty <= 0:
            raise OptionError('option "repeat_penalty" must be > 0')
        if self.repeat_last_n < -1:
            raise OptionError('option "repeat_last_n" must be >= -1 (-1 = num_ctx, 0 = off)')
        if self.num_predict < -2:
            raise OptionError('option "num_predict" must be >= -2 (-1 = no limit, -2 = fill the context)')
        if self.num_ctx is not None and not 0 <= self.num_ctx <= MAX_CTX:
            raise OptionError(f'option "num_ctx" must be between 0 and {MAX_CTX}')
        if self.draft_num_predict is not None and self.draft_num_predict < 0:
            raise OptionError('option "draft_num_predict" must be >= 0 (0 disables speculation)')


def validate(values: dict[str, Any]) -> Options:
    """Options from known, non-null values; a wrong type is Ollama's OptionError."""
    known = {k: v for k, v in values.items() if k in Options.model_fields and v is not None}
    try:
        return Options.model_validate(known)
    except ValidationError as e:
        err = e.errors()[0]  # every field's validator above raises option_type
        raise OptionError(f'option "{err["loc"][0]}" {err["msg"]}') from None


def coerce(options: Any) -> dict[str, Any]:
    """Type-check a request's options object the way Ollama's Options.FromMap does.

    Returns only the keys the request set (coerced), so it can be layered over a pair's defaults."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise OptionError("options must be an object")
    return validate(options).model_dump(exclude_unset=True)
