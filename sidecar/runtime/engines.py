"""Several engines behind the one `Engine` the runtime talks to.

Each pair names its engine in pairs.yaml (`engine: llama.cpp`, the default, or `engine: vllm`).
`Engines` sends a pair's load to that engine and every later call about the model to the engine
that loaded it, so the runtime (admission, keep_alive, reloads, rendering) stays one code path
whichever engine runs the tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from sidecar.config.entries import PairEntry
from sidecar.runtime.contract import Engine, Generation, Model, Piece


class Engines:
    def __init__(self, engines: dict[str, Engine]) -> None:
        self.engines = engines
        self._owner: dict[int, Engine] = {}  # id(model) -> the engine that loaded it

    def _for(self, entry: PairEntry) -> Engine:
        try:
            return self.engines[entry.config.engine]
        except KeyError:
            raise ValueError(f"{entry.name}: engine {entry.config.engine!r} is not available here") from None

    def _of(self, model: Model) -> Engine:
        return self._owner[id(model)]

    def load_key(self, entry: PairEntry, parallel: int) -> str:
        return f"{entry.config.engine}:{self._for(entry).load_key(entry, parallel)}"

    async def load(self, entry: PairEntry, n_ctx: int, parallel: int, num_gpu: int = -1) -> Model:
        engine = self._for(entry)
        model = await engine.load(entry, n_ctx, parallel, num_gpu)
        self._owner[id(model)] = engine
        return model

    async def add_pair(self, model: Model, entry: PairEntry) -> None:
        await self._of(model).add_pair(model, entry)

    def rebind_pair(self, model: Model, entry: PairEntry) -> None:
        self._of(model).rebind_pair(model, entry)

    def drop_pair(self, model: Model, name: str) -> None:
        self._of(model).drop_pair(model, name)

    def unload(self, model: Model) -> None:
        self._of(model).unload(model)

    async def join(self, model: Model, timeout: float) -> None:
        try:
            await self._of(model).join(model, timeout)
        finally:
            self._owner.pop(id(model), None)

    async def close(self) -> None:
        for engine in self.engines.values():
            await engine.close()

    def generate(self, model: Model, pair: str, gen: Generation, stop: Callable[[], bool]) -> AsyncIterator[Piece]:
        return self._of(model).generate(model, pair, gen, stop)

    def status(self) -> dict[str, Any]:
        """The llama.cpp engine's facts at the top (as before there was a second engine), the others by name."""
        out: dict[str, Any] = {}
        for name, engine in self.engines.items():
            if name == "llama.cpp":
                out.update(engine.status())
            else:
                out[name] = engine.status()
        return out
