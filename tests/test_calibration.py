"""Calibration on real decodes: the tiny model's verify curve and its draft's prices (engine.timing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.engine.cost import CostModel
from sidecar.engine.llama import Context, ContextParams, Weights

pytestmark = pytest.mark.model


def test_calibrate_draft_measures_step_and_catchup(tiny: Path) -> None:
    w = Weights(tiny, n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=256, n_threads=1))
    try:
        model = CostModel(2)
        # Without a budget it measures for real, whatever the machine's load.
        assert model.calibrate_draft(ctx)
        # Prefilling is batched, so on a quiet machine a token of catch-up costs less than a
        # one-token step; not asserted: on the busy CI machine a 6 ms prefill was preempted in
        # all three repetitions and the 60 us steps were not (catch-up 1.6 steps a token).
        assert model.t_catchup > 0.0 and model.t_draft > 0.0
        assert not model.provisional
        assert len(ctx) == 0
    finally:
        ctx.close()
        w.close()


def test_calibration_fits_a_small_context(tiny: Path) -> None:
    w = Weights(tiny, n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=24, n_threads=1))
    try:
        model = CostModel(9)
        model.calibrate(ctx)  # 9 rows and three steps after them leave room for a 12-token prefix
        model.calibrate_draft(ctx)
        assert all(t > 0 for t in model.t_step[1:]) and model.t_draft > 0 and model.t_catchup > 0
        assert len(ctx) == 0
    finally:
        ctx.close()
        w.close()


