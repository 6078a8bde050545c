"""The bridge between the batcher thread and a request's consumer (runtime/llamacpp/worker.py)."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.runtime.llamacpp.worker import _Sink

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
