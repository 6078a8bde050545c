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
    ValidationInfo,
    field_validator,
    model_validator,
)

from sidecar.config.options import OptionError, Options
from sidecar.engine.adaptive import NGRAM_N_MAX, SpeculativeConfig
from sidecar.engine.backend import gpu_offload_supported

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


RETIRED = ("fallback_rounds", "probe_interval", "probe_budget")


class Speculative(Strict):
    """Speculation settings (engine.adaptive.SpeculativeConfig documents each)."""

    n_max: int | None = Field(None, ge=1, le=64)  # None: SpeculativeConfig.n_max, NGRAM_N_MAX for an n-gram draft
    n_min: int = Field(SpeculativeConfig.n_min, ge=1, le=64)
    p_min: float = Field(SpeculativeConfig.p_min, ge=0.0, le=1.0)
    min_predict: int = Field(SpeculativeConfig.min_predict, ge=0)
    fallback_margin: float = Field(SpeculativeConfig.fallback_margin, gt=0.0, le=2.0)
    # Retired with the probes and the judge (engine.evidence's draws explore instead): still read,
    # so an older pairs.yaml loads, and ignored.
    fallback_rounds: int | None = Field(None, ge=1)
    probe_interval: int | None = Field(None, ge=1)
    probe_budget: float | None = Field(None, gt=0.0, le=1.0)
    min_gain: float = Field(SpeculativeConfig.min_gain, ge=1.0, le=2.0)
    horizon: int = Field(SpeculativeConfig.horizon, ge=1)
    adaptive: bool = SpeculativeConfig.adaptive
    # The cross-request suffix cache that drafts beside the n-gram drafter: one per pair, one per
    # vocabulary shared by every pair on it (`global`), or none. Output never changes; speed does,
    # which on a shared daemon tells a client whether others asked the same (README).
    cache: Literal["pair", "global", "off"] = "pair"
    cache_tokens: int = Field(2_000_000, ge=1024)  # memory bound: tokens kept, oldest requests evicted first
    cache_file: str | None = None  # persist the cache there across restarts (relative to pairs.yaml)

    @field_validator("cache", mode="before")
    @classmethod
    def _off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _order(self) -> Speculative:
        if self.n_max is not None and self.n_min > self.n_max:
            raise ValueError("n_min must not exceed n_max")
        return self

    def engine(self, ngram: bool = False) -> SpeculativeConfig:
        settings = self.model_dump(exclude={"cache", "cache_tokens", "cache_file", *RETIRED})
        if settings["n_max"] is None:
            settings["n_max"] = NGRAM_N_MAX if ngram else SpeculativeConfig.n_max
        return SpeculativeConfig(**settings)


class LoadSettings(Strict):
    """Load-time settings of one model (Ollama's num_gpu, num_thread, num_batch, ...)."""

    num_gpu: int = -1  # layers to offload; -1 = what the memory plan fits (runtime.memory; docs/memory.md)
    num_thread: int = Field(0, ge=0)  # 0 = every CPU the process may use
    num_batch: int = Field(512, ge=16, le=8192)
    # None: on where the model's layers go to a GPU (no batch invariance to keep there, and prefill
    # is faster), off on a CPU, where it breaks exact equality with more than one thread (README).
    flash_attn: bool | None = None
    kv_cache_type: Literal["f16", "q8_0", "q4_0"] = "f16"

    @property
    def flash(self) -> bool:
        """The flash-attention setting a context is created with."""
        if self.flash_attn is not None:
            return self.flash_attn
        return self.num_gpu != 0 and gpu_offload_supported()


class Runtime(LoadSettings):
    """The target's load settings, plus how many requests it serves at once.

    `num_parallel` overrides OLLAMA_NUM_PARALLEL for this target: that many sequences decoded in
    one batch, each on a KV stream of num_ctx positions of the one context (and of the draft's)."""

    num_parallel: int | None = Field(None, ge=1, le=64)
    # MiB of host memory for prompts' KV cells that a new prompt takes the stream of, loaded back
    # when a later prompt shares more with them (engine.hostcache); llama-server's --cache-ram. 0: off.
    cache_ram: int = Field(8192, ge=0)


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


class AutoDraft(Strict):
    """`draft: auto`: the n-gram drafter plus the best draft model the stores hold for the target,
    chosen at load and again at reload (pairing.auto); the n-gram drafter alone when none fits."""

    type: Literal["auto"]


class HybridDraft(Strict):
    """`draft: [ngram, MODEL]`: several sources; each round drafts from the one with the most
    expected gain (a long n-gram match skips the model's draft pass)."""

    type: Literal["hybrid"]
    ngram: NgramDraft
    model: ModelDraft


def _draft_kind(v: Any) -> str:
    if isinstance(v, dict):
        kind = v.get("type")
        return kind if isinstance(kind, str) and kind in ("ngram", "auto", "hybrid") else "model"
    kinds: dict[type, str] = {NgramDraft: "ngram", AutoDraft: "auto", HybridDraft: "hybrid"}
    return kinds.get(type(v), "model")


Draft = Annotated[
    Annotated[NgramDraft, Tag("ngram")] | Annotated[ModelDraft, Tag("model")] | Annotated[AutoDraft, Tag("auto")]
    | Annotated[HybridDraft, Tag("hybrid")],
    Discriminator(_draft_kind),
]


def _one_draft(v: Any) -> Any:
    """The shorthands: `ngram`, `auto`, a model reference (a string), or a mapping."""
    if v == "ngram":
        return {"type": "ngram"}
    if v == "auto":
        return {"type": "auto"}
    if isinstance(v, str):
        return {"from": v}
    return v


