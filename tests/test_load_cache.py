"""Loads as fast as Ollama's: the verify cost curve is measured once per machine and read back,
and a first load measures within a fixed budget, however busy the machine is."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.config.entries import build_entry
from sidecar.config.schema import Pair
from sidecar.engine.adaptive import NGRAM_N_MAX
from sidecar.engine.cost import CostModel
from sidecar.runtime.contract import Job, Outcome, Prompt
from sidecar.runtime.llamacpp import LlamaEngine, loading
from sidecar.runtime.llamacpp.curves import CurveCache
from sidecar.runtime.manager import Runtime
from tests.conftest import SMOLLM2_REF

pytestmark = pytest.mark.model


def pair(name: str, **fields: Any) -> Any:
    spec = {"from": SMOLLM2_REF, "draft": "ngram", "runtime": {"num_gpu": 0}, "parameters": {"num_ctx": 512},
            **fields}
    return build_entry(name, Pair.model_validate(spec))


def runtime(cache: Path) -> Runtime:
    return Runtime(LlamaEngine(CurveCache(cache)), keep_alive=-1)


async def text_of(rt: Runtime, entry: Any, opts: dict[str, Any]) -> str:
    job = Job(Prompt.of_completion("Repeat: one two three four five six seven eight nine ten.", raw=True),
              {"temperature": 0, "num_predict": 32, **opts})
    parts = [ev.content async for ev in rt.generate(entry, job) if not isinstance(ev, Outcome)]
    return "".join(parts)


async def test_a_second_load_reads_the_curve_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = CostModel.calibrate

    def counted(self: CostModel, ctx: Any, reps: int = 3, budget: float | None = None) -> None:
        calls.append(len(self.t_step))
        real(self, ctx, reps, budget)
        self.set_provisional(False)  # whatever the machine is doing, treat this one as a clean measurement

    monkeypatch.setattr(CostModel, "calibrate", counted)
    entry = pair("cached:a")
    rt = runtime(tmp_path / "curves")
    rt.set_entries({entry.name: entry})
    lm, _ = await rt.load(entry)
    assert calls == [NGRAM_N_MAX + 2] and lm.curve == "measured"  # n-gram pair: rows 1..n_max + 1
    curve = lm.calibrated.t_step
    await rt.unload_all()

    rt = runtime(tmp_path / "curves")  # a restart: a new runtime, the same cache directory
    rt.set_entries({entry.name: entry})
    lm, _ = await rt.load(entry)
    assert calls == [NGRAM_N_MAX + 2]  # no calibration ran
    assert lm.curve == "cached" and lm.calibrated.t_step == curve
    await rt.unload_all()


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


@pytest.fixture
def busy() -> Iterator[None]:
    """Every core kept busy by other processes for the test's duration."""
    stop = multiprocessing.Event()
    procs = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
             for _ in range(2 * (os.cpu_count() or 1))]
    for p in procs:
        p.start()
    yield
    stop.set()
    for p in procs:
        p.join(5)


async def test_a_load_on_a_busy_machine_keeps_its_budget(tmp_path: Path, busy: None) -> None:
    entry = pair("busy:a", runtime={"num_gpu": 0, "num_thread": 2})
    rt = runtime(tmp_path / "curves")
    rt.set_entries({entry.name: entry})
    lm, _ = await rt.load(entry)
    # The budget bounds the measuring, not the machine: one decode may overrun it.
    assert lm.calibrated.calibration_seconds < loading.CURVE_BUDGET + 2.0
    assert lm.curve == "provisional" and lm.calibrated.provisional
    assert not list((tmp_path / "curves").glob("*.json"))  # a disturbed curve is not kept
    assert lm.pairs["busy:a"].cost.provisional  # the online estimates take over
    plain = await text_of(rt, entry, {"draft_num_predict": 0})
    assert await text_of(rt, entry, {}) == plain  # and speculation is still lossless
    await rt.unload_all()


async def test_a_model_drafts_price_is_measured_at_load(tmp_path: Path) -> None:
    """The draft's step and catch-up are timed when the pair loads, before its first request: a
    planner that started from zero took the model's draft for free and prefilled a whole prompt
    into it on the first round (the draft context, empty, once read as false). They seed the
    draft's fitted price (CostModel.seed), so the first schedule already charges for them."""
    entry = pair("drafted:a", draft=SMOLLM2_REF)
    rt = runtime(tmp_path / "curves")
    rt.set_entries({entry.name: entry})
    lm, _ = await rt.load(entry)
    cost = lm.pairs[entry.name].cost  # type: ignore[attr-defined]
    assert cost.t_draft > 0 and cost.t_catchup > 0 and cost.seeded
    assert cost.draft_seconds(1, 1) > 0
    assert cost.draft_seconds(1, 1, catchup=100) > cost.draft_seconds(1, 1)
    await rt.unload_all()
