"""The upstream Ollama as the runtime's room-making sees it (runtime.room.Neighbour).

When a pair's load needs room, the runtime asks for the upstream's idle models and has them
unloaded. Ollama's /api/ps has no busy flag, so the requests the daemon forwards are counted
(api.proxy, Upstream.forwarding): a model with one running through the daemon is busy.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

from sidecar.api.pairs import RUNTIME
from sidecar.api.proxy import LIST_TIMEOUT, UPSTREAM, VIA, Upstream, tagged
from sidecar.runtime.room import Resident, pinned

log = logging.getLogger("sidecar.api")

UNLOAD_WAIT = 10.0  # seconds to wait for the upstream to drop a model it was asked to unload


class Neighbour:
    """The upstream Ollama as the runtime's room-making sees it (runtime.room.Neighbour): its idle
    models from /api/ps, and unloading one with `keep_alive: 0`, as `ollama stop` does.

    Ollama's /api/ps says nothing of requests in flight, so the requests this daemon forwards are
    counted per model (Upstream.forwarding): one with a request running through the daemon is kept."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    async def idle_models(self) -> list[Resident]:
        """Loaded upstream models with no request running through the daemon and not pinned
        (negative keep_alive), soonest expiry (least recently used) first."""
        up = self.upstream
        if await up.flavour() != "ollama":
            return []
        out: list[tuple[str, Resident]] = []
        for m in await self._ps():
            name = str(m.get("model") or m.get("name") or "")
            expires = str(m.get("expires_at") or "")
            if not name or up.running.get(tagged(name)) or pinned(expires):
                if name:
                    log.info("upstream model %s is %s: not unloading it", name,
                             "serving a request" if up.running.get(tagged(name)) else "kept forever")
                continue
            out.append((expires, Resident(name, _int(m.get("size")), _int(m.get("size_vram")))))
        return [r for _, r in sorted(out, key=lambda x: x[0])]

    async def unload(self, name: str) -> None:
        """Ask for the unload, then wait (up to UNLOAD_WAIT) until /api/ps no longer lists the
        model: Ollama answers at once and stops the runner after, and the load that follows
        measures the GPUs' free memory."""
        up = self.upstream
        try:
            async with up.session().post(up.url + "/api/generate", json={"model": name, "keep_alive": 0},
                                         headers={VIA: up.ident}) as r:
                await r.read()
                if r.status != 200:
                    log.warning("upstream %s would not unload %s: HTTP %d", up.url, name, r.status)
                    return
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            log.warning("upstream %s could not be asked to unload %s: %s", up.url, name, e)
            return
        deadline = asyncio.get_running_loop().time() + UNLOAD_WAIT
        while asyncio.get_running_loop().time() < deadline:
            if tagged(name) not in {tagged(n) for n in await self._listed()}:
                return
            await asyncio.sleep(0.25)
        log.warning("upstream %s still lists %s %.0fs after unloading it", up.url, name, UNLOAD_WAIT)

    async def _listed(self) -> list[str]:
        return [str(m.get("model") or m.get("name") or "") for m in await self._ps()]

    async def _ps(self) -> list[dict[str, Any]]:
        """The models /api/ps lists now; [] (logged) when it cannot be read."""
        up = self.upstream
        try:
            timeout = aiohttp.ClientTimeout(total=LIST_TIMEOUT, connect=up.connect_timeout)
            async with up.session().get(up.url + "/api/ps", timeout=timeout, headers={VIA: up.ident}) as r:
                listing = json.loads(await r.read()) if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            log.warning("upstream %s/api/ps: %s", up.url, e)
            return []
        models = listing.get("models") if isinstance(listing, dict) else None
        return [m for m in models if isinstance(m, dict)] if isinstance(models, list) else []


def _int(v: Any) -> int:
    return v if isinstance(v, int) and v >= 0 else 0


def setup(app: web.Application) -> None:
    """Let the runtime make room on the upstream, where there is one."""
    upstream = app.get(UPSTREAM)
    if upstream is not None:
        app[RUNTIME].neighbour = Neighbour(upstream)
