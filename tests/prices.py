"""A cost model whose prices stay where a test or bench puts them (engine.cost.CostModel).

The cost model refits its prices to the wall time of every decode. On a busy machine one slow step
moves them far enough to change what the schedule decides, so a test that asserts a decision, or a
bench that compares decisions, holds them at the calibration it sets. Acceptance is still learnt."""

from __future__ import annotations

from sidecar.engine.cost import CostModel


class Fixed(CostModel):
    """CostModel whose fits stay at the prices seeded from its t_step, t_draft and t_catchup."""

    def __init__(self, n_rows: int) -> None:
        super().__init__(n_rows)
        self.fixed = True
