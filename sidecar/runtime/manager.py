"""Pairs at run time: which are served, loading and sharing, keep_alive, queueing, generation.

A target model is loaded once however many pairs use it (runtime.loading): each pair rides on it
with its own drafter. Requests for a target queue in one FIFO and run on the first free slot
(OLLAMA_NUM_PARALLEL, or the pair's runtime.num_parallel; default 1), so N of them generate at
once. keep_alive works as in Ollama: each request pushes the model's expiry out, `keep_alive: 0`
unloads right after the request, negative keeps it forever. A reload (`apply`) swaps the set of
pairs without disturbing the ones that did not change.

Ollama picks its parallelism automatically from free memory; here it defaults to 1, because every
slot costs a whole KV cache (and a draft KV cache) and a local daemon mostly serves one client.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from sidecar.config.entries import Changes, PairEntry, same_engine, same_pair
from sidecar.config.options import coerce
from sidecar.engine.decoder import Result
from sidecar.engine.grammar import gbnf_for_format
from sidecar.errors import Unavailable
from sidecar.runtime import generation, render
from sidecar.runtime.caches import SuffixCaches
from sidecar.runtime.contract import Delta, Job, Outcome
from sidecar.runtime.curves import CurveCache
from sidecar.runtime.generation import ShuttingDown
from sidecar.runtime.loading import Loaded, PairEngine, free_engine, load_pair, load_target, unload
from sidecar.runtime.options import Effective, effective
from sidecar.runtime.registry import WeightsRegistry

log = logging.getLogger("sidecar.runtime")


class ServerBusy(Unavailable):
    pass


class Runtime:
    def __init__(self, *, keep_alive: float = 300.0, max_queue: int = 512, num_parallel: int = 1) -> None:
        self.entries: dict[str, PairEntry] = {}
        self.keep_alive = keep_alive
        self.max_queue = max_queue
        self.num_parallel = num_parallel  # slots per target unless its pair sets runtime.num_parallel
        # Set at the end of a shutdown's drain: every running generation stops at its next step.
        self.halt = threading.Event()
        self.weights = WeightsRegistry()
        self.caches = SuffixCaches()
        self.curves = CurveCache()
        self._loaded: dict[str, Loaded] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._pending = 0
        self.on_load: list[Callable[[str, float, bool], None]] = []  # (pair, seconds, ok), e.g. metrics
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
                f"|fa={rt.flash}|kv={rt.kv_cache_type}|np={self.parallel(entry)}")

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
                    lm = await asyncio.to_thread(load_target, self.weights, entry, key, n_ctx,
                                                 self.parallel(entry))
                    self._loaded[key] = lm
                if not self._has_engine(lm, entry):
                    loaded = True
                    self._install(lm, entry, await load_pair(self.weights, entry, lm, self.caches, self.curves))
            except Exception:
                self._report_load(entry.name, time.perf_counter() - t0, False)
                raise
            if loaded:
                self._report_load(entry.name, time.perf_counter() - t0, True)
        return lm, time.perf_counter() - t0

    def _report_load(self, name: str, seconds: float, ok: bool) -> None:
        for hook in self.on_load:
            hook(name, seconds, ok)

    # -- unloading and keep_alive ------------------------------------------------------------
    def _unload(self, lm: Loaded) -> None:
        """Forget the model now; its threads free it after the requests already queued on it."""
        if self._loaded.get(lm.key) is lm:
            del self._loaded[lm.key]
        if lm.timer:
            lm.timer.cancel()
        unload(self.weights, lm)

    async def unload(self, entry: PairEntry) -> None:
        lm = self._loaded.get(self._key(entry))
        if lm is not None:
            self._unload(lm)

    async def unload_all(self) -> None:
        """Stop: free every model (after its queued work) and write the suffix caches' files."""
        for lm in list(self._loaded.values()):
            self._unload(lm)
            await asyncio.to_thread(lm.pool.join, 30)
        await asyncio.to_thread(self.caches.save)

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
            free_engine(self.weights, lm, old)

    def _drop_engine(self, lm: Loaded, name: str) -> None:
        pe = lm.pairs.pop(name, None)
        if pe is not None:
            free_engine(self.weights, lm, pe)

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
    @property
    def pending(self) -> int:
        """Generation requests admitted and not finished (waiting or running)."""
        return self._pending

    def _admit(self, entry: PairEntry, job: Job) -> tuple[Effective, str | None, Job]:
        """Everything that can be refused before any work: options, format, capabilities; and the
        job with `think` settled (render.admit).

        A bad `format` raises GrammarError, a bad option OptionError, a missing capability
        render.Unsupported: all ClientErrors, the client's 400."""
        if self.halt.is_set():
            raise ShuttingDown("server shutting down")
        opts = effective(entry.params, coerce(job.options))
        grammar = gbnf_for_format(job.format)
        prompt = render.admit(entry, job.prompt)
        return opts, grammar, job if prompt is job.prompt else replace(job, prompt=prompt)

    async def render_only(self, entry: PairEntry, job: Job) -> str:
        """The prompt text a job would run on (Ollama's `_debug_render_only`), fitted to the window."""
        opts, _, job = self._admit(entry, job)
        lm, _ = await self.load(entry, opts.num_ctx)
        return await generation.render_text(entry, job, lm, opts)

    async def _load_only(self, entry: PairEntry, job: Job, opts: Effective) -> Outcome:
        """A job with an empty prompt: load the model (keeping it for keep_alive), or unload it."""
        if job.keep_alive == 0:
            await self.unload(entry)
            return Outcome(Result(done_reason="unload"))
        lm, seconds = await self.load(entry, opts.num_ctx)
        self.touch(lm, job.keep_alive)
        return Outcome(Result(done_reason="load"), seconds)

    async def generate(self, entry: PairEntry, job: Job) -> AsyncIterator[Delta | Outcome]:
        """Stream the output as Deltas, then one Outcome.

        Raises what refuses the job (ClientErrors, ServerBusy) before the first item, and
        ShuttingDown when the drain deadline of a shutdown cut the generation short."""
        opts, grammar, job = self._admit(entry, job)
        if job.load_only:
            yield await self._load_only(entry, job, opts)
            return
        if self._pending >= self.max_queue:
            raise ServerBusy("server busy, please try again.  maximum pending requests exceeded")
        self._pending += 1
        try:
            lm, load_seconds = await self.load(entry, opts.num_ctx)
            lm.in_flight += 1
            try:
                async for item in generation.run(entry, job, lm, opts, grammar, load_seconds, self.halt):
                    yield item
            finally:
                lm.in_flight -= 1
                if self._loaded.get(lm.key) is lm:
                    self.touch(lm, job.keep_alive)
        finally:
            self._pending -= 1
