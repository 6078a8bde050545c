"""Pairs at run time: which are served, loading and sharing, keep_alive, queueing, generation.

A target model is loaded once however many pairs use it: the engine (runtime.contract.Engine; the
llama.cpp one is runtime.llamacpp) names what makes two pairs share it, and each pair rides on it
with its own drafter. Each pair's format (runtime.format) is resolved when its declaration is
applied. Requests for a target queue in one FIFO and up to N of them generate at once in one
batch (OLLAMA_NUM_PARALLEL, or the pair's runtime.num_parallel; the daemon's default is 2: the
conversation and a side request beside it; the engine does the batching). keep_alive works as in
Ollama: each request pushes the model's expiry out, `keep_alive: 0` unloads right after the
request (or, with no prompt, once the requests running on it are done), negative keeps it
forever. A reload (`apply`) swaps the set of pairs without disturbing the ones that did not change.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from sidecar.config.entries import MIN_NUM_CTX, Changes, PairEntry, same_engine, same_pair
from sidecar.config.options import coerce
from sidecar.engine.grammar import gbnf_for_format
from sidecar.errors import Unavailable
from sidecar.runtime import generation, render
from sidecar.runtime.contract import Delta, Engine, Job, Model, ModelStatus, Outcome
from sidecar.runtime.format import PairFormat, resolve
from sidecar.runtime.generation import ShuttingDown
from sidecar.runtime.memory import Device, PairPlan, human, ram_available
from sidecar.runtime.options import Effective, effective
from sidecar.runtime.room import Credit, Neighbour, NoRoom, describe, detect_gpus, max_loaded, plan_entry

log = logging.getLogger("sidecar.runtime")


class ServerBusy(Unavailable):
    pass


@dataclass(eq=False)
class Served:
    """A loaded target as the runtime keeps it: the engine's model, its keep_alive and its requests."""

    key: str
    model: Model
    expires_at: float | None = None  # time.time() deadline; None = never
    in_flight: int = 0
    timer: asyncio.TimerHandle | None = None
    # What its expiry is pushed out by when a request ends, in seconds (negative: never): Ollama's
    # sessionDuration (server/sched.go). The daemon's default at load; then each request that
    # names a keep_alive sets it as it starts (useLoadedRunner), and one that names none leaves it.
    # `keep_alive: 0` with no prompt sets 0 (expireRunner): unloaded once its requests are done.
    keep_alive: float = 0.0
    plan: PairPlan | None = None  # the memory plan it was loaded under (runtime.memory); None: not GGUF
    used_at: float = field(default_factory=time.monotonic)  # last request's start: the LRU order of eviction

    def status(self) -> ModelStatus:
        return replace(self.model.status(), in_flight=self.in_flight, expires_at=self.expires_at)


