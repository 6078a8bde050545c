"""Measuring, on this machine, whether a draft would speed a target up: one generation's worth of work.

The facts in the files (pairing.ranking) say which drafts are worth a look, not whether one pays:
that takes the draft's agreement with the target and what each costs here. A probe measures both.

**Agreement.** For each built-in prompt (code, prose, chat; a user turn rendered with the target's
own chat template) the engine's own Decoder runs greedy speculative decoding with the draft at a
fixed length (n_max a round, `adaptive` off: llama.cpp's rule), so what is measured is what serving
does, and nothing in it depends on timing: under greedy decoding the agreement is the same on a
busy machine as on a quiet one. Every drafted position the target examined is one trial, so
`a` = accepted / (accepted + rejected) is the per-position acceptance along the target's own
output. A prompt stops after n_tokens // (n_max + 1) rounds, so no round is cut short by the token
budget (a round that is counts as a rejection); that bounds a useless draft to a few rounds and
costs a good one about n_tokens target rows in a handful of batches: about one generation.

**Cost.** The target's verify curve t_step(n), seconds to decode n rows (CostModel.calibrate, on a
small context), and the draft's one-token step t_draft (CostModel.calibrate_draft), both measured
the way a load measures them, which tells a busy machine (other processes holding the cores, or
repetitions that disagree). Timings measured there are never kept: the agreement is cached alone
(a rerun measures nothing), and it is priced from the files (`estimate`: the CPU's prior verify
curve, a draft step costing the files' size ratio of a target step: a decode reads every weight
once), so the right draft still comes first. Where the daemon has served the models on a quiet
machine, its own measurements (pairing.costs) price the agreement instead, the probe's timings
included: the serving cost model overturns a verdict taken on stale timings.

**Predicted speed-up**, the bound bench/bench_spec.py prints, for independent positions, priced as
the engine prices a round (engine.adaptive.round_seconds):

    speed-up = max over k = 1..n_max of  E(a, k) * t_step(1) / round_seconds(k, t_draft, t_step(k + 1))
    E(a, k) = (1 - a^(k+1)) / (1 - a)          (tokens a round of k drafts emits)

plain decoding costs t_step(1) a token. Not counted: sampling, and the draft's prefill of each
prompt (once a request, amortised over its output). A draft pays when the bound reaches MIN_GAIN,
the gain the schedule itself needs before it starts drafting.

Results are cached (`ProbeCache`) per target file, draft file, llama.cpp build and backend (its
system info), threads, GPU layers and probe settings, so `sidecar suggest --probe` and `draft:
auto` measure a pair once per machine. Loading is lazy: a fully cached rerun loads no model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sidecar.engine.adaptive import SpeculativeConfig, expected_tokens, round_seconds
from sidecar.engine.backend import backend_id, default_threads
from sidecar.engine.cost import CostModel
from sidecar.engine.decoder import Decoder, Request, Result
from sidecar.engine.drafters import ModelDrafter
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.sampling import SamplingParams
from sidecar.engine.timing import prior_curve
from sidecar.models.cache import FileCache
from sidecar.models.gguf import GGUFError, read_header
from sidecar.pairing.costs import ServedCosts
from sidecar.pairing.rules import check_pair
from sidecar.storage import KeyedCache, cache_dir
from sidecar.templates.chat import JinjaChatTemplate, TemplateError

log = logging.getLogger("sidecar.pairing")

MIN_GAIN = SpeculativeConfig.min_gain
PROBE_VERSION = 2  # bump when the method changes: results measured the old way are then not reused
CACHE_FORMAT = "spec-sidecar/probe"
GREEDY = SamplingParams(temperature=0.0)

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
    n_max: int = SpeculativeConfig.n_max  # the probe's draft length, and the longest the prediction considers
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

    @property
    def rounds(self) -> int:
        """Rounds per prompt: none of them cut short by n_tokens (module docstring), one at least."""
        return max(1, self.n_tokens // (self.n_max + 1))

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
        rate = expected_tokens(a, k) * t_step[1] / round_seconds(k, t_draft, t_step[k + 1])
        if rate > best:
            best, best_k = rate, k
    return best, best_k


def estimate(target: Path, draft: Path, n_max: int) -> tuple[tuple[float, ...], float]:
    """Timings from the files alone, in one-token target steps: the prior verify curve, and a draft
    step at the draft's share of the target's bytes. Raises OSError for a file that is not there."""
    return (0.0, *(prior_curve(n) for n in range(1, n_max + 2))), draft.stat().st_size / target.stat().st_size


@dataclass(frozen=True)
class ProbeResult:
    agreement: float  # a: accepted / examined drafted tokens
    mean_run: float  # drafted tokens accepted per rejection (~ a / (1 - a))
    positions: int  # drafted tokens the target examined
    t_step: tuple[float, ...]  # seconds for the target to decode n rows, n = 0..n_max + 1 ([0] is 0)
    t_draft: float  # seconds per draft step
    # Whether the timings were measured on a quiet machine: only then are they cached with the agreement.
    quiet: bool = True
    timings: str = "probe"  # what priced the agreement: probe, served (pairing.costs) or files (estimate)

    @property
    def speedup(self) -> float:
        return predict_speedup(self.agreement, self.t_step, self.t_draft)[0]

    @property
    def best_k(self) -> int:
        return predict_speedup(self.agreement, self.t_step, self.t_draft)[1]

    def pays(self, min_gain: float = MIN_GAIN) -> bool:
        return self.speedup >= min_gain

    def to_json(self) -> dict[str, Any]:
        """The agreement always; the timings only when measured on a quiet machine."""
        out: dict[str, Any] = {"agreement": self.agreement, "mean_run": self.mean_run, "positions": self.positions}
        if self.quiet and self.timings == "probe":
            out |= {"t_step": list(self.t_step), "t_draft": self.t_draft}
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ProbeResult:
        """Raises KeyError/TypeError/ValueError on anything but what to_json wrote."""
        t_step = tuple(float(t) for t in d.get("t_step", ()))
        quiet = "t_step" in d
        result = cls(float(d["agreement"]), float(d["mean_run"]), int(d["positions"]), t_step,
                     float(d["t_draft"]) if quiet else 0.0, quiet)
        if (quiet and (len(t_step) < 3 or t_step[1] <= 0)) or not 0.0 <= result.agreement <= 1.0:
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
        vi = weights.vocab_info()
        bos = weights.token_text(vi.bos).decode("utf-8", "replace") if vi.bos >= 0 else ""
        eos = weights.token_text(vi.eos).decode("utf-8", "replace") if vi.eos >= 0 else ""
        try:
            rendered = JinjaChatTemplate(template, bos, eos).render([{"role": "user", "content": text}])
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
        # An unbounded budget measures every size, and still tells a busy machine (provisional).
        cost.calibrate(ctx, reps=settings.reps, budget=math.inf)
        try:
            template = read_header(path).metadata.get("tokenizer.chat_template")
        except GGUFError:
            template = None
        room = settings.n_ctx - settings.n_tokens - 1
        prompts = [_prompt_tokens(weights, template if isinstance(template, str) else None, p, room)
                   for p in settings.prompts]
        stack.pop_all()
    return LoadedTarget(weights, ctx, cost, prompts)


def _speculate(decoder: Decoder, prompt: list[int], settings: ProbeSettings) -> tuple[int, int]:
    """Greedy speculation from `prompt` through the engine's Decoder: (drafted tokens accepted, rejected).

    A round rejects a draft unless it accepted every token of it, and every round but a last one cut
    short by an end of generation drafts n_max, so the rounds that accepted all of theirs are
    those whose n_max-th token was accepted."""
    rounds = 0

    def enough() -> bool:  # asked once before each round
        nonlocal rounds
        rounds += 1
        return rounds > settings.rounds

    result: Result | None = None
    for item in decoder.generate(Request(prompt, sampling=GREEDY, num_predict=settings.n_tokens), enough):
        if isinstance(item, Result):
            result = item
    assert result is not None, "a generation ends with its Result"
    per_pos, k = result.accepted_per_pos, settings.n_max
    whole = per_pos[k - 1] if len(per_pos) >= k else 0
    return result.draft_accepted_tokens, result.draft_rounds - whole


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
        quiet = timing.calibrate_draft(ctx, reps=settings.reps, budget=math.inf) and not target.cost.provisional
        config = SpeculativeConfig(n_max=settings.n_max, min_predict=0, adaptive=False)
        decoder = Decoder(target.ctx, ModelDrafter(ctx), config, CostModel(settings.n_max + 1))
        runs = [_speculate(decoder, p, settings) for p in target.prompts]
        target.ctx.clear()
    accepted, rejected = sum(r[0] for r in runs), sum(r[1] for r in runs)
    return ProbeResult(accepted / max(1, accepted + rejected), accepted / max(1, rejected), accepted + rejected,
                       tuple(target.cost.t_step), timing.t_draft, quiet)


class Prober:
    """Probes drafts for one target, through the cache, and prices each agreement with the best
    timings there are: the daemon's served measurements, else the probe's own quiet ones, else an
    estimate from the files (module docstring).

    The target loads, and its verify curve is measured, at the first draft the cache does not know;
    a target that fails to load fails every later probe at once
    rather than loading again."""

    def __init__(self, target: Path, settings: ProbeSettings | None = None, cache: ProbeCache | None = None,
                 served: ServedCosts | None = None) -> None:
        self.target = target
        self.settings = settings or DEFAULT_SETTINGS
        self.cache = cache or ProbeCache()
        self.served = served or ServedCosts()
        self._loaded: LoadedTarget | None = None
        self._failed: Exception | None = None

    def key(self, draft: Path) -> dict[str, Any]:
        """Raises OSError when either file cannot be looked at."""
        s = self.settings
        return {"v": PROBE_VERSION, "target": FileCache.key(self.target), "draft": FileCache.key(draft),
                "backend": backend_id(), "threads": s.n_threads, "gpu_layers": s.n_gpu_layers,
                "settings": s.fingerprint()}

    def cached(self, draft: Path) -> ProbeResult | None:
        hit = self.cache.get(self.key(draft))
        return self._priced(draft, hit) if hit is not None else None

    def probe(self, draft: Path) -> ProbeResult:
        """The cached result, else a measurement, cached (its timings only if quiet)."""
        key = self.key(draft)
        hit = self.cache.get(key)
        if hit is not None:
            return self._priced(draft, hit)
        if self._failed is not None:
            raise self._failed
        if self._loaded is None:
            try:
                self._loaded = load_target(self.target, self.settings)
            except Exception as e:
                self._failed = e
                raise
        result = measure(self._loaded, draft, self.settings)
        if not result.quiet:
            log.info("probe: the machine is busy; the agreement of %s with %s is kept, its timings are not",
                     draft.name, self.target.name)
        self.cache.put(key, result)
        return self._priced(draft, result)

    def _priced(self, draft: Path, result: ProbeResult) -> ProbeResult:
        """The result with the timings that price it (class docstring): the served target curve
        where there is one, with the served draft step, else the probe's, else the files' share."""
        if not result.quiet:
            t_step, ratio = estimate(self.target, draft, self.settings.n_max)
            result = replace(result, t_step=t_step, t_draft=ratio, timings="files")
        threads = self.settings.n_threads
        served = self.served.target(self.target, threads)
        if served is None:
            return result
        t_draft = self.served.draft(draft, threads)
        if t_draft is None:  # the probe's quiet step, else the files' share of a served target step
            t_draft = result.t_draft * served[1] if result.timings == "files" else result.t_draft
        return replace(result, t_step=served[: self.settings.n_max + 2], t_draft=t_draft, timings="served")

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
