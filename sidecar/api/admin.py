"""The daemon's own routes, kept outside /api/ so they can never shadow an Ollama route.

GET /sidecar/status answers "did my edit take?" without reading logs: which config is in force
(path, hash, when it was loaded), the last reload error if the newest edit was refused, reload
counters, every pair with its state, and what is loaded (targets, mapped weights and how many
contexts share each, which is how to see that a model shared by several pairs is loaded once).
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from sidecar.api.pairs import runtime_of
from sidecar.api.wire import json_response
from sidecar.config.entries import PairEntry
from sidecar.runtime.manager import Runtime
from sidecar.runtime.reload import Reloader

RELOADER = web.AppKey("sidecar_reloader", Reloader)


def setup(app: web.Application) -> None:
    app.router.add_get("/sidecar/status", status)


async def status(request: web.Request) -> web.Response:
    rt = runtime_of(request)
    reloader = request.app.get(RELOADER)
    body: dict[str, Any] = reloader.info() if reloader is not None else {"config": None}
    pair_errors = reloader.pair_errors if reloader is not None else {}
    body["pairs"] = pairs(rt, pair_errors)
    body["models"] = models(rt)
    body.update(rt.engine.status())  # what the engine has mapped and shared (loaded_weights, weights)
    return json_response(body)


def _draft(entry: PairEntry) -> str | None:
    """The draft's file where it is a model, else how the pair names it (ngram, none)."""
    return str(entry.draft.path) if entry.draft is not None else entry.draft_label


def pairs(rt: Runtime, errors: dict[str, str]) -> list[dict[str, Any]]:
    loaded = {e.name for e, _ in rt.loaded_entries()}
    out = [{
        "name": e.name,
        "state": "loaded" if e.name in loaded else "unloaded",
        "from": e.config.from_,
        "target": str(e.target.path),
        "draft": _draft(e),
        "capabilities": list(rt.format(e).capabilities),
        "auto": e.auto,
        "chosen": e.chosen,  # `draft: auto` and `auto: true`: which draft, and why
        "notes": list(rt.format(e).notes),  # what Ollama's manifest asks for that is served differently here
        "error": errors.get(e.name),
    } for e in rt.entries.values()]
    served = {e.name for e in rt.entries.values()}
    out += [{"name": name, "state": "error", "error": err} for name, err in errors.items() if name not in served]
    return out


def models(rt: Runtime) -> list[dict[str, Any]]:
    """Loaded targets: one context each, the pairs riding on it, requests in flight."""
    out = []
    for s in rt.status():
        out.append({
            "target": s.target,
            "context_length": s.context_length,
            "parallel": s.parallel,
            "pairs": list(s.pairs),
            "in_flight": s.in_flight,
            "busy": s.busy,  # sequences in its batch now
            "rows_per_step": round(s.rows / s.steps, 2) if s.steps else 0.0,
            "cached_tokens": s.cached_tokens,  # prompt tokens the prefix cache saved
            "restored_tokens": s.restored_tokens,  # ... of which loaded back from host memory
            "host_cache_mib": round(s.host_cache_bytes / 2**20, 1),  # prompts kept there (runtime.cache_ram)
            "withdrawn_drafts": s.withdrawn,  # rounds the schedule ran plain though a draft was ready
            "joint_drafts": s.together,  # model drafts made in one batch with another sequence's
            "cost_curve": s.cost_curve,  # cached, measured, or provisional (disturbed: online estimates take over)
            "expires_in": round(s.expires_at - time.time(), 1) if s.expires_at is not None else None,
        })
        if s.host_share is not None:  # the step loop's own time, of its recent steps' (engine.hosttime)
            out[-1]["host_share"] = round(s.host_share, 3)
        if s.cost is not None:  # what the cost model believes: docs/design/scheduler.md
            out[-1]["cost"] = s.cost
    return out