class Runtime:
    """The served pairs over one engine: everything about a request between the API and the
    engine (admission, formats, loading and sharing, keep_alive, queue limits, reloads)."""

    def __init__(self, engine: Engine, *, keep_alive: float = 300.0, max_queue: int = 512,
                 num_parallel: int = 1) -> None:
        self.engine = engine
        self.entries: dict[str, PairEntry] = {}
        self._formats: dict[str, tuple[PairEntry, PairFormat]] = {}
        self.keep_alive = keep_alive
        self.max_queue = max_queue
        self.num_parallel = num_parallel  # sequences per target unless its pair sets runtime.num_parallel
        # Set at the end of a shutdown's drain: every running generation stops at its next step.
        self.halt = threading.Event()
        self._loaded: dict[str, Served] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._pending = 0
        self.on_load: list[Callable[[str, float, bool], None]] = []  # (pair, seconds, ok), e.g. metrics
        self._reconcile_timer: asyncio.TimerHandle | None = None
        # Making room (runtime.room): the devices and free RAM as the machine reports them, and the
        # upstream Ollama whose idle models may be unloaded for a load (api.proxy sets it).
        self.gpus: Callable[[], list[Device]] = detect_gpus
        self.ram: Callable[[], int] = ram_available
        self.neighbour: Neighbour | None = None

    # -- pairs ------------------------------------------------------------------------------
    def set_entries(self, entries: dict[str, PairEntry]) -> None:
        self.entries = {name.lower(): e for name, e in entries.items()}
        self._resolve_formats()

    def _resolve_formats(self) -> None:
        """Each pair's format, kept for a declaration that did not change."""
        old = self._formats
        self._formats = {key: held if (held := old.get(key)) is not None and held[0] is e else (e, resolve(e))
                         for key, e in self.entries.items()}

    def format(self, entry: PairEntry) -> PairFormat:
        """The pair's format; a request still running on an older declaration gets that one's."""
        held = self._formats.get(entry.name.lower())
        return held[1] if held is not None and held[0] is entry else resolve(entry)

    def find(self, model: str) -> PairEntry | None:
        name = model.strip().lower()
        if name and ":" not in name.rsplit("/", 1)[-1]:
            name += ":latest"
        return self.entries.get(name)

    def parallel(self, entry: PairEntry) -> int:
        return entry.config.runtime.num_parallel or self.num_parallel

    def _key(self, entry: PairEntry) -> str:
        return self.engine.load_key(entry, self.parallel(entry))

    def loaded_models(self) -> list[Model]:
        """Targets loaded right now (each with its pairs)."""
        return [s.model for s in self._loaded.values()]

    def status(self) -> list[ModelStatus]:
        """Loaded targets as /sidecar/status shows them."""
        return [s.status() for s in self._loaded.values()]

    def loaded_entries(self) -> list[tuple[PairEntry, Served]]:
        """Every pair whose target and drafting are loaded, with its target (/api/ps, metrics)."""
        out = []
        for e in self.entries.values():
            served = self._loaded.get(self._key(e))
            if served is not None and self._has_engine(served.model, e):
                out.append((e, served))
        return out

    # -- loading ----------------------------------------------------------------------------
    async def load(self, entry: PairEntry, num_ctx: int | None = None, num_gpu: int = -1) -> tuple[Model, float]:
        """Make the pair ready; returns the loaded target and the seconds spent loading."""
        served, seconds = await self._load(entry, num_ctx, num_gpu)
        return served.model, seconds

    async def _load(self, entry: PairEntry, num_ctx: int | None, num_gpu: int = -1) -> tuple[Served, float]:
        """`num_gpu`: a request's count of target layers on the GPUs (-1: the pair's), which wins."""
        key = self._key(entry)
        n_ctx = entry.num_ctx(num_ctx)
        if num_ctx and num_ctx < n_ctx == MIN_NUM_CTX:
            log.info("%s: num_ctx %d is too small to run; raised to %d", entry.name, num_ctx, n_ctx)
        lock = self._locks.setdefault(key, asyncio.Lock())
        t0 = time.perf_counter()
        async with lock:
            served = self._loaded.get(key)
            if served is not None and not served.model.fits(n_ctx, num_gpu):
                # Like Ollama (server/sched.go, needsReload): a different num_ctx, or a num_gpu other
                # than -1 and the loaded count, means a reload; in-flight requests finish first.
                self._unload(served)
                served = None
            loaded = False
            try:
                if served is None:
                    loaded = True
                    plan = await self._make_room(entry, n_ctx, key, num_gpu)
                    served = Served(key, await self.engine.load(entry, n_ctx, self.parallel(entry), num_gpu),
                                    keep_alive=self.keep_alive, plan=plan)
                    self._loaded[key] = served
                if not self._has_engine(served.model, entry):
                    loaded = True
                    for note in self.format(entry).notes:
                        log.warning("%s: %s", entry.name, note)
                    if entry.chosen:
                        log.info("%s: %s", entry.name, entry.chosen)
                    await self.engine.add_pair(served.model, entry)
            except Exception:
                self._report_load(entry.name, time.perf_counter() - t0, False)
                raise
            if loaded:
                self._report_load(entry.name, time.perf_counter() - t0, True)
        return served, time.perf_counter() - t0

    async def _make_room(self, entry: PairEntry, n_ctx: int, key: str, num_gpu: int = -1) -> PairPlan | None:
        """The pair's memory plan, after evicting what it needs: the daemon's own idle targets
        (least recently used first, as Ollama's findRunnerToUnload), then the upstream's idle
        models. A load wants room when its plan does not fit, when it would put fewer layers on the
        GPUs than empty GPUs take, or when OLLAMA_MAX_LOADED_MODELS targets are loaded. Raises
        NoRoom, in Ollama's words, when the plan cannot fit even then."""
        if entry.config.engine != "llama.cpp":
            return None
        gpus = await asyncio.to_thread(self.gpus)
        ram = self.ram()
        credit = Credit()
        parallel = self.parallel(entry)

        def replan() -> PairPlan | None:
            g, r = credit.apply(gpus, ram)
            return plan_entry(entry, n_ctx, parallel, g, r, num_gpu=num_gpu)

        try:
            plan = await asyncio.to_thread(replan)
        except (OSError, ValueError) as e:  # a header the plan cannot read: llama.cpp's load says more
            log.warning("%s: no memory plan: %s", entry.name, e)
            return None
        if plan is None:
            return None
        empty = plan_entry(entry, n_ctx, parallel, [replace(g, free=g.total) for g in gpus], ram,
                           num_gpu=num_gpu) if gpus else plan
        best = empty.target.gpu_layers if empty is not None else 0
        limit = max_loaded(len(gpus))

        def short(p: PairPlan) -> bool:
            return not p.fits or p.target.gpu_layers < best

        for victim in sorted(self._loaded.values(), key=lambda s: s.used_at):
            crowded = len(self._loaded) >= limit
            if not (short(plan) or crowded):
                break
            if victim.key == key or victim.in_flight or self._loading(victim):
                continue
            why = f"OLLAMA_MAX_LOADED_MODELS={limit}" if crowded and not short(plan) else "to make room"
            log.info("evicting idle %s (%s) %s for %s", Path(victim.model.status().target).name,
                     human(victim.plan.total) if victim.plan else "size unknown", why, entry.name)
            self._unload(victim)
            await self.engine.join(victim.model, 30)  # idle: its thread frees it at once; the load measures after
            if victim.plan is not None:
                credit.vram += victim.plan.vram
                credit.ram += victim.plan.ram
            plan = replan() or plan
        if short(plan) and self.neighbour is not None:
            for r in await self.neighbour.idle_models():
                log.info("asking the upstream to unload its idle %s (%s, %s on GPUs) to make room for %s",
                         r.name, human(r.size), human(r.size_vram), entry.name)
                await self.neighbour.unload(r.name)
                credit.vram += r.size_vram
                credit.ram += max(0, r.size - r.size_vram)
                plan = replan() or plan
                if not short(plan):
                    break
        if not plan.fits:
            log.warning("%s: %s (%s)", entry.name, plan.reason, describe(plan))
            raise NoRoom(plan.reason)
        log.info("%s: %s", entry.name, describe(plan))
        return plan

    def _report_load(self, name: str, seconds: float, ok: bool) -> None:
        for hook in self.on_load:
            hook(name, seconds, ok)

    # -- unloading and keep_alive ------------------------------------------------------------
    def _unload(self, served: Served) -> None:
        """Forget the model now; the engine frees it after the requests already queued on it."""
        if self._loaded.get(served.key) is served:
            del self._loaded[served.key]
        if served.timer:
            served.timer.cancel()
        self.engine.unload(served.model)

    async def unload_all(self) -> None:
        """Stop: free every model (after its queued work) and write what must outlive the process."""
        for served in list(self._loaded.values()):
            self._unload(served)
            await self.engine.join(served.model, 30)
        await self.engine.close()

    @staticmethod
    def _session(served: Served, job: Job) -> None:
        """A request that names a keep_alive sets what the model's expiry is pushed out by when
        requests end; one that names none leaves it (Ollama's useLoadedRunner, server/sched.go)."""
        if job.keep_alive is not None:
            served.keep_alive = job.keep_alive

    def touch(self, served: Served) -> None:
        """Push the model's expiry out by its keep_alive (negative: never; 0: now)."""
        ka = served.keep_alive
        if served.timer:
            served.timer.cancel()
            served.timer = None
        if ka < 0:
            served.expires_at = None
            return
        served.expires_at = time.time() + ka
        loop = asyncio.get_running_loop()
        served.timer = loop.call_later(max(ka, 0.0), self._expire, served)

    def _loading(self, served: Served) -> bool:
        """A request is loading a pair onto it: it has queued (or is about to queue) work on its
        slots, and stopping their threads now would leave that request waiting forever."""
        lock = self._locks.get(served.key)
        return lock is not None and lock.locked()

    def _expire(self, served: Served) -> None:
        served.timer = None
        if served.in_flight or self._loading(served):  # look again later
            served.timer = asyncio.get_running_loop().call_later(1.0, self._expire, served)
        elif served.expires_at is not None and time.time() >= served.expires_at - 0.01:
            self._unload(served)

    # -- reloading ----------------------------------------------------------------------------
    def apply(self, new_entries: dict[str, PairEntry]) -> Changes:
        """Switch to a new set of pairs without disturbing the ones that did not change.

        Unchanged pairs keep their entry object, loaded target and drafter. A changed or removed
        pair loses its drafter here, but the engine frees it only after the requests already
        running on it; a target no pair uses any more is unloaded the same way (its queue drains
        first). Runs on the event loop
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
        self._resolve_formats()
        self._reconcile()
        return changes

    def _has_engine(self, model: Model, entry: PairEntry) -> bool:
        """Whether the model carries a drafter fit for this declaration of the pair."""
        built = model.pair(entry.name)
        return built is not None and (built is entry or same_engine(built, entry))

    def _reconcile(self) -> None:
        """Bring what is loaded in line with self.entries (after apply, and retried while busy)."""
        self._reconcile_timer = None
        live = {self._key(e) for e in self.entries.values()}
        busy = False
        for served in list(self._loaded.values()):
            if served.key not in live:
                if self._loading(served):
                    busy = True  # look again once the load is through
                else:
                    self._unload(served)
                continue
            model = served.model
            for name in model.status().pairs:
                cur = self.entries.get(name.lower())
                if cur is not None and cur.name == name and self._key(cur) == served.key \
                        and self._has_engine(model, cur):
                    self.engine.rebind_pair(model, cur)  # only per-request defaults changed: keep the drafter
                else:
                    self.engine.drop_pair(model, name)
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

    def _admit(self, entry: PairEntry, job: Job) -> tuple[Effective, str | None, PairFormat, Job]:
        """Everything that can be refused before any work: options, format, capabilities; and the
        job with `think` settled (render.admit).

        A bad `format` raises GrammarError, a bad option OptionError, a missing capability
        render.Unsupported: all ClientErrors, the client's 400."""
        if self.halt.is_set():
            raise ShuttingDown("server shutting down")
        opts = effective(entry.params, coerce(job.options))
        grammar = gbnf_for_format(job.format)
        fmt = self.format(entry)
        prompt = render.admit(entry, fmt, job.prompt)
        return opts, grammar, fmt, job if prompt is job.prompt else replace(job, prompt=prompt)

    async def render_only(self, entry: PairEntry, job: Job) -> str:
        """The prompt text a job would run on (Ollama's `_debug_render_only`), fitted to the window."""
        opts, _, fmt, job = self._admit(entry, job)
        model, _ = await self.load(entry, opts.num_ctx, opts.num_gpu)
        return (await generation.rendered(entry, fmt, job, model, opts.num_keep)).text

    async def count_tokens(self, entry: PairEntry, job: Job) -> int:
        """The tokens of the prompt a job would run on, by the pair's own template and tokenizer
        (Anthropic's count_tokens; loading the pair if it is not loaded)."""
        opts, _, fmt, job = self._admit(entry, job)
        model, _ = await self.load(entry, opts.num_ctx, opts.num_gpu)
        return len((await generation.rendered(entry, fmt, job, model, opts.num_keep)).tokens)

    async def _load_only(self, entry: PairEntry, job: Job, opts: Effective) -> Outcome:
        """A job with an empty prompt: load the model (keeping it for keep_alive), or unload it."""
        if job.keep_alive == 0:
            served = self._loaded.get(self._key(entry))
            if served is not None and (served.in_flight or self._loading(served)):
                served.keep_alive = 0
                self.touch(served)  # unloads once its requests (and a pair loading onto it) are done
            elif served is not None:
                self._unload(served)
            return Outcome(done_reason="unload")
        served, seconds = await self._load(entry, opts.num_ctx, opts.num_gpu)
        self._session(served, job)
        if not served.in_flight:  # else the expiry moves when the last of them ends (sched.go, processCompleted)
            self.touch(served)
        return Outcome(done_reason="load", load_seconds=seconds)

    async def generate(self, entry: PairEntry, job: Job, stop: Callable[[], bool] | None = None
                       ) -> AsyncIterator[Delta | Outcome]:
        """Stream the output as Deltas, then one Outcome. `stop`: the caller's (its client left);
        the generation then ends at the engine's next step with a `cancel` Outcome that counts
        what it generated (closing the stream also stops it, without that Outcome).

        Raises what refuses the job (ClientErrors, ServerBusy) before the first item, and
        ShuttingDown when the drain deadline of a shutdown cut the generation short."""
        opts, grammar, fmt, job = self._admit(entry, job)
        if job.load_only:
            yield await self._load_only(entry, job, opts)
            return
        if self._pending >= self.max_queue:
            raise ServerBusy("server busy, please try again.  maximum pending requests exceeded")
        self._pending += 1
        try:
            served, load_seconds = await self._load(entry, opts.num_ctx, opts.num_gpu)
            served.in_flight += 1
            served.used_at = time.monotonic()
            self._session(served, job)
            try:
                async for item in generation.run(self.engine, served.model, entry, fmt, job, opts, grammar,
                                                 load_seconds, self.halt, stop):
                    yield item
            finally:
                served.in_flight -= 1
                if self._loaded.get(served.key) is served:
                    self.touch(served)
        finally:
            self._pending -= 1
