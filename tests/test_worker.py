"""The bridge between the batcher thread and a request's consumer (runtime/llamacpp/worker.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.cost import CostModel
from sidecar.engine.drafters import NgramDrafter
from sidecar.engine.hybrid import HybridDrafter
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.sequence import Request, Result, Sequence
from sidecar.engine.step import StepLoop
from sidecar.runtime.llamacpp.worker import Batcher, _Sink
from tests.test_batch import request, solo

pytestmark = pytest.mark.model


async def test_a_long_round_does_not_make_its_sequence_sit_out() -> None:
    """A sequence sits out the steps while its client has `maxsize` items unread from before its
    last step. A round that accepted a long draft puts more than that at once; counted as a
    backlog, it made the sequence sit out the next step, and a prompt waiting beside it went in
    whole in that step (seconds on a CPU, a stall of the stream)."""
    woken: list[int] = []
    sink = _Sink(asyncio.get_running_loop(), 16, lambda: woken.append(1))
    sink.put_step([f"t{i}" for i in range(40)])  # one round: 40 tokens
    assert not sink.full
    sink.put_step(["t40"])  # the client read none of it, and another step went by
    assert sink.full
    for _ in range(24):  # the client reads; 16 of the round's items are still unread
        await sink.get()
    assert sink.full
    woken.clear()
    await sink.get()
    assert not sink.full and woken  # 15: the batcher is woken to step the sequence again


async def test_an_overlapping_loop_streams_each_request_as_it_runs_alone(
        smollm2_engines: tuple[Weights, Context, Context]) -> None:
    """The batcher hands a step's output to the requests while the next decode runs, where the
    step loop overlaps (a GPU's): two requests streamed at once each get their solo output, text
    and Result, and the thread stops cleanly."""
    weights = smollm2_engines[0]
    ctx = Context(weights, ContextParams(n_ctx=1024, n_batch=512, n_seq=2))
    batcher = Batcher("overlap", StepLoop(ctx, overlap=True))
    reqs = [request(weights, 1, n=32, stop=["cherries"]), request(weights, 2, n=32)]
    want = [solo(weights, r) for r in reqs]

    async def one(req: Request) -> list[object]:
        def make(sid: int, cancelled: Callable[[], bool]) -> Sequence:
            return Sequence(weights, ctx.n_ctx, ctx.n_batch, req, HybridDrafter([NgramDrafter()]),
                            SpeculativeConfig(), CostModel(9), cancelled)
        return [item async for item in batcher.stream(req.prompt, make)]

    try:
        got = await asyncio.gather(*(one(r) for r in reqs))
        for items, w in zip(got, want, strict=True):
            result = items[-1]
            assert isinstance(result, Result) and result.tokens == w.tokens
            assert "".join(i for i in items if isinstance(i, str)) == w.text
    finally:
        batcher.stop()
        await asyncio.to_thread(batcher.join, 30)
        ctx.close()
