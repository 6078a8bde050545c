"""Making room for a pair's load: its plan against what the machine has free, and what to evict first.

Ollama's scheduler (server/sched.go, findRunnerToUnload) unloads its own idle runners, least
recently used first, when a load needs room, and bounds them by OLLAMA_MAX_LOADED_MODELS. The
daemon does the same with its own targets, and then, since it shares the GPU with the upstream
Ollama, which cannot know what the daemon holds, asks the upstream to unload its idle models (an
empty /api/generate with `keep_alive: 0`, as Ollama's CLI `ollama stop` does) before it loads.

A model serving a request is never touched. For the daemon's own that is its in-flight count. For
the upstream's it cannot be read: Ollama's /api/ps has no busy flag, and `expires_at` does not move
while a request runs (it is set when one ends). So the daemon counts the requests it forwards to the
upstream (api.proxy); a model with one running through the daemon is busy, and one pinned with a
negative keep_alive (expires_at far away) is left alone. A request sent to the upstream's own port,
past the daemon, is not seen; Ollama then still finishes it before it unloads (its expireRunner waits
for the runner's refCount), so it is delayed, not cut.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol

from sidecar.config.entries import PairEntry
from sidecar.errors import ServerError
from sidecar.runtime.memory import Device, PairPlan, Settings, Shape, gpu_overhead, human, place

log = logging.getLogger("sidecar.runtime")


class NoRoom(ServerError):
    """The pair's plan exceeds the GPUs and the free RAM together: Ollama's 500, its words."""

    traced = False


@dataclass(frozen=True)
class Resident:
    """A model the upstream holds, as its /api/ps lists it."""

    name: str
    size: int
    size_vram: int


class Neighbour(Protocol):
    """The upstream Ollama, as far as making room goes (api.proxy implements it over HTTP)."""

    async def idle_models(self) -> list[Resident]:
        """Its loaded models that no request is known to be using, least recently used first."""
        ...

    async def unload(self, name: str) -> None:
        """Ask it to unload the model now (keep_alive 0)."""
        ...


PINNED_AFTER = timedelta(days=365 * 100)  # an expires_at further out is a negative keep_alive: never evict


def pinned(expires_at: str, now: datetime | None = None) -> bool:
    """Whether an /api/ps `expires_at` says the model is kept forever (Ollama writes year 2318)."""
    try:
        when = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except ValueError:
        return False
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when - (now or datetime.now(UTC)) > PINNED_AFTER


@functools.lru_cache(maxsize=64)
def _shape(path: str, mtime: float) -> Shape:
    return Shape.from_gguf(path)


def shape_of(path: Path) -> Shape:
    """The model's shape, read once per file version."""
    return _shape(str(path), path.stat().st_mtime)


def settings(entry: PairEntry, n_ctx: int, parallel: int, num_gpu: int = -1) -> tuple[Settings, Settings | None]:
    """The target's and the draft's load settings as the plan takes them; num_gpu -1 (the default,
    Ollama's "not set") is left to the plan. `num_gpu`: a request's count for the target, which wins
    over the pair's."""
    rt = entry.config.runtime
    want = num_gpu if num_gpu >= 0 else rt.num_gpu
    t = Settings(n_ctx, parallel, rt.num_batch, rt.kv_cache_type, rt.flash, None if want < 0 else want)
    d = entry.model_draft
    if d is None or entry.draft is None:
        return t, None
    # The draft's context: the target's window and streams (runtime.llamacpp.loading load_pair).
    return t, Settings(n_ctx, parallel, d.num_batch, d.kv_cache_type, d.flash, None if d.num_gpu < 0 else d.num_gpu)


