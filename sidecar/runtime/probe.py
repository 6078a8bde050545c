"""Measuring, on this machine, whether a draft would speed a target up: one generation's worth of work.

The facts in the files (engine.ranking) say which drafts are worth a look, not whether one pays:
that takes the draft's agreement with the target and what each costs here. A probe measures both.

**Agreement.** For each built-in prompt (code, prose, chat; a user turn rendered with the target's
own chat template), greedy speculative decoding runs for real, with long drafts: the draft proposes
its greedy tokens, the target scores them all in one batch, the agreeing prefix and the target's
own next token are kept, and the draft goes on from there. The draft length doubles up to
DRAFT_MAX while drafts are accepted and falls back to twice the last accepted run (2 at least)
after a rejection. Every drafted position the target examined is one trial, so `a` = accepted /
(accepted + rejected) is the per-position acceptance along the target's own output, whatever the
draft lengths were. A prompt ends after `n_tokens` tokens, at an end-of-generation token, or after
MAX_REJECTIONS rejections (enough to tell a useless draft), so the target decodes about n_tokens
rows in a handful of batches: the probe costs about one generation, as teacher-forcing the draft
over the target's output would take n_tokens target steps. Scoring one whole draft continuation in
one pass would be cheaper still, but wrong where it matters: a draft that falls into a loop drags
the target into predicting the loop (a draft with its logits negated, repeating junk, "agreed" on
66% of it). The mean run is tokens accepted per rejection, an estimate of a / (1 - a).

**Cost.** The target's verify curve t_step(n), seconds to decode n rows (CostModel.calibrate, on a
small context), and the draft's one-token step t_draft (CostModel.calibrate_draft).

**Predicted speed-up**, the bound bench/bench_spec.py prints, for independent positions:

    speed-up = max over k = 1..n_max of  E(a, k) * t_step(1) / ((k + a^k) * t_draft + t_step(k + 1))
    E(a, k) = (1 - a^(k+1)) / (1 - a)          (tokens a round of k drafts emits)

A round costs k draft steps, one more when all k are accepted (probability a^k: the draft never
decoded its own last guess and must before it drafts on), and one target pass over k + 1 rows;
plain decoding costs t_step(1) a token. Not counted: sampling, and the draft's prefill of each
prompt (once a request, amortised over its output). A draft pays when the bound reaches MIN_GAIN,
the gain the planner (engine.adaptive) itself needs before it starts drafting.

Results are cached (`ProbeCache`) per target file, draft file, llama.cpp build and backend (its
system info), threads, GPU layers and probe settings, so `sidecar suggest --probe` and `draft:
auto` measure a pair once per machine. Loading is lazy: a fully cached rerun loads no model.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.engine.adaptive import CostModel, SpeculativeConfig, expected_tokens
from sidecar.engine.drafters import common_prefix
from sidecar.engine.llama import Context, ContextParams, Weights, default_threads
from sidecar.engine.pairing import check_pair
from sidecar.models.gguf import GGUFError, read_header
from sidecar.models.vocab import FileCache
from sidecar.runtime.curves import backend_id
from sidecar.runtime.render import TemplateSource, chat_template
from sidecar.storage import KeyedCache, cache_dir
from sidecar.templates.chat import TemplateError

log = logging.getLogger("sidecar.runtime")

MIN_GAIN = SpeculativeConfig.min_gain
DRAFT_MAX = 16  # longest draft a probe round verifies
MAX_REJECTIONS = 8  # per prompt: a / (1 - a) is known well enough by then, and a useless draft stops
PROBE_VERSION = 1  # bump when the method changes: results measured the old way are then not reused
CACHE_FORMAT = "spec-sidecar/probe"

PROMPTS: tuple[str, ...] = (
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring "
    "and a short example of its use.",
    "Write a short paragraph about how lighthouses guided ships along dangerous coasts before radio "
    "and satellite navigation.",
    "Hi! I'm going hiking in the mountains this weekend for the first time. What should I bring?",
)


@dataclass(frozen=True)
class ProbeSettings:
    """How a probe runs; tests shrink it to stay fast (fewer prompts and tokens only add noise)."""

    prompts: tuple[str, ...] = PROMPTS
    n_tokens: int = 128  # most tokens the speculation on each prompt produces
    n_max: int = SpeculativeConfig.n_max  # longest draft round the prediction considers
    n_ctx: int = 512
    threads: int = 0  # 0: every CPU this process may use
    n_gpu_layers: int = -1  # -1: all, where llama.cpp has a GPU backend
    reps: int = 3  # timing repetitions (the fastest counts)

    def __post_init__(self) -> None:
        if not self.prompts or self.n_tokens < 1 or self.n_max < 1 or self.reps < 1:
            raise ValueError("a probe needs a prompt, n_tokens, n_max and reps of at least 1")
        if self.n_ctx < self.n_tokens + 16 or self.n_ctx < self.n_max + 8:
            raise ValueError(f"n_ctx {self.n_ctx} leaves no room for the prompt and {self.n_tokens} tokens")

    @property
    def n_threads(self) -> int:
        return self.threads or default_threads()

    def context(self) -> ContextParams:
        return ContextParams(n_ctx=self.n_ctx, n_batch=min(512, self.n_ctx), n_threads=self.n_threads)

    def fingerprint(self) -> str:
        """What changes a measurement's meaning (not `reps`, which only changes its noise)."""
        what = [PROBE_VERSION, list(self.prompts), self.n_tokens, self.n_max, self.n_ctx]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


