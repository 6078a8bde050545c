"""The llama.cpp engine behind the runtime's `Engine` seam (runtime.contract).

Everything that knows llama.cpp lives in this package: the weights mapped once and shared
(registry), a target's context, its step loop and the thread that owns them (loading, worker),
and the measured cost curves kept between loads (curves). The runtime sees a
`Model` and a stream of text pieces, logprobs and an `Outcome`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from sidecar.config.entries import PairEntry
from sidecar.engine.decoder import Logprobs, Request, Result
from sidecar.engine.sequence import Sequence
from sidecar.engine.window import truncate_prompt
from sidecar.runtime.contract import Generation, Logprob, Model, Outcome, Piece, TokenLogprob
from sidecar.runtime.llamacpp.caches import SuffixCaches
from sidecar.runtime.llamacpp.curves import CurveCache
from sidecar.runtime.llamacpp.loading import Loaded, free_engine, load_pair, load_target, unload
from sidecar.runtime.llamacpp.registry import WeightsRegistry


class LlamaEngine:
    """The daemon's llama.cpp engine: what outlives any one model (the mapped weights, the suffix
    caches, the cost-curve cache) and the operations on the models it loads."""

    def __init__(self, curves: CurveCache | None = None) -> None:
        self.weights = WeightsRegistry()
        self.caches = SuffixCaches()
        self.curves = curves or CurveCache()

    def load_key(self, entry: PairEntry, parallel: int) -> str:
        rt = entry.config.runtime
        return (f"{entry.target.path.resolve()}|gpu={rt.num_gpu}|b={rt.num_batch}"
                f"|fa={rt.flash}|kv={rt.kv_cache_type}|np={parallel}")

    async def load(self, entry: PairEntry, n_ctx: int, parallel: int, num_gpu: int = -1) -> Loaded:
        return await asyncio.to_thread(load_target, self.weights, entry, n_ctx, parallel, num_gpu)

    async def add_pair(self, model: Model, entry: PairEntry) -> None:
        lm = _own(model)
        pe = await load_pair(self.weights, entry, lm, self.caches, self.curves)
        old = lm.pairs.get(entry.name)
        lm.pairs[entry.name] = pe
        if old is not None and old is not pe:
            free_engine(self.weights, lm, old)

    def rebind_pair(self, model: Model, entry: PairEntry) -> None:
        _own(model).pairs[entry.name].entry = entry

    def drop_pair(self, model: Model, name: str) -> None:
        lm = _own(model)
        pe = lm.pairs.pop(name, None)
        if pe is not None:
            free_engine(self.weights, lm, pe)

    def unload(self, model: Model) -> None:
        unload(self.weights, _own(model))

    async def join(self, model: Model, timeout: float) -> None:
        await asyncio.to_thread(_own(model).batcher.join, timeout)

    async def close(self) -> None:
        await asyncio.to_thread(self.caches.save)

    def status(self) -> dict[str, Any]:
        return {"loaded_weights": self.weights.count, "weights": self.weights.snapshot()}

    async def generate(self, model: Model, pair: str, gen: Generation, stop: Callable[[], bool]
                       ) -> AsyncIterator[Piece]:
        lm = _own(model)
        pe = lm.pairs[pair]
        opts = gen.options
        req = Request(
            gen.tokens, opts.sampling, gen.num_predict, opts.stop, speculate=opts.draft_num_predict != 0,
            n_max=opts.draft_num_predict or None, grammar=gen.grammar, logprobs=gen.logprobs,
            truncate=gen.truncate, num_keep=opts.num_keep, shift=gen.shift, grammar_after=gen.grammar_after,
            preserve=frozenset(lm.weights.special_ids(gen.preserve)), lookup=gen.whole,
        )

        def make(sid: int, cancelled: Callable[[], bool]) -> Sequence:
            def halted() -> bool:  # the consumer went away, or the runtime says stop
                return cancelled() or stop()

            ctx = lm.ctx
            return Sequence(lm.weights, ctx.n_ctx, ctx.n_batch, req, pe.drafters[sid], pe.config, pe.cost, halted,
                            pe.evidence)

        # Close the inner stream explicitly: an abandoned async generator is only finalised by the
        # garbage collector, and until then its sequence keeps its place in the batch.
        # Placed by the prompt the sequence will run on: a prompt cut to fit the window shares its
        # cut with the stream that ran it before, not the uncut one's (engine.step, the prefix cache).
        fitted = _fitted(req, lm) if req.truncate else req.prompt
        items = lm.batcher.stream(fitted, make, interactive=gen.interactive)
        try:
            async for item in items:
                if isinstance(item, Result):
                    yield _outcome(item, _used_prompt(req, item, lm) + item.tokens)
                elif isinstance(item, Logprobs):
                    yield _logprobs(item)
                else:
                    yield item
        finally:
            await items.aclose()


def _own(model: Model) -> Loaded:
    if not isinstance(model, Loaded):
        raise TypeError(f"not a llama.cpp model: {model!r}")
    return model


def _used_prompt(req: Request, result: Result, lm: Loaded) -> list[int]:
    """The prompt the engine ran on: the request's, or the same cut it made to fit the window."""
    return _fitted(req, lm) if result.prompt_truncated else req.prompt


def _fitted(req: Request, lm: Loaded) -> list[int]:
    """The request's prompt as the sequence cuts it to fit the window (Sequence._prompt)."""
    if len(req.prompt) < lm.n_ctx:
        return req.prompt
    return truncate_prompt(req.prompt, lm.n_ctx, req.num_keep, lm.weights.vocab_info().add_bos)


def _outcome(r: Result, context: list[int]) -> Outcome:
    return Outcome(
        done_reason=r.done_reason, tokens=r.tokens, prompt_tokens=r.prompt_tokens - r.prompt_cached,
        prompt_cached=r.prompt_cached, prompt_seconds=r.prompt_seconds,
        eval_seconds=r.eval_seconds, draft_tokens=r.draft_tokens, draft_accepted_tokens=r.draft_accepted_tokens,
        draft_rounds=r.draft_rounds, accepted_per_pos=r.accepted_per_pos, drafts_by_source=r.drafts_by_source,
        fallback=r.fallback, drafter=r.drafter, prompt_truncated=r.prompt_truncated, shifts=r.shifts,
        withdrawn=r.withdrawn, saved_seconds=r.saved_seconds, context=context,
    )


def _logprobs(item: Logprobs) -> tuple[Logprob, ...]:
    return tuple(Logprob(TokenLogprob(e.token, e.logprob, e.bytes),
                         tuple(TokenLogprob(a.token, a.logprob, a.bytes) for a in e.top)) for e in item.entries)