def plan_entry(entry: PairEntry, n_ctx: int, parallel: int, gpus: list[Device], ram_free: int,
               overhead: int | None = None, num_gpu: int = -1) -> PairPlan | None:
    """The pair's plan, or None for a pair that is not GGUF files (a vLLM pair, a folder)."""
    if entry.config.engine != "llama.cpp" or entry.target.path.is_dir():
        return None
    t, d = settings(entry, n_ctx, parallel, num_gpu)
    draft = shape_of(entry.draft.path) if d is not None and entry.draft is not None else None
    return place(shape_of(entry.target.path), t, draft, d, gpus, ram_free,
                 overhead=gpu_overhead() if overhead is None else overhead)


def detect_gpus() -> list[Device]:
    """The GPUs llama.cpp offloads to, with what they have free now (engine.devices)."""
    from sidecar.engine.devices import gpus

    return [Device(name, free, total, desc) for name, desc, free, total in gpus()]


def max_loaded(n_gpus: int, env: dict[str, str] | os._Environ[str] | None = None) -> int:
    """OLLAMA_MAX_LOADED_MODELS (envconfig/config.go); unset: 3 per GPU, 3 on the CPU (sched.go's
    defaultModelsPerGPU)."""
    raw = (env if env is not None else os.environ).get("OLLAMA_MAX_LOADED_MODELS", "").strip()
    try:
        n = int(raw) if raw else 0
    except ValueError:
        n = 0
    return n if n > 0 else 3 * max(1, n_gpus)


@dataclass
class Credit:
    """Memory an eviction gives back, counted before the devices show it (freeing is asynchronous)."""

    vram: int = 0
    ram: int = 0

    def apply(self, gpus: list[Device], ram: int) -> tuple[list[Device], int]:
        if not gpus:
            return gpus, ram + self.ram + self.vram
        out = list(gpus)
        share = self.vram // len(out)
        out = [Device(g.name, min(g.total, g.free + share), g.total, g.description) for g in out]
        return out, ram + self.ram


def describe(plan: PairPlan) -> str:
    """One line for the log: where the pair's layers go."""
    parts = []
    for role, p in (("target", plan.target), ("draft", plan.draft)):
        if p is not None:
            parts.append(f"{role} {p.gpu_layers}/{p.layers} layers on GPU ({human(p.vram)} VRAM, {human(p.ram)} RAM)"
                         + (f": {p.note}" if p.note else ""))
    return "; ".join(parts)


def report(plans: dict[str, tuple[PairEntry, PairPlan | None]], gpus: list[Device], ram: int, source: str) -> str:
    """`sidecar check`'s memory section: per pair, where each model's layers go, its KV and compute
    sizes, and what is left free."""
    where = ", ".join(f"{g.name} {human(g.free)} free of {human(g.total)}" for g in gpus) or "no GPU"
    lines = [f"memory plan: {where}{source}; RAM {human(ram)} free"]
    for name, (entry, plan) in plans.items():
        if plan is None:
            lines.append(f"  {name}: not planned ({entry.config.engine} pair)")
            continue
        t = plan.target
        lines.append(f"  {name}:")
        for role, p in (("draft", plan.draft), ("target", t)):
            if p is None:
                continue
            on = ", ".join(f"{k} on {g.name}" for g, k in zip(gpus, p.split, strict=False) if k) or "none on a GPU"
            lines.append(f"    {role:6} {p.name}: {p.gpu_layers}/{p.layers} layers on GPU ({on}); "
                         f"weights {human(p.weights)}, KV {human(p.kv)}, compute {human(p.compute_cpu + p.compute_gpu)}"
                         f" = {human(p.vram)} VRAM + {human(p.ram)} RAM")
            if p.note:
                lines.append(f"           {p.note}")
        left = ", ".join(f"{g.name} {human(x)}" for g, x in zip(gpus, plan.gpu_left, strict=False))
        lines.append(f"    left free: {left + '; ' if left else ''}RAM {human(max(0, plan.ram_free - plan.ram))}")
        lines.append(f"    {'fits' if plan.fits else 'does not fit: ' + plan.reason}")
    return "\n".join(lines)
