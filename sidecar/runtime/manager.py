"""Pairs at run time: loading, sharing, keep_alive, queueing, and streaming generations.

A loaded target is one GGUF with N slots (OLLAMA_NUM_PARALLEL, or the pair's runtime.num_parallel;
default 1): each slot is a llama.cpp context with its own KV cache and its own worker thread, and
every pair riding on the target has a drafter (for model drafts, a draft context) in every slot.
Requests for the target queue in one FIFO and run on the first free slot, so N of them generate at
once. Weights are memory-mapped once per file however many pairs and slots use them. keep_alive
works as in Ollama: each request pushes the model's expiry out, `keep_alive: 0` unloads right after
the request, negative keeps it forever.

Ollama picks its parallelism automatically from free memory; here it defaults to 1, because every
slot costs a whole KV cache (and a draft KV cache) and a local daemon mostly serves one client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.config.schema import ModelDraft, NgramDraft, Pair
from sidecar.engine.adaptive import CostModel, SpeculativeConfig
from sidecar.engine.decoder import Decoder, Request, Result
from sidecar.engine.drafters import Drafter, ModelDrafter, NgramDrafter
from sidecar.engine.grammar import gbnf_for_format
from sidecar.engine.llama import Context, ContextParams, Weights, gpu_offload_supported, system_info
from sidecar.engine.pairing import check_pair
from sidecar.models.gguf import read_metadata
from sidecar.models.resolve import ResolvedModel, Stores, resolve
from sidecar.runtime.options import Effective
from sidecar.runtime.worker import Pool, stream
from sidecar.templates.chat import ChatTemplate, choose

log = logging.getLogger("sidecar.runtime")

KV_TYPES = {"f16": None, "q8_0": 8, "q4_0": 2}
DEFAULT_NUM_CTX = 4096


class ServerBusy(RuntimeError):
    pass


class ShuttingDown(RuntimeError):
    """The daemon is stopping: no new work, and running generations were cut at the drain deadline."""


def num_parallel_default() -> int:
    """OLLAMA_NUM_PARALLEL, as Ollama reads it; unset, empty or not a positive integer: 1."""
    raw = os.environ.get("OLLAMA_NUM_PARALLEL", "").strip()
    try:
        n = int(raw)
    except ValueError:
        if raw:
            log.warning("OLLAMA_NUM_PARALLEL=%r is not an integer; using 1", raw)
        return 1
    return n if n >= 1 else 1


@dataclass
class PairEntry:
    """A declared pair with its model references resolved (not loaded)."""

    name: str
    config: Pair
    target: ResolvedModel
    draft: ResolvedModel | None
    metadata: dict[str, Any]
    modified: float

    @property
    def params(self) -> dict[str, Any]:
        """Option defaults: the Ollama params layer, then the pair's `parameters`."""
        return {**self.target.params, **self.config.parameters.model_dump(exclude_none=True)}

    def num_ctx(self, requested: int | None) -> int:
        train = int(self.metadata.get(f"{self.metadata.get('general.architecture', '')}.context_length", 0) or 0)
        n = requested or self.params.get("num_ctx") or DEFAULT_NUM_CTX
        return max(64, min(n, train) if train else n)


def build_entry(name: str, pair: Pair, base: Path | None = None, stores: Stores | None = None) -> PairEntry:
    target = resolve(pair.from_, base=base, stores=stores)
    draft = resolve(pair.draft.from_, base=base, stores=stores) if isinstance(pair.draft, ModelDraft) else None
    return PairEntry(name, pair, target, draft, read_metadata(target.path), target.path.stat().st_mtime)


