"""Putting a target and its pairs' drafters into memory, and taking them out again.

A loaded target (`Loaded`, the engine's `Model`) is one GGUF with one llama.cpp context: a KV
stream of `num_ctx` positions per sequence it runs at once (num_parallel), stepped together by one
thread (worker.Batcher over an engine.step.StepLoop). Every pair riding on the target adds a
`PairEngine`: a drafter per stream (for a model draft, that stream of one shared draft context)
and one cost model the streams share. Freeing always goes through the batcher's thread, after the
requests already queued there, so a running stream never loses its context under it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from sidecar.config.entries import PairEntry
from sidecar.config.schema import ModelDraft
from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.backend import default_threads, gpu_offload_supported, system_info
from sidecar.engine.cost import CostModel
from sidecar.engine.drafters import Drafter, ModelDrafter, NgramDrafter
from sidecar.engine.evidence import Evidence
from sidecar.engine.hostcache import HostCache
from sidecar.engine.hybrid import HybridDrafter
from sidecar.engine.kernels import build_warnings
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.seqview import SeqView
from sidecar.engine.step import StepLoop
from sidecar.engine.suffix import SuffixDrafter
from sidecar.pairing.costs import ServedCosts
from sidecar.pairing.rules import check_pair
from sidecar.runtime.contract import ModelStatus, Vocabulary
from sidecar.runtime.llamacpp.caches import SuffixCaches
from sidecar.runtime.llamacpp.curves import CurveCache, curve_key
from sidecar.runtime.llamacpp.registry import WeightsRegistry
from sidecar.runtime.llamacpp.worker import Batcher
from sidecar.runtime.memory import PairPlan, Placement, ram_available
from sidecar.runtime.room import detect_gpus, plan_entry

log = logging.getLogger("sidecar.runtime")

KV_TYPES = {"f16": None, "q8_0": 8, "q4_0": 2}


@dataclass
class PairEngine:
    """What one pair adds on top of its target: a drafter per stream, one cost model, its settings."""

    drafters: list[HybridDrafter | None]  # drafters[i] drafts for the sequence on stream i
    config: SpeculativeConfig
    cost: CostModel
    evidence: Evidence  # acceptance per (source, class), learnt by all its requests (engine.evidence)
    draft_ctx: Context | None  # a model draft's context: stream i is drafters[i]'s
    draft_weights: Weights | None
    entry: PairEntry | None = None  # the declaration it was built from; a reload compares against it


@dataclass(eq=False)
class Loaded:
    """A loaded target model: weights, its context and step loop, the thread that owns them, and
    the pairs riding on it."""

    weights: Weights
    ctx: Context
    loop: StepLoop
    batcher: Batcher
    pairs: dict[str, PairEngine] = field(default_factory=dict)
    calibrated: CostModel | None = None
    curve: str | None = None  # where the verify curve came from: cached, measured, provisional
    draft_layers: dict[str, int] = field(default_factory=dict)  # pair -> its draft's layers, planned with the target
    num_gpu: int = -1  # the target's layers asked of llama.cpp: num_gpu, else the plan's; -1: all

    @property
    def n_ctx(self) -> int:
        """The context window of each sequence."""
        return self.ctx.n_ctx

    def fits(self, n_ctx: int, num_gpu: int = -1) -> bool:
        # Ollama's rule (server/sched.go, needsReload): another num_ctx, or another num_gpu that is
        # not -1, is another load.
        return n_ctx == self.n_ctx and (num_gpu < 0 or num_gpu == self.num_gpu)

    def vocabulary(self) -> Vocabulary:
        return vocabulary(self.weights)

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return self.weights.tokenize(text, add_special=add_special, parse_special=True)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.weights.piece(t) for t in tokens).decode("utf-8", "replace")

    def pair(self, name: str) -> PairEntry | None:
        pe = self.pairs.get(name)
        return pe.entry if pe is not None else None

    def status(self) -> ModelStatus:
        stats, loop = self.loop.stats, self.loop
        interactive, background = self.batcher.waiting()
        return ModelStatus(str(self.weights.path), self.n_ctx, self.ctx.n_seq, tuple(sorted(self.pairs)),
                           self.weights.gpu_layers, self.curve, busy=len(loop.running), steps=stats.steps,
                           rows=stats.rows, tokens=stats.tokens, cached_tokens=stats.cached_tokens,
                           restored_tokens=stats.restored_tokens,
                           host_cache_bytes=loop.host_cache.size if loop.host_cache is not None else 0,
                           withdrawn=stats.withdrawn, together=stats.together,
                           waiting_interactive=interactive, waiting_background=background,
                           step_seconds=loop.host.step.cumulative(), host_seconds=loop.host.host.cumulative(),
                           host_share=loop.host.share,
                           cost={"host": asdict(loop.host.price),
                                 **{name: pe.cost.beliefs() for name, pe in sorted(self.pairs.items())}})


def vocabulary(weights: Weights) -> Vocabulary:
    """The BOS and EOS texts a chat template may write."""
    vi = weights.vocab_info()
    return Vocabulary(
        bos=weights.token_text(vi.bos).decode("utf-8", "replace") if vi.bos >= 0 else "",
        eos=weights.token_text(vi.eos).decode("utf-8", "replace") if vi.eos >= 0 else "",
    )


@functools.cache
def _log_backend() -> None:
    log.info("llama.cpp backend: %s", system_info())
    for warning in build_warnings(system_info()):
        log.warning(warning)


def load_target(registry: WeightsRegistry, entry: PairEntry, n_ctx: int, n_seq: int, num_gpu: int = -1) -> Loaded:
    """Map the target's weights and make its context (blocking: run it off the event loop).
    `num_gpu`: a request's count of target layers on the GPUs, which wins over the pair's (-1: none)."""
    _log_backend()
    rt = entry.config.runtime
    want = num_gpu if num_gpu >= 0 else rt.num_gpu
    log.info("loading %s for %s (num_ctx %d, %d sequence%s%s)", entry.target.path.name, entry.name, n_ctx, n_seq,
             "" if n_seq == 1 else "s at once", f", num_gpu {want}" if want >= 0 else "")
    # Planned once, before the target takes its room: the draft's layers were counted first.
    plan = _plan(entry, n_ctx, n_seq, want)
    layers = _layers(want, plan.target if plan else None)
    weights = registry.acquire(entry.target.path, layers, role="target")
    try:
        ctx = Context(weights, ContextParams(
            n_ctx=n_ctx, n_batch=min(rt.num_batch, n_ctx), n_threads=rt.num_thread, flash_attn=rt.flash,
            type_k=KV_TYPES[rt.kv_cache_type], type_v=KV_TYPES[rt.kv_cache_type], n_seq=n_seq,
        ))
    except Exception:
        registry.release(weights)
        raise
    loop = StepLoop(ctx, host_cache=HostCache(rt.cache_ram * 2**20) if rt.cache_ram else None)
    lm = Loaded(weights, ctx, loop, Batcher(entry.name, loop), num_gpu=layers)
    if plan is not None and plan.draft is not None:
        lm.draft_layers[entry.name] = plan.draft.gpu_layers
    return lm


async def load_pair(registry: WeightsRegistry, entry: PairEntry, lm: Loaded, caches: SuffixCaches,
                    curves: CurveCache) -> PairEngine:
    """Build the pair's drafters for every stream (on the batcher's thread) and measure the cost curve.

    The sources: the n-gram drafter, the cross-request suffix cache beside it, and a draft model;
    with more than one, each round drafts from the one the schedule expects most of (engine.hybrid)."""
    ngram, d = entry.ngram, entry.model_draft
    spec = entry.config.speculative.engine(ngram=ngram is not None)
    draft_w: Weights | None = None
    if d is not None and entry.draft is not None:
        draft_w = await asyncio.to_thread(_acquire_draft, registry, entry.draft.path, d, lm, entry)
    suffix = await asyncio.to_thread(caches.for_pair, entry, lm.weights) if ngram is not None else None
    n_seq = lm.ctx.n_seq

    def build() -> PairEngine:
        draft_ctx = None
        if draft_w is not None and d is not None:
            draft_ctx = Context(draft_w, ContextParams(
                n_ctx=lm.n_ctx, n_batch=min(d.num_batch, lm.n_ctx), n_threads=d.num_thread, flash_attn=d.flash,
                type_k=KV_TYPES[d.kv_cache_type], type_v=KV_TYPES[d.kv_cache_type], n_seq=n_seq,
            ))
        try:
            drafters: list[HybridDrafter | None] = []
            for sid in range(n_seq):
                sources: list[Drafter] = []
                if ngram is not None:
                    sources.append(NgramDrafter(ngram.min_n, ngram.max_n))
                if suffix is not None:
                    sources.append(SuffixDrafter(suffix))
                if draft_ctx is not None:
                    sources.append(ModelDrafter(SeqView(draft_ctx, sid), spec.p_min))
                drafters.append(HybridDrafter(sources) if sources else None)
            # One cost model for every stream: acceptance learnt on one steers the others too. A
            # pair without a drafter needs the target's curve too: it sizes prefill chunks (engine.step).
            cost = _cost_model(lm, spec, draft_ctx, curves)
        except Exception:
            if draft_ctx is not None:
                draft_ctx.close()
            raise
        evidence = Evidence(spec.acceptance_prior, spec.prior_weight)
        return PairEngine(drafters, spec, cost, evidence, draft_ctx, draft_w, entry)

    try:
        return await asyncio.wrap_future(lm.batcher.call(build))
    except Exception:
        if draft_w is not None:
            registry.release(draft_w)
        raise


def _plan(entry: PairEntry, n_ctx: int, n_seq: int, num_gpu: int = -1) -> PairPlan | None:
    """The pair's memory plan on the GPUs as they are now, where there are GPUs and a layer count
    is left to it (the target's `num_gpu`, as asked, or the draft's is -1); None otherwise."""
    d = entry.model_draft
    if not gpu_offload_supported() or (num_gpu >= 0 and (d is None or d.num_gpu >= 0)):
        return None
    return plan_entry(entry, n_ctx, n_seq, detect_gpus(), ram_available(), num_gpu=num_gpu)


def _layers(want: int, placed: Placement | None) -> int:
    """The layers to offload: the user's num_gpu where set, else the plan's, else -1 (all: a CPU
    build offloads nothing anyway)."""
    return want if want >= 0 or placed is None else placed.gpu_layers


def _acquire_draft(registry: WeightsRegistry, path: Path, d: ModelDraft, lm: Loaded, entry: PairEntry) -> Weights:
    planned = lm.draft_layers.get(entry.name)
    if planned is None and d.num_gpu < 0:  # a pair joining a loaded target: planned beside it now
        plan = _plan(entry, lm.n_ctx, lm.ctx.n_seq, lm.num_gpu)
        planned = plan.draft.gpu_layers if plan is not None and plan.draft is not None else None
    draft_w = registry.acquire(path, d.num_gpu if d.num_gpu >= 0 or planned is None else planned, role="draft")
    try:
        check_pair(lm.weights, draft_w)
    except Exception:
        registry.release(draft_w)
        raise
    return draft_w


CURVE_BUDGET = 1.0  # seconds a load may spend measuring the target's verify curve, however busy the machine
# ... where the curve reaches past 16 rows (an n-gram pair drafts up to 64 tokens): its wide sizes
# take longer, and with fewer than five sizes measured a curve is provisional and never cached.
WIDE_CURVE_BUDGET = 2.5
DRAFT_BUDGET = 0.3  # ... and the draft's step and catch-up; a cached load measures nothing (curves)


def _cost_model(lm: Loaded, spec: SpeculativeConfig, draft_ctx: Context | None, curves: CurveCache) -> CostModel:
    """The pair's cost model: the target's verify curve (once per loaded target, from the cache when
    this machine measured it before), plus the draft's step and catch-up times for a model draft.
    Measured on a stream no sequence runs on (between steps, on the batcher's thread), or on a
    scratch context when every stream is busy."""
    free = lm.loop.idle_stream()
    ctx: Context | SeqView
    scratch = None
    if free is None:
        ctx = scratch = Context(lm.weights, replace(lm.ctx.params, n_seq=1))
    else:
        ctx = SeqView(lm.ctx, free)
    try:
        # `is not None`: a Context has a length (what it holds), so an empty one is falsy.
        draft = SeqView(draft_ctx, free if free is not None else 0) if draft_ctx is not None else None
        return _measure(lm, ctx, spec, draft, curves)
    finally:
        if scratch is not None:
            scratch.close()


def _measure(lm: Loaded, ctx: Context | SeqView, spec: SpeculativeConfig, draft_ctx: Context | SeqView | None,
             curves: CurveCache) -> CostModel:
    rows = spec.n_max + 1
    if lm.calibrated is None or len(lm.calibrated.t_step) <= rows:
        key = curve_key(lm.weights.path, ctx, lm.weights.gpu_layers, "target", rows)
        cal = curves.target(key, rows)
        if cal is not None:
            lm.curve = "cached"
        else:
            cal = CostModel(rows)
            cal.calibrate(ctx, budget=CURVE_BUDGET if rows <= 16 else WIDE_CURVE_BUDGET)
            lm.curve = "provisional" if cal.provisional else "measured"
            if not cal.provisional:
                curves.put_target(key, cal)
        lm.calibrated = cal
        if not cal.provisional:  # a quiet measurement prices the probes' agreement (pairing.costs)
            ServedCosts().put_target(lm.weights.path, cal.t_step, ctx.params.n_threads or default_threads())
        curve = ", ".join(f"{v:.2f}" for v in cal.verify_curve())
        log.info("verify cost curve of %s (x one-token step, n = 1..%d): %s; plain steps after a batch "
                 "cost %.2f steps more [%s, %.2fs]", lm.weights.path.name, rows, curve,
                 cal.t_switch / cal.t_step[1], lm.curve, cal.calibration_seconds)
    cost = CostModel(rows)
    cost.t_step = lm.calibrated.t_step[: rows + 1]
    cost.t_switch = lm.calibrated.t_switch
    cost.set_provisional(lm.calibrated.provisional)
    if draft_ctx is not None:
        key = curve_key(draft_ctx.weights.path, draft_ctx, draft_ctx.weights.gpu_layers, "draft")
        cached = curves.draft(key)
        quiet = cached is not None
        if cached is not None:
            cost.t_draft, cost.t_catchup = cached
        elif quiet := cost.calibrate_draft(draft_ctx, budget=DRAFT_BUDGET):
            curves.put_draft(key, cost)
        if quiet:
            ServedCosts().put_draft(draft_ctx.weights.path, cost.t_draft,
                                    draft_ctx.params.n_threads or default_threads())
    cost.seed()
    return cost


def unload(registry: WeightsRegistry, lm: Loaded) -> None:
    """Free the target and every pair on it, after the requests already queued on it."""

    def free() -> None:
        for pe in list(lm.pairs.values()):
            if pe.draft_ctx is not None:
                pe.draft_ctx.close()
            if pe.draft_weights is not None:
                registry.release(pe.draft_weights)
        lm.ctx.close()
        registry.release(lm.weights)
        log.info("unloaded %s", lm.weights.path.name)

    lm.batcher.call(free, after=True)
    lm.batcher.stop()


def free_engine(registry: WeightsRegistry, lm: Loaded, pe: PairEngine) -> None:
    """Free a pair's drafters after every request queued before this (so after its streams)."""

    def free() -> None:
        if pe.draft_ctx is not None:
            pe.draft_ctx.close()
        if pe.draft_weights is not None:
            registry.release(pe.draft_weights)
            log.info("freed draft %s of %s", pe.draft_weights.path.name, pe.entry.name if pe.entry else "?")

    lm.batcher.call(free, after=True)