DEFAULT_SETTINGS = ProbeSettings()


def predict_speedup(a: float, t_step: Sequence[float], t_draft: float) -> tuple[float, int]:
    """The module docstring's bound and the k that reaches it; t_step[n] is n rows (t_step[0] unused).

    Below 1 when no draft length beats plain decoding (the best k is still given, for the record)."""
    best, best_k = 0.0, 1
    for k in range(1, len(t_step) - 1):
        rate = expected_tokens(a, k) * t_step[1] / ((k + a**k) * t_draft + t_step[k + 1])
        if rate > best:
            best, best_k = rate, k
    return best, best_k


@dataclass(frozen=True)
class ProbeResult:
    agreement: float  # a: accepted / examined drafted tokens
    mean_run: float  # drafted tokens accepted per rejection (~ a / (1 - a))
    positions: int  # drafted tokens the target examined
    t_step: tuple[float, ...]  # seconds for the target to decode n rows, n = 0..n_max + 1 ([0] is 0)
    t_draft: float  # seconds per draft step

    @property
    def speedup(self) -> float:
        return predict_speedup(self.agreement, self.t_step, self.t_draft)[0]

    @property
    def best_k(self) -> int:
        return predict_speedup(self.agreement, self.t_step, self.t_draft)[1]

    def pays(self, min_gain: float = MIN_GAIN) -> bool:
        return self.speedup >= min_gain

    def to_json(self) -> dict[str, Any]:
        return {"agreement": self.agreement, "mean_run": self.mean_run, "positions": self.positions,
                "t_step": list(self.t_step), "t_draft": self.t_draft}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ProbeResult:
        """Raises KeyError/TypeError/ValueError on anything but what to_json wrote."""
        t_step = tuple(float(t) for t in d["t_step"])
        result = cls(float(d["agreement"]), float(d["mean_run"]), int(d["positions"]), t_step, float(d["t_draft"]))
        if len(t_step) < 3 or t_step[1] <= 0 or not 0.0 <= result.agreement <= 1.0:
            raise ValueError("not a measurement")
        return result


class ProbeCache:
    """Probe results, one JSON file per key under $XDG_CACHE_HOME/spec-sidecar/probes
    (storage.KeyedCache), so the daemon and a `sidecar suggest` probing at once never lose each
    other's results; a missing, corrupt or foreign file is a miss."""

    def __init__(self, root: Path | None = None) -> None:
        self._cache = KeyedCache(root or cache_dir() / "probes", CACHE_FORMAT)

    def get(self, key: dict[str, Any]) -> ProbeResult | None:
        value = self._cache.get(key)
        try:
            return ProbeResult.from_json(value) if value is not None else None
        except (ValueError, KeyError, TypeError):
            return None

    def put(self, key: dict[str, Any], result: ProbeResult) -> None:
        self._cache.put(key, result.to_json())


@dataclass
class LoadedTarget:
    """A target ready to score drafts: its context, its measured verify curve, the prompts' tokens."""

    weights: Weights
    ctx: Context
    cost: CostModel
    prompts: list[list[int]]


def _prompt_tokens(weights: Weights, template: str | None, text: str, room: int) -> list[int]:
    """A user turn through the GGUF's chat template (the text alone without one), at most `room` tokens."""
    rendered = text
    if template:
        try:
            rendered = chat_template(TemplateSource(template, go=False), weights).render(
                [{"role": "user", "content": text}])
        except TemplateError as e:
            log.info("probe: %s cannot render a user turn (%s); using the bare text", weights.path.name, e)
    tokens = weights.tokenize(rendered, add_special=not weights.starts_with_bos(rendered), parse_special=True)
    return tokens[-room:]  # the end holds the turn the model answers


def load_target(path: Path, settings: ProbeSettings) -> LoadedTarget:
    with ExitStack() as stack:
        weights = Weights(path, n_gpu_layers=settings.n_gpu_layers)
        stack.callback(weights.close)
        ctx = Context(weights, settings.context())
        stack.callback(ctx.close)
        cost = CostModel(settings.n_max + 1)
        cost.calibrate(ctx, reps=settings.reps)
        try:
            template = read_header(path).metadata.get("tokenizer.chat_template")
        except GGUFError:
            template = None
        room = settings.n_ctx - settings.n_tokens - 1
        prompts = [_prompt_tokens(weights, template if isinstance(template, str) else None, p, room)
                   for p in settings.prompts]
        stack.pop_all()
    return LoadedTarget(weights, ctx, cost, prompts)