class Vllm(Strict):
    """Where a vLLM pair's target runs (`engine: vllm`).

    Without `url` the daemon starts the server itself (managed): the settings below become its
    arguments, and it lives as long as the model is loaded. With `url` it is someone else's
    server (remote), for example the head of a Ray cluster: the daemon only talks to it, so the
    settings that shape a server are refused there (`sidecar check` prints the command to start it)."""

    url: str | None = Field(None, pattern=r"^https?://")
    model: str | None = None  # the name the server knows the model by; None: the one it serves
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    enforce_eager: bool = False  # skip graph capture / compilation: starts in seconds, runs slower
    python: str | None = None  # the interpreter with vllm installed; None: the daemon's own
    port: int | None = Field(None, ge=1, le=65535)  # managed: None picks a free port
    args: list[str] = Field(default_factory=list)  # more `vllm serve` arguments, passed as written
    env: dict[str, str] = Field(default_factory=dict)  # more environment for the managed server
    start_timeout: float = Field(900.0, gt=0)  # seconds a managed server may take to become healthy

    @model_validator(mode="after")
    def _remote_is_not_started(self) -> Vllm:
        if self.url is None:
            return self
        shaping = [k for k in ("tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization", "dtype",
                               "enforce_eager", "python", "port", "args", "env") if k in self.model_fields_set]
        if shaping:
            raise ValueError(f"{', '.join(shaping)}: a remote server (url) runs as it was started; set "
                             "these where it is started (`sidecar check` prints the command)")
        return self


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class Pair(Strict):
    from_: str = Field(alias="from", min_length=1)
    engine: Literal["llama.cpp", "vllm"] = "llama.cpp"  # validated first: the keys below depend on it
    draft: Draft | None = None
    parameters: Parameters = Field(default_factory=Parameters)
    template: str | None = None
    system: str | None = None
    messages: list[Message] = Field(default_factory=list)
    speculative: Speculative = Field(default_factory=Speculative)
    runtime: Runtime = Field(default_factory=Runtime)
    adapter: Any = None
    vllm: Vllm | None = None  # engine: vllm: where its server runs (None: managed, with the defaults)

    @property
    def ngram(self) -> NgramDraft | None:
        """The n-gram source, if the pair drafts from one (`auto` always does)."""
        d = self.draft
        if isinstance(d, NgramDraft):
            return d
        if isinstance(d, HybridDraft):
            return d.ngram
        return NgramDraft(type="ngram") if isinstance(d, AutoDraft) else None

    @property
    def model_draft(self) -> ModelDraft | None:
        """The draft model the pair names (an `auto` pair's is chosen later)."""
        d = self.draft
        return d if isinstance(d, ModelDraft) else d.model if isinstance(d, HybridDraft) else None

    @property
    def draft_label(self) -> str | None:
        """The draft as people name it: None, "ngram", "auto", a model reference, or "ngram + REF"."""
        d = self.draft
        if d is None:
            return None
        if isinstance(d, NgramDraft | AutoDraft):
            return d.type
        if isinstance(d, HybridDraft):
            return f"ngram + {d.model.from_}"
        return d.from_

    @field_validator("draft", mode="before")
    @classmethod
    def _draft_shorthand(cls, v: Any) -> Any:
        if v is None or v == "none":
            return None
        if isinstance(v, list):
            items = [_one_draft(x) for x in v]
            kinds = [_draft_kind(x) for x in items]
            if len(items) == 1:
                return items[0]
            if sorted(kinds) != ["model", "ngram"]:
                raise ValueError("a list of drafts holds one n-gram drafter and one draft model, e.g. [ngram, MODEL]")
            return {"type": "hybrid", "ngram": items[kinds.index("ngram")], "model": items[kinds.index("model")]}
        return _one_draft(v)

    @model_validator(mode="after")
    def _n_min_fits_the_default_n_max(self) -> Pair:
        """Speculative checks an explicit n_max; without one, the default depends on the draft."""
        n_max = self.speculative.engine(ngram=self.ngram is not None).n_max
        if self.speculative.n_max is None and self.speculative.n_min > n_max:
            raise ValueError(f"speculative.n_min {self.speculative.n_min} exceeds the default n_max {n_max}: set n_max")
        return self

    # Settings only one engine reads are errors on the other, so none silently does nothing; each
    # check sits on the key it is about, so the error names that key's line.
    @field_validator("draft")
    @classmethod
    def _draft_for_engine(cls, d: Any, info: ValidationInfo) -> Any:
        if info.data.get("engine") == "vllm" and isinstance(d, AutoDraft | HybridDraft):
            raise ValueError(f"{'auto' if isinstance(d, AutoDraft) else 'a list'} has no vLLM counterpart (vLLM "
                             "speculates from one source); use `draft: ngram` or `draft: MODEL_FOLDER`")
        return d

    @field_validator("runtime")
    @classmethod
    def _runtime_for_engine(cls, rt: Runtime, info: ValidationInfo) -> Runtime:
        llama_only = sorted(rt.model_fields_set - {"num_parallel"})
        if info.data.get("engine") == "vllm" and llama_only:
            raise ValueError(f"{llama_only[0]} is a llama.cpp setting; a vLLM pair takes its load settings under "
                             "vllm: (tensor_parallel_size, dtype, ...)")
        return rt

    @field_validator("vllm")
    @classmethod
    def _vllm_for_engine(cls, v: Vllm | None, info: ValidationInfo) -> Vllm | None:
        if v is not None and info.data.get("engine") != "vllm":
            raise ValueError("these settings need `engine: vllm`")
        if v is not None and v.url is not None and info.data.get("draft") is not None:
            raise ValueError("a remote vLLM server (url) speculates as it was started: drop `draft:` and start "
                             "it with --speculative-config (`sidecar check` prints it)")
        return v

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
    # Serve, under its own name, every store model with a draft predicted to pay (pairing.auto).
    auto: bool = False

