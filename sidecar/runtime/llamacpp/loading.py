"""Putting a target and its pairs' drafters into memory, and taking them out again.

A loaded target (`Loaded`, the engine's `Model`) is one GGUF with N slots: each slot is a llama.cpp
context with its own KV cache and its own worker thread (worker.Pool). Every pair riding on the target
adds a `PairEngine`: a decoder per slot, with its drafter (for a model draft, a draft context per
slot) and one cost model the slots share. Freeing always goes through the slots' own threads,
behind the jobs already queued there, so a running stream never loses its context under it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.config.entries import PairEntry
from sidecar.config.schema import ModelDraft
from sidecar.engine.adaptive import CostModel, SpeculativeConfig
from sidecar.engine.decoder import Decoder
from sidecar.engine.drafters import Drafter, ModelDrafter, NgramDrafter
from sidecar.engine.hybrid import HybridDrafter
from sidecar.engine.llama import Context, ContextParams, Weights, default_threads, system_info
from sidecar.engine.suffix import SuffixDrafter
from sidecar.pairing.costs import ServedCosts
from sidecar.pairing.rules import check_pair
from sidecar.runtime.contract import ModelStatus, Vocabulary
from sidecar.runtime.llamacpp.caches import SuffixCaches
from sidecar.runtime.llamacpp.curves import CurveCache, curve_key
from sidecar.runtime.llamacpp.registry import WeightsRegistry
from sidecar.runtime.llamacpp.worker import Pool

log = logging.getLogger("sidecar.runtime")

KV_TYPES = {"f16": None, "q8_0": 8, "q4_0": 2}


@dataclass
class PairEngine:
    """What one pair adds on top of its target: per slot a decoder (with its drafter), one cost model."""

    decoders: list[Decoder]  # decoders[i] runs on slot i's context, on slot i's thread
    draft_ctxs: list[Context]  # model drafts: draft_ctxs[i] belongs to slot i; empty otherwise
    draft_weights: Weights | None
    entry: PairEntry | None = None  # the declaration it was built from; a reload compares against it


@dataclass(eq=False)
class Slot:
    """One sequence a target can run: a context (KV cache) over the shared weights, owned by one thread."""

    index: int
    ctx: Context


@dataclass(eq=False)
class Loaded:
    """A loaded target model: weights, its slots and their threads, and the pairs riding on it."""

    weights: Weights
    slots: list[Slot]
    pool: Pool[Slot]
    pairs: dict[str, PairEngine] = field(default_factory=dict)
    calibrated: CostModel | None = None
    curve: str | None = None  # where the verify curve came from: cached, measured, provisional

    @property
    def n_ctx(self) -> int:
        """The context length of each slot (every slot has the same)."""
        return self.slots[0].ctx.n_ctx

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
        return ModelStatus(str(self.weights.path), self.n_ctx, len(self.slots), tuple(sorted(self.pairs)),
                           self.weights.gpu_layers, self.curve)


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


def load_target(registry: WeightsRegistry, entry: PairEntry, n_ctx: int, n_slots: int) -> Loaded:
    """Map the target's weights and make its slots (blocking: run it off the event loop)."""
    _log_backend()
    rt = entry.config.runtime
    log.info("loading %s for %s (num_ctx %d, %d slot%s)", entry.target.path.name, entry.name, n_ctx, n_slots,
             "" if n_slots == 1 else "s")
    weights = registry.acquire(entry.target.path, rt.num_gpu, role="target")
    slots: list[Slot] = []
    try:
        for i in range(n_slots):
            slots.append(Slot(i, Context(weights, ContextParams(
                n_ctx=n_ctx, n_batch=min(rt.num_batch, n_ctx), n_threads=rt.num_thread, flash_attn=rt.flash,
                type_k=KV_TYPES[rt.kv_cache_type], type_v=KV_TYPES[rt.kv_cache_type],
            ))))
    except Exception:
        for slot in slots:
            slot.ctx.close()
        registry.release(weights)
        raise
    return Loaded(weights, slots, Pool(entry.name, slots))