def _draft(ctx: Context, committed: list[int], k: int) -> list[int]:
    """k greedy draft tokens after `committed` (fewer if one ends the generation); the draft's cache
    keeps what it shares with `committed` and decodes the rest, as engine.drafters.ModelDrafter does."""
    keep = common_prefix(ctx.tokens, committed[:-1])
    ctx.truncate(keep)
    ctx.prefill(committed[keep:-1])
    logits = ctx.decode(committed[-1:], rows=[0])[0]
    out: list[int] = []
    while True:
        out.append(int(np.argmax(logits)))
        if len(out) == k or ctx.weights.is_eog(out[-1]):
            return out
        logits = ctx.decode(out[-1:], rows=[0])[0]


def _speculate(target: Context, draft: Context, prompt: list[int], n_tokens: int) -> tuple[int, int]:
    """Greedy speculation from `prompt` (module docstring): (drafted tokens accepted, rejected)."""
    committed = list(prompt)
    target.clear()
    draft.clear()
    target.prefill(prompt[:-1])  # the last committed token is always the one still to be scored
    accepted = rejected = 0
    k = 2
    while len(committed) - len(prompt) < n_tokens and rejected < MAX_REJECTIONS:
        drafted = _draft(draft, committed, min(k, n_tokens - (len(committed) - len(prompt))))
        logits = target.decode(committed[-1:] + drafted)
        best = np.argmax(logits, axis=1)
        n = next((i for i, tok in enumerate(drafted) if best[i] != tok), len(drafted))
        accepted += n
        rejected += int(n < len(drafted))
        target.truncate(len(committed) + n)  # drop what the target scored past the agreeing prefix
        committed += [*drafted[:n], int(best[n])]
        if target.weights.is_eog(committed[-1]) or (n and target.weights.is_eog(drafted[n - 1])):
            break
        k = min(DRAFT_MAX, 2 * k) if n == len(drafted) else max(2, 2 * n)
    target.clear()
    return accepted, rejected


def measure(target: LoadedTarget, draft: Path, settings: ProbeSettings) -> ProbeResult:
    """Load the draft, time its step, and speculate on every prompt with it (module docstring).

    Raises IncompatibleDraft when the vocabularies do not pair, EngineError when llama.cpp refuses."""
    with ExitStack() as stack:
        weights = Weights(draft, n_gpu_layers=settings.n_gpu_layers)
        stack.callback(weights.close)
        check_pair(target.weights, weights)
        ctx = Context(weights, settings.context())
        stack.callback(ctx.close)
        timing = CostModel(1)
        timing.calibrate_draft(ctx, reps=settings.reps)
        runs = [_speculate(target.ctx, ctx, p, settings.n_tokens) for p in target.prompts]
    accepted, rejected = sum(r[0] for r in runs), sum(r[1] for r in runs)
    return ProbeResult(accepted / max(1, accepted + rejected), accepted / max(1, rejected), accepted + rejected,
                       tuple(target.cost.t_step), timing.t_draft)


class Prober:
    """Probes drafts for one target, through the cache.

    The target loads, and its verify curve is measured, at the first draft the cache does not know;
    a target that fails to load fails every later probe at once rather than loading again."""

    def __init__(self, target: Path, settings: ProbeSettings | None = None, cache: ProbeCache | None = None) -> None:
        self.target = target
        self.settings = settings or DEFAULT_SETTINGS
        self.cache = cache or ProbeCache()
        self._loaded: LoadedTarget | None = None
        self._failed: Exception | None = None

    def key(self, draft: Path) -> dict[str, Any]:
        """Raises OSError when either file cannot be looked at."""
        s = self.settings
        return {"v": PROBE_VERSION, "target": FileCache.key(self.target), "draft": FileCache.key(draft),
                "backend": backend_id(), "threads": s.n_threads, "gpu_layers": s.n_gpu_layers,
                "settings": s.fingerprint()}

    def cached(self, draft: Path) -> ProbeResult | None:
        return self.cache.get(self.key(draft))

    def probe(self, draft: Path) -> ProbeResult:
        key = self.key(draft)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        if self._failed is not None:
            raise self._failed
        if self._loaded is None:
            try:
                self._loaded = load_target(self.target, self.settings)
            except Exception as e:
                self._failed = e
                raise
        result = measure(self._loaded, draft, self.settings)
        self.cache.put(key, result)
        return result

    def close(self) -> None:
        if self._loaded is not None:
            self._loaded.ctx.close()
            self._loaded.weights.close()
            self._loaded = None

    def __enter__(self) -> Prober:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def probe_pair(target: Path, draft: Path, settings: ProbeSettings | None = None,
               cache: ProbeCache | None = None) -> ProbeResult:
    """One pair's probe result, from the cache when it holds one (see Prober for several drafts)."""
    with Prober(target, settings, cache) as prober:
        return prober.probe(draft)