class WeightsRegistry:
    """Weights shared by reference count, so a GGUF used by several pairs is mapped once."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, int], tuple[Weights, int]] = {}
        # Targets load on to_thread workers and drafts on model threads, and reloads release from
        # several threads at once: without the lock two loads of one file could both map it.
        self._lock = threading.RLock()

    def acquire(self, path: Path, n_gpu_layers: int, role: str = "target") -> Weights:
        with self._lock:
            return self._acquire(path, n_gpu_layers, role)

    def _acquire(self, path: Path, n_gpu_layers: int, role: str) -> Weights:
        key = (str(path.resolve()), n_gpu_layers)
        w, n = self._loaded.get(key, (None, 0))
        if w is None:
            # A big model takes a while to map (and longer to offload): say so before, and after.
            size = path.stat().st_size
            log.info("loading %s model %s (%.1f MiB)", role, path, size / 2**20)
            t0 = time.perf_counter()
            w = Weights(path, n_gpu_layers=n_gpu_layers)
            log.info(
                "%s model loaded: %s in %.2fs, %d of %d layers on the GPU (%s)", role, path.name,
                time.perf_counter() - t0, w.gpu_layers, w.n_layer + 1,
                "GPU offload available" if gpu_offload_supported() else "CPU only",
            )
        else:
            log.info("%s model %s already loaded; shared (%d users)", role, path.name, n + 1)
        self._loaded[key] = (w, n + 1)
        return w

    def release(self, w: Weights) -> None:
        with self._lock:
            self._release(w)

    def _release(self, w: Weights) -> None:
        for key, (held, n) in list(self._loaded.items()):
            if held is w:
                if n <= 1:
                    del self._loaded[key]
                    w.close()
                else:
                    self._loaded[key] = (held, n - 1)
                return

    @property
    def count(self) -> int:
        return len(self._loaded)

    def snapshot(self) -> list[dict[str, Any]]:
        """What is mapped and how many contexts share it (for /sidecar/status)."""
        # No lock: this runs on the event loop, and acquire() holds the lock while a model loads.
        loaded = dict(self._loaded)  # a C-level copy, atomic under the GIL
        return [{"path": path, "num_gpu": gpu, "refs": n} for (path, gpu), (_, n) in loaded.items()]


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


@dataclass
class Loaded:
    """A loaded target model: weights, its slots and their threads, and the pairs riding on it."""

    key: str
    weights: Weights
    slots: list[Slot]
    pool: Pool[Slot]
    pairs: dict[str, PairEngine] = field(default_factory=dict)
    expires_at: float | None = None  # time.time() deadline; None = never
    in_flight: int = 0
    timer: asyncio.TimerHandle | None = None
    calibrated: CostModel | None = None

    @property
    def n_ctx(self) -> int:
        """The context length of each slot (every slot has the same)."""
        return self.slots[0].ctx.n_ctx


@dataclass
class Changes:
    """What Runtime.apply did, by pair name (for the reload log line and /sidecar/status)."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        parts = [f"{k} {', '.join(v)}" for k, v in vars(self).items() if v and k != "kept"]
        return "; ".join(parts) or "no pair changed"


def same_pair(a: PairEntry, b: PairEntry) -> bool:
    """The same declaration resolving to the same files and store metadata: nothing to do."""
    return (a.name == b.name and a.config == b.config and a.target == b.target and a.draft == b.draft
            and a.modified == b.modified)


def same_engine(a: PairEntry, b: PairEntry) -> bool:
    """Whether b can ride on the drafter built for a: only its defaults/template/system differ.

    A PairEngine depends on the target, the draft, the speculative settings and the runtime
    settings; `parameters`, `template`, `system` and `messages` are read per request."""
    ca, cb = a.config, b.config
    return (a.name == b.name and a.target.path == b.target.path and a.modified == b.modified
            and (a.draft.path if a.draft else None) == (b.draft.path if b.draft else None)
            and ca.draft == cb.draft and ca.speculative == cb.speculative and ca.runtime == cb.runtime)


@dataclass
class Outcome:
    """The end of a generation: the engine's Result plus what the API reports around it."""

    result: Result
    load_seconds: float
    context: list[int]


