"""pairs.yaml, as typed data.

A pair is a model name that clients send (always with a tag, like Ollama names) declared like an
Ollama Modelfile: `from` (the target), `draft`, `parameters`, `template`, `system`, `messages`, plus
speculation and runtime settings. Unknown keys are errors, so a typo never silently does nothing.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from sidecar.config.options import OptionError, Options
from sidecar.engine.adaptive import NGRAM_N_MAX, SpeculativeConfig

UpstreamKind = Literal["auto", "ollama", "lmstudio"]
"""What the upstream is: `auto` asks it (Ollama answers /api/version), or either by name."""

NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-/]*:[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Parameters(Options):
    """A pair's `parameters`: Ollama's options (PARAMETER lines), which become the pair's defaults.

    Stricter than a request's options, because a typo in a file should never silently do
    nothing: unknown keys are errors, and so is a value no generation could use."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        # A Modelfile repeats `PARAMETER stop x`; in YAML a single string is the natural spelling.
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _usable(self) -> Parameters:
        try:
            self.check()
        except OptionError as e:
            raise ValueError(str(e)) from None
        return self


class Speculative(Strict):
    """Speculation settings (engine.adaptive.SpeculativeConfig documents each)."""

    n_max: int | None = Field(None, ge=1, le=64)  # None: SpeculativeConfig.n_max, NGRAM_N_MAX for an n-gram draft
    n_min: int = Field(SpeculativeConfig.n_min, ge=1, le=64)
    p_min: float = Field(SpeculativeConfig.p_min, ge=0.0, le=1.0)
    min_predict: int = Field(SpeculativeConfig.min_predict, ge=0)
    fallback_rounds: int = Field(SpeculativeConfig.fallback_rounds, ge=1)
    fallback_margin: float = Field(SpeculativeConfig.fallback_margin, gt=0.0, le=2.0)
    probe_interval: int = Field(SpeculativeConfig.probe_interval, ge=1)
    probe_budget: float = Field(SpeculativeConfig.probe_budget, gt=0.0, le=1.0)
    min_gain: float = Field(SpeculativeConfig.min_gain, ge=1.0, le=2.0)
    horizon: int = Field(SpeculativeConfig.horizon, ge=1)
    adaptive: bool = SpeculativeConfig.adaptive

    @model_validator(mode="after")
    def _order(self) -> Speculative:
        if self.n_max is not None and self.n_min > self.n_max:
            raise ValueError("n_min must not exceed n_max")
        return self

    def engine(self, ngram: bool = False) -> SpeculativeConfig:
        settings = self.model_dump()
        if settings["n_max"] is None:
            settings["n_max"] = NGRAM_N_MAX if ngram else SpeculativeConfig.n_max
        return SpeculativeConfig(**settings)


class LoadSettings(Strict):
    """Load-time settings of one model (Ollama's num_gpu, num_thread, num_batch, ...)."""

    num_gpu: int = -1  # layers to offload; -1 = all, where llama.cpp was built with a GPU backend
    num_thread: int = Field(0, ge=0)  # 0 = every CPU the process may use
    num_batch: int = Field(512, ge=16, le=8192)
    flash_attn: bool = False
    kv_cache_type: Literal["f16", "q8_0", "q4_0"] = "f16"


class Runtime(LoadSettings):
    """The target's load settings, plus how many requests it serves at once.

    `num_parallel` overrides OLLAMA_NUM_PARALLEL for this target: that many contexts (each with
    its own KV cache of num_ctx tokens, and its own draft context) over the one mapped GGUF."""

    num_parallel: int | None = Field(None, ge=1, le=64)


class NgramDraft(Strict):
    type: Literal["ngram"]
    min_n: int = Field(2, ge=1, le=16)
    max_n: int = Field(4, ge=1, le=16)

    @model_validator(mode="after")
    def _order(self) -> NgramDraft:
        if self.min_n > self.max_n:
            raise ValueError("min_n must not exceed max_n")
        return self


class ModelDraft(LoadSettings):
    from_: str = Field(alias="from", min_length=1)


def _draft_kind(v: Any) -> str:
    if isinstance(v, dict):
        return "ngram" if v.get("type") == "ngram" else "model"
    return "ngram" if isinstance(v, NgramDraft) else "model"


Draft = Annotated[
    Annotated[NgramDraft, Tag("ngram")] | Annotated[ModelDraft, Tag("model")], Discriminator(_draft_kind)
]


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class Pair(Strict):
    from_: str = Field(alias="from", min_length=1)
    draft: Draft | None = None
    parameters: Parameters = Field(default_factory=Parameters)
    template: str | None = None
    system: str | None = None
    messages: list[Message] = Field(default_factory=list)
    speculative: Speculative = Field(default_factory=Speculative)
    runtime: Runtime = Field(default_factory=Runtime)
    adapter: Any = None

    @property
    def draft_label(self) -> str | None:
        """The draft as people name it: None, "ngram", or its model reference."""
        if self.draft is None:
            return None
        return "ngram" if isinstance(self.draft, NgramDraft) else self.draft.from_

    @field_validator("draft", mode="before")
    @classmethod
    def _draft_shorthand(cls, v: Any) -> Any:
        if v is None or v == "none":
            return None
        if v == "ngram":
            return {"type": "ngram"}
        if isinstance(v, str):
            return {"from": v}
        return v

    @model_validator(mode="after")
    def _n_min_fits_the_default_n_max(self) -> Pair:
        """Speculative checks an explicit n_max; without one, the default depends on the draft."""
        n_max = self.speculative.engine(ngram=isinstance(self.draft, NgramDraft)).n_max
        if self.speculative.n_max is None and self.speculative.n_min > n_max:
            raise ValueError(f"speculative.n_min {self.speculative.n_min} exceeds the default n_max {n_max}: set n_max")
        return self

    @field_validator("adapter")
    @classmethod
    def _no_adapter(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("ADAPTER (LoRA) is not supported; merge the adapter into the GGUF first")
        return v


def _pair_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise ValueError(f"pair name {name!r} needs Ollama's form with an explicit tag, e.g. 'llama3.1:70b-spec'")
    return name


PairName = Annotated[str, AfterValidator(_pair_name)]


class Config(Strict):
    pairs: dict[PairName, Pair] = Field(default_factory=dict)
    upstream: str | None = None
    upstream_kind: UpstreamKind | None = None
    listen: str | None = None
    drain_timeout: float | None = Field(None, ge=0)  # seconds streams may finish on SIGTERM (read at start)
    models: dict[str, str] = Field(default_factory=dict)  # store locations: ollama, lmstudio

