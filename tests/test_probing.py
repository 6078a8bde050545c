"""A costly source's probes and verdicts (engine.probing), on fixed prices: pure arithmetic, no model."""

from __future__ import annotations

import pytest

from sidecar.engine.adaptive import ALONE, SpeculativeConfig, Step
from sidecar.engine.probing import Probing
from tests.prices import Fixed

pytestmark = pytest.mark.model


def cost(step: float = 0.01, catchup: float = 0.001) -> Fixed:
    c = Fixed(16)
    c.t_step = [0.0, *(step * (1 + 0.5 * (n - 1)) for n in range(1, 17))]
    c.t_draft, c.t_catchup = step / 4, catchup
    return c


def test_a_source_never_probed_is_probed_at_once_then_waits_out_its_back_off_and_budget() -> None:
    c, config = cost(), SpeculativeConfig()
    p = Probing(backoff=4)
    p.wait(c, ALONE)
    assert p.due(c, config, "model", 8, lambda: 100, beside=False)  # no evidence at all: explore
    assert (p.idle, p.backoff, c.unprobed, c.explored) == (0, 8, 0.0, {"model"})
    for _ in range(7):
        p.wait(c, ALONE)
    assert not p.due(c, config, "model", 8, lambda: 100, beside=False)  # 7 plain steps < the back-off of 8
    p.wait(c, ALONE)
    # The back-off is out, but 8 plain steps' 3% budget buys far less than a probe's rows and catch-up.
    assert not p.due(c, config, "model", 8, lambda: 100, beside=False)
    for _ in range(2000):
        p.wait(c, ALONE)
    assert p.due(c, config, "model", 8, lambda: 100, beside=False)
    assert p.backoff == 16


def test_beside_a_free_source_the_first_probe_waits_for_plain_steps_worth_its_catch_up() -> None:
    """So an edit the n-gram source covers never prefills its prompt into the model."""
    c, config = cost(step=0.01, catchup=0.001), SpeculativeConfig()
    p = Probing(backoff=1000)
    for _ in range(9):
        p.wait(c, ALONE)
    assert not p.due(c, config, "model", 8, lambda: 95, beside=True)  # 9 steps (0.09 s) < 95 tokens' 0.095 s
    p.wait(c, ALONE)
    assert p.due(c, config, "model", 8, lambda: 95, beside=True)


def test_a_shared_step_counts_its_share_of_the_probe_budget() -> None:
    c, p = cost(), Probing()
    p.wait(c, Step(rows=((1, 1), (2, 1), (3, 1)), seq=0))
    assert p.idle == 1 and c.unprobed == 0.25


def test_a_probe_with_nothing_to_offer_comes_again_and_evidence_resets_the_count() -> None:
    c, p = cost(), Probing(backoff=8, idle=3)
    p.unanswered()
    assert (p.idle, p.backoff) == (8, 4)
    c.unprobed = 5.0
    p.answered(c)
    assert (p.idle, c.unprobed) == (0, 0.0)


def test_a_source_behind_plain_decoding_is_switched_off_for_a_doubling_back_off() -> None:
    config = SpeculativeConfig(fallback_rounds=4)
    p = Probing(backoff=32)
    # Four rounds of 2 tokens in 0.05 s where plain steps take 0.02 s: 40 against 100 tok/s.
    verdicts = [p.judge(config, 2, 0.05, 0.02, produced=10 * r) for r in range(1, 5)]
    assert verdicts[:3] == [None, None, None] and verdicts[3] == pytest.approx((40.0, 100.0))
    assert (p.off_until, p.backoff) == (40 + 32, 64)
    assert p.off(71) and not p.off(72)
    # Rounds that pay keep it on; the evidence starts anew after each verdict.
    assert [p.judge(config, 3, 0.02, 0.03, produced=100) for _ in range(4)] == [None] * 4
    assert (p.rounds, p.off_until) == (0, 72)
