"""What the planner decides and is told, as plain values (engine.planner).

A `Round` is one round's decision, a `Source` a drafter as the planner sees it, a `Key` what its
acceptance evidence is kept under, and an `Offer` what a round would give drafting from the model
with other sequences (engine.together). The step loop, the sequences and the hybrid drafter pass
them around without the planner's state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from sidecar.engine.drafters import Support


class Key(NamedTuple):
    """What acceptance evidence is kept under: a source's name and its class (drafters.Support.cls)."""

    source: str
    cls: int


@dataclass
class Source:
    """A drafter as the planner sees it (one per source of a hybrid.HybridDrafter).

    `support` gives the class of its next draft, `lag` the tokens a costly source must prefill
    before drafting (both from `propose(context, 0)`, which drafts nothing)."""

    name: str = "draft"
    has_cost: bool = False
    support: Callable[[], Support] = Support
    lag: Callable[[], int] = lambda: 0


@dataclass(frozen=True)
class Round:
    """One round's decision: draft `k` tokens from source `source` and decode `rows` rows (the
    pending token and the draft, padded to keep a stretch's shape); k = 0 is a plain step. `support`
    is the class the draft was priced by; `probe` marks a probe of a costly source that does not
    pay, `retry` a retry (Plan._retry); `seconds`, what the draft adds to the step beyond a plain
    row, catch-up included (engine.fair; 0 for a probe: its own budget prices it)."""

    source: int = 0
    k: int = 0
    rows: int = 1
    support: Support = field(default_factory=Support)
    probe: bool = False
    retry: bool = False
    seconds: float = 0.0


PLAIN = Round()


@dataclass(frozen=True)
class Offer:
    """What a sequence's round would give drafting from its model (planner.Plan.offer): the
    source and class, the expected tokens of k = 0..k_cap drafted tokens, the tokens its draft
    model must catch up first, and the tokens a catch-up is repaid over (at most `horizon` to go,
    times the share plain steps made, as Plan.decide weighs one sequence's catch-up)."""

    source: int
    support: Support
    expected: list[float]
    lag: int
    future: float