class Runtime:
    def __init__(self, *, keep_alive: float = 300.0, max_queue: int = 512, num_parallel: int = 1) -> None:
        self.entries: dict[str, PairEntry] = {}
        self.keep_alive = keep_alive
        self.max_queue = max_queue
        self.num_parallel = num_parallel  # slots per target unless its pair sets runtime.num_parallel
        # Set at the end of a shutdown's drain: every running generation stops at its next step.
        self.halt = threading.Event()
        self.weights = WeightsRegistry()
        self._loaded: dict[str, Loaded] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._pending = 0
        self.on_load: list[Callable[[str, float, bool], None]] = []  # (pair, seconds, ok), e.g. metrics
        self._backend_logged = False
        self._reconcile_timer: asyncio.TimerHandle | None = None

    # -- pairs ------------------------------------------------------------------------------
    def set_entries(self, entries: dict[str, PairEntry]) -> None:
        self.entries = {name.lower(): e for name, e in entries.items()}

    def find(self, model: str) -> PairEntry | None:
        name = model.strip().lower()
        if name and ":" not in name.rsplit("/", 1)[-1]:
            name += ":latest"
        return self.entries.get(name)

    def parallel(self, entry: PairEntry) -> int:
        return entry.config.runtime.num_parallel or self.num_parallel

    def _key(self, entry: PairEntry) -> str:
        rt = entry.config.runtime
        return (f"{entry.target.path.resolve()}|gpu={rt.num_gpu}|b={rt.num_batch}"
                f"|fa={rt.flash_attn}|kv={rt.kv_cache_type}|np={self.parallel(entry)}")

    def loaded_models(self) -> list[Loaded]:
        """Targets loaded right now (each with its context, thread and pairs)."""
        return list(self._loaded.values())

    def loaded_entries(self) -> list[tuple[PairEntry, Loaded]]:
        out = []
        for e in self.entries.values():
            lm = self._loaded.get(self._key(e))
            if lm is not None and self._has_engine(lm, e):
                out.append((e, lm))
        return out

    # -- loading ----------------------------------------------------------------------------
    async def load(self, entry: PairEntry, num_ctx: int | None = None) -> tuple[Loaded, float]:
        """Make the pair ready; returns the loaded target and the seconds spent loading."""
        key = self._key(entry)
        n_ctx = entry.num_ctx(num_ctx)
        lock = self._locks.setdefault(key, asyncio.Lock())
        t0 = time.perf_counter()
        async with lock:
            lm = self._loaded.get(key)
            if lm is not None and lm.n_ctx != n_ctx:
                # Like Ollama: a different num_ctx means a reload; in-flight requests finish first.
                self._unload(lm)
                lm = None
            loaded = False
            try:
                if lm is None:
                    loaded = True
                    lm = await asyncio.to_thread(self._load_target, entry, key, n_ctx)
                    self._loaded[key] = lm
                if not self._has_engine(lm, entry):
                    loaded = True
                    self._install(lm, entry, await self._load_pair(entry, lm))
            except Exception:
                self._report_load(entry.name, time.perf_counter() - t0, False)
                raise
            if loaded:
                self._report_load(entry.name, time.perf_counter() - t0, True)
        return lm, time.perf_counter() - t0

    def _report_load(self, name: str, seconds: float, ok: bool) -> None:
        for hook in self.on_load:
            hook(name, seconds, ok)

    def _load_target(self, entry: PairEntry, key: str, n_ctx: int) -> Loaded:
        if not self._backend_logged:
            self._backend_logged = True
            log.info("llama.cpp backend: %s", system_info())
        rt = entry.config.runtime
        n = self.parallel(entry)
        log.info("loading %s for %s (num_ctx %d, %d slot%s)", entry.target.path.name, entry.name, n_ctx, n,
                 "" if n == 1 else "s")
        weights = self.weights.acquire(entry.target.path, rt.num_gpu, role="target")
        slots: list[Slot] = []
        try:
            for i in range(n):
                slots.append(Slot(i, Context(weights, ContextParams(
                    n_ctx=n_ctx, n_batch=min(rt.num_batch, n_ctx), n_threads=rt.num_thread, flash_attn=rt.flash_attn,
                    type_k=KV_TYPES[rt.kv_cache_type], type_v=KV_TYPES[rt.kv_cache_type],
                ))))
        except Exception:
            for slot in slots:
                slot.ctx.close()
            self.weights.release(weights)
            raise
        return Loaded(key, weights, slots, Pool(entry.name, slots))

    async def _load_pair(self, entry: PairEntry, lm: Loaded) -> PairEngine:
        """Build the pair's drafter in every slot (each on its slot's thread) and measure the cost curve."""
        d = entry.config.draft
        spec = entry.config.speculative.engine(ngram=isinstance(d, NgramDraft))
        draft_w: Weights | None = None
        if isinstance(d, ModelDraft) and entry.draft is not None:
            draft_w = await asyncio.to_thread(self._acquire_draft, entry.draft.path, d, lm)
        made: list[Context] = []  # draft contexts created so far, to free if another slot fails

        def build(slot: Slot) -> tuple[Drafter | None, CostModel | None]:
            drafter: Drafter | None = None
            draft_ctx = None
            if isinstance(d, NgramDraft):
                drafter = NgramDrafter(d.min_n, d.max_n)
            elif draft_w is not None and isinstance(d, ModelDraft):
                draft_ctx = Context(draft_w, ContextParams(
                    n_ctx=slot.ctx.n_ctx, n_batch=min(d.num_batch, slot.ctx.n_ctx), n_threads=d.num_thread,
                    flash_attn=d.flash_attn, type_k=KV_TYPES[d.kv_cache_type], type_v=KV_TYPES[d.kv_cache_type],
                ))
                made.append(draft_ctx)
                drafter = ModelDrafter(draft_ctx, spec.p_min)
            # One slot measures for all: the slots run the same model on the same hardware.
            cost = self._cost_model(lm, slot.ctx, spec, draft_ctx) if drafter and slot.index == 0 else None
            return drafter, cost

        try:
            parts = await asyncio.wrap_future(lm.pool.broadcast(build))
        except Exception:
            for c in made:  # every slot is past the broadcast: nothing uses them
                c.close()
            if draft_w is not None:
                self.weights.release(draft_w)
            raise
        cost = parts[0][1]  # shared: acceptance learnt on one slot steers the others too
        decoders = [Decoder(slot.ctx, drafter, spec, cost) for slot, (drafter, _) in zip(lm.slots, parts, strict=True)]
        draft_ctxs = [drafter.ctx for drafter, _ in parts if isinstance(drafter, ModelDrafter)]
        return PairEngine(decoders, draft_ctxs, draft_w, entry)

    def _acquire_draft(self, path: Path, d: ModelDraft, lm: Loaded) -> Weights:
        draft_w = self.weights.acquire(path, d.num_gpu, role="draft")
        try:
            check_pair(lm.weights, draft_w)
        except Exception:
            self.weights.release(draft_w)
            raise
        return draft_w

    @staticmethod
    def _cost_model(lm: Loaded, ctx: Context, spec: SpeculativeConfig, draft_ctx: Context | None) -> CostModel:
        rows = spec.n_max + 1
        if lm.calibrated is None or len(lm.calibrated.t_step) <= rows:
            t0 = time.perf_counter()
            cal = CostModel(rows)
            cal.calibrate(ctx)
            lm.calibrated = cal
            curve = ", ".join(f"{v:.2f}" for v in cal.verify_curve())
            log.info("verify cost curve of %s (x one-token step, n = 1..%d): %s; plain steps after a batch "
                     "cost %.2f steps more [%.2fs]", lm.weights.path.name, rows, curve,
                     cal.t_switch / cal.t_step[1], time.perf_counter() - t0)
        cost = CostModel(rows)
        cost.t_step = lm.calibrated.t_step[: rows + 1]
        cost.t_switch = lm.calibrated.t_switch
        if draft_ctx is not None:
            cost.calibrate_draft(draft_ctx)
        return cost

    # -- unloading and keep_alive ------------------------------------------------------------
    def _unload(self, lm: Loaded) -> None:
        """Forget the model now; its threads free it after the requests already queued on it."""
        if self._loaded.get(lm.key) is lm:
            del self._loaded[lm.key]
        if lm.timer:
            lm.timer.cancel()

        def free_slot(slot: Slot) -> None:
            for pe in list(lm.pairs.values()):
                if slot.index < len(pe.draft_ctxs):
                    pe.draft_ctxs[slot.index].close()
            slot.ctx.close()

        def release() -> None:
            for pe in list(lm.pairs.values()):
                if pe.draft_weights is not None:
                    self.weights.release(pe.draft_weights)
            self.weights.release(lm.weights)
            log.info("unloaded %s", lm.weights.path.name)

        lm.pool.broadcast(free_slot, release)
        lm.pool.stop()

    async def unload(self, entry: PairEntry) -> None:
        lm = self._loaded.get(self._key(entry))
        if lm is not None:
            self._unload(lm)

    async def unload_all(self) -> None:
        for lm in list(self._loaded.values()):
            self._unload(lm)
            await asyncio.to_thread(lm.pool.join, 30)

    def touch(self, lm: Loaded, keep_alive: float | None) -> None:
        """Push the model's expiry out by keep_alive seconds (negative: never; 0: now)."""
        ka = self.keep_alive if keep_alive is None else keep_alive
        if lm.timer:
            lm.timer.cancel()
            lm.timer = None
        if ka < 0:
            lm.expires_at = None
            return
        lm.expires_at = time.time() + ka
        loop = asyncio.get_running_loop()
        lm.timer = loop.call_later(max(ka, 0.0), self._expire, lm)

    def _expire(self, lm: Loaded) -> None:
        lm.timer = None
        loading = self._locks.get(lm.key)
        # A request loading a pair onto it has queued (or is about to queue) work on its slots:
        # stopping their threads now would leave that request waiting forever. Look again later.
        if lm.in_flight or (loading is not None and loading.locked()):
            lm.timer = asyncio.get_running_loop().call_later(1.0, self._expire, lm)
        elif lm.expires_at is not None and time.time() >= lm.expires_at - 0.01:
            self._unload(lm)

    # -- reloading ----------------------------------------------------------------------------
    def apply(self, new_entries: dict[str, PairEntry]) -> Changes:
        """Switch to a new set of pairs without disturbing the ones that did not change.

        Unchanged pairs keep their entry object, loaded target and drafter. A changed or removed
        pair loses its drafter here, but requests already running hold their own PairEngine and
        the drafter is freed by a job queued behind them on the model's thread; a target no pair
        uses any more is unloaded the same way (its queue drains first). Runs on the event loop
        without awaiting, so no request sees half of the old and half of the new set."""
        new = {name.lower(): e for name, e in new_entries.items()}
        changes = Changes()
        merged: dict[str, PairEntry] = {}
        for key, entry in new.items():
            prev = self.entries.get(key)
            if prev is None:
                changes.added.append(entry.name)
            elif same_pair(prev, entry):
                changes.kept.append(prev.name)
                entry = prev  # keep the very object: in-flight requests and engines compare by identity
            else:
                changes.changed.append(entry.name)
            merged[key] = entry
        changes.removed = [e.name for key, e in self.entries.items() if key not in new]
        self.entries = merged
        self._reconcile()
        return changes

    def _has_engine(self, lm: Loaded, entry: PairEntry) -> bool:
        """Whether lm carries a drafter fit for this declaration of the pair."""
        pe = lm.pairs.get(entry.name)
        return pe is not None and (pe.entry is entry or pe.entry is None
                                   or same_engine(pe.entry, entry))

    def _install(self, lm: Loaded, entry: PairEntry, pe: PairEngine) -> None:
        """Put a freshly built drafter in place; one it displaces is freed once its users finish.

        Displacement happens when a request that started before a reload loads its (old) pair
        after the reload dropped it, or the reverse."""
        old = lm.pairs.get(entry.name)
        lm.pairs[entry.name] = pe
        if old is not None and old is not pe:
            self._free_engine(lm, old)

    def _free_engine(self, lm: Loaded, pe: PairEngine) -> None:
        """Free a pair's drafters behind every job queued before this (so after its streams)."""

        def free_slot(slot: Slot) -> None:
            if slot.index < len(pe.draft_ctxs):
                pe.draft_ctxs[slot.index].close()

        def release() -> None:
            if pe.draft_weights is not None:
                self.weights.release(pe.draft_weights)
                log.info("freed draft %s of %s", pe.draft_weights.path.name, pe.entry.name if pe.entry else "?")

        lm.pool.broadcast(free_slot, release)

    def _drop_engine(self, lm: Loaded, name: str) -> None:
        pe = lm.pairs.pop(name, None)
        if pe is not None:
            self._free_engine(lm, pe)

    def _reconcile(self) -> None:
        """Bring what is loaded in line with self.entries (after apply, and retried while busy)."""
        self._reconcile_timer = None
        live = {self._key(e) for e in self.entries.values()}
        busy = False
        for lm in list(self._loaded.values()):
            loading = self._locks.get(lm.key)
            if lm.key not in live:
                if loading is not None and loading.locked():
                    # A request is loading onto it: stopping its thread now would strand that
                    # request's stream job. Look again once the load is through.
                    busy = True
                else:
                    self._unload(lm)
                continue
            for name, pe in list(lm.pairs.items()):
                cur = self.entries.get(name.lower())
                if cur is not None and cur.name == name and self._key(cur) == lm.key and (
                        pe.entry is cur or pe.entry is None or same_engine(pe.entry, cur)):
                    pe.entry = cur  # only per-request defaults changed: keep the drafter
                else:
                    self._drop_engine(lm, name)
        # A target still being loaded for a pair that just went away lands in _loaded later.
        busy = busy or any(lock.locked() for key, lock in self._locks.items() if key not in live)
        if busy:
            self._schedule_reconcile()

    def _schedule_reconcile(self, delay: float = 0.5) -> None:
        if self._reconcile_timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a synchronous caller): nothing can be loading either
        self._reconcile_timer = loop.call_later(delay, self._reconcile)

    # -- generation -------------------------------------------------------------------------
    def template(self, entry: PairEntry, lm: Loaded, override: str | None) -> ChatTemplate:
        w = lm.weights
        vi = w.vocab_info()
        return choose(
            override, entry.config.template, entry.target.template,
            entry.metadata.get("tokenizer.chat_template") if isinstance(
                entry.metadata.get("tokenizer.chat_template"), str) else None,
            bos_token=w.token_text(vi.bos).decode("utf-8", "replace") if vi.bos >= 0 else "",
            eos_token=w.token_text(vi.eos).decode("utf-8", "replace") if vi.eos >= 0 else "",
        )

    async def generate(
        self,
        entry: PairEntry,
        prompt: Callable[[Loaded], tuple[str, list[int] | None]],
        opts: Effective,
        keep_alive: float | None,
        format: str | dict[str, Any] | None = None,
    ) -> AsyncIterator[str | Outcome]:
        """Stream text pieces, then one Outcome.

        `prompt(loaded)` returns the prompt text (tokenized with special tokens parsed) and any
        token ids to put before it (Ollama's deprecated `context`). `format` is Ollama's: "json"
        or a JSON schema the output must follow; a bad one raises GrammarError before any loading.
        Raises ShuttingDown when the drain deadline of a shutdown cut the generation short."""
        if self.halt.is_set():
            raise ShuttingDown("server shutting down")
        grammar = gbnf_for_format(format)
        if self._pending >= self.max_queue:
            raise ServerBusy("server busy, please try again.  maximum pending requests exceeded")
        self._pending += 1
        try:
            lm, load_seconds = await self.load(entry, opts.num_ctx)
            lm.in_flight += 1
            try:
                text, before = prompt(lm)
                pe = lm.pairs[entry.name]
                speculate = opts.draft_num_predict != 0
                n_max = opts.draft_num_predict or None
                # Add BOS when the vocabulary wants it, unless the template already wrote it.
                add_special = not lm.weights.starts_with_bos(text)

                def produce(slot: Slot, cancelled: Callable[[], bool]) -> Iterator[str | Result]:
                    tokens = list(before or []) + lm.weights.tokenize(
                        text, add_special=add_special and not before, parse_special=True)
                    req = Request(tokens, opts.sampling, opts.num_predict, opts.stop, speculate, n_max, grammar)

                    def stop() -> bool:  # the client went away, or the shutdown's drain deadline passed
                        return cancelled() or self.halt.is_set()

                    for item in pe.decoders[slot.index].generate(req, stop):
                        if isinstance(item, Result):
                            yield Outcome(item, load_seconds, tokens + item.tokens)  # type: ignore[misc]
                        else:
                            yield item

                # Close the inner stream explicitly: an abandoned async generator is only finalised
                # by the garbage collector, and until then the worker keeps generating.
                items = stream(lm.pool, produce)
                try:
                    async for item in items:
                        if isinstance(item, Outcome) and item.result.done_reason == "cancel" and self.halt.is_set():
                            raise ShuttingDown("server shutting down")
                        yield item
                finally:
                    await items.aclose()
            finally:
                lm.in_flight -= 1
                if self._loaded.get(lm.key) is lm:
                    self.touch(lm, keep_alive)
        finally:
            self._pending -= 1