async def load_pair(registry: WeightsRegistry, entry: PairEntry, lm: Loaded, caches: SuffixCaches,
                    curves: CurveCache) -> PairEngine:
    """Build the pair's drafters in every slot (each on its slot's thread) and measure the cost curve.

    The sources: the n-gram drafter, the cross-request suffix cache beside it, and a draft model;
    with more than one, each round drafts from the one the planner expects most of (engine.hybrid)."""
    ngram, d = entry.ngram, entry.model_draft
    spec = entry.config.speculative.engine(ngram=ngram is not None)
    draft_w: Weights | None = None
    if d is not None and entry.draft is not None:
        draft_w = await asyncio.to_thread(_acquire_draft, registry, entry.draft.path, d, lm)
    suffix = await asyncio.to_thread(caches.for_pair, entry, lm.weights) if ngram is not None else None
    made: list[Context] = []  # draft contexts created so far, to free if another slot fails

    def build(slot: Slot) -> tuple[list[Drafter], Context | None, CostModel | None]:
        sources: list[Drafter] = []
        draft_ctx = None
        if ngram is not None:
            sources.append(NgramDrafter(ngram.min_n, ngram.max_n))
        if suffix is not None:
            sources.append(SuffixDrafter(suffix))
        if draft_w is not None and d is not None:
            draft_ctx = Context(draft_w, ContextParams(
                n_ctx=slot.ctx.n_ctx, n_batch=min(d.num_batch, slot.ctx.n_ctx), n_threads=d.num_thread,
                flash_attn=d.flash, type_k=KV_TYPES[d.kv_cache_type], type_v=KV_TYPES[d.kv_cache_type],
            ))
            made.append(draft_ctx)
            sources.append(ModelDrafter(draft_ctx, spec.p_min))
        # One slot measures for all: the slots run the same model on the same hardware.
        cost = _cost_model(lm, slot.ctx, spec, draft_ctx, curves) if sources and slot.index == 0 else None
        return sources, draft_ctx, cost

    try:
        parts = await asyncio.wrap_future(lm.pool.broadcast(build))
    except Exception:
        for c in made:  # every slot is past the broadcast: nothing uses them
            c.close()
        if draft_w is not None:
            registry.release(draft_w)
        raise
    cost = parts[0][2]  # shared: acceptance learnt on one slot steers the others too
    decoders = [Decoder(slot.ctx, HybridDrafter(sources) if sources else None, spec, cost)
                for slot, (sources, _, _) in zip(lm.slots, parts, strict=True)]
    draft_ctxs = [ctx for _, ctx, _ in parts if ctx is not None]
    return PairEngine(decoders, draft_ctxs, draft_w, entry)


def _acquire_draft(registry: WeightsRegistry, path: Path, d: ModelDraft, lm: Loaded) -> Weights:
    draft_w = registry.acquire(path, d.num_gpu, role="draft")
    try:
        check_pair(lm.weights, draft_w)
    except Exception:
        registry.release(draft_w)
        raise
    return draft_w


CURVE_BUDGET = 1.0  # seconds a load may spend measuring the target's verify curve, however busy the machine
DRAFT_BUDGET = 0.3  # ... and the draft's step and catch-up; a cached load measures nothing (curves)


def _cost_model(lm: Loaded, ctx: Context, spec: SpeculativeConfig, draft_ctx: Context | None,
                curves: CurveCache) -> CostModel:
    """The pair's cost model: the target's verify curve (once per loaded target, from the cache when
    this machine measured it before), plus the draft's step and catch-up times for a model draft."""
    rows = spec.n_max + 1
    if lm.calibrated is None or len(lm.calibrated.t_step) <= rows:
        key = curve_key(lm.weights.path, ctx, lm.weights.gpu_layers, "target", rows)
        cal = curves.target(key, rows)
        if cal is not None:
            lm.curve = "cached"
        else:
            cal = CostModel(rows)
            cal.calibrate(ctx, budget=CURVE_BUDGET)
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
    cost.t_same = lm.calibrated.t_same[: rows + 1]
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
    return cost


def unload(registry: WeightsRegistry, lm: Loaded) -> None:
    """Free the target and every pair on it, behind the requests already queued on its slots."""

    def free_slot(slot: Slot) -> None:
        for pe in list(lm.pairs.values()):
            if slot.index < len(pe.draft_ctxs):
                pe.draft_ctxs[slot.index].close()
        slot.ctx.close()

    def release() -> None:
        for pe in list(lm.pairs.values()):
            if pe.draft_weights is not None:
                registry.release(pe.draft_weights)
        registry.release(lm.weights)
        log.info("unloaded %s", lm.weights.path.name)

    lm.pool.broadcast(free_slot, release)
    lm.pool.stop()


def free_engine(registry: WeightsRegistry, lm: Loaded, pe: PairEngine) -> None:
    """Free a pair's drafters behind every job queued before this (so after its streams)."""

    def free_slot(slot: Slot) -> None:
        if slot.index < len(pe.draft_ctxs):
            pe.draft_ctxs[slot.index].close()

    def release() -> None:
        if pe.draft_weights is not None:
            registry.release(pe.draft_weights)
            log.info("freed draft %s of %s", pe.draft_weights.path.name, pe.entry.name if pe.entry else "?")

    lm.pool.broadcast(free_slot, release)
