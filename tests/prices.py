"""A cost model whose times stay where a test or bench puts them (engine.adaptive.CostModel).

The planner learns step, draft and catch-up times from the wall time of each round. On a busy
machine one slow step moves them far enough to change what it decides, so a test that asserts a
decision, or a bench that compares decisions, holds the times fixed. Acceptance is still learnt."""

from __future__ import annotations

from sidecar.engine.adaptive import CostModel


class Fixed(CostModel):
    """CostModel without the online time estimates: its t_step, t_draft and t_catchup stay as set."""

    def observe_step(self, n: int, seconds: float, same: bool = False, cells: int = 0) -> None:
        pass

    def observe_draft(self, n_tokens: int, seconds: float, company: float = 1.0) -> None:
        pass

    def observe_catchup(self, n_tokens: int, seconds: float) -> None:
        pass
