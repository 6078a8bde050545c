"""engine.together: when a step's sequences draft from their model together (pure arithmetic).

The prices are a CPU's, as the padded pair's at N = 2 measured in-process (engine.together): a
one-row step 45 ms, each row more 19 ms, a draft step 11 ms and a row beside it half that. Two
sequences on streams 0 and 1, each with a plain row; their drafts always hold."""

import pytest

from sidecar.engine.adaptive import expected_tokens
from sidecar.engine.drafters import Support
from sidecar.engine.rounds import Offer
from sidecar.engine.together import Member, choose, draft_seconds
from tests.prices import Fixed

pytestmark = pytest.mark.model

PLAIN_ROWS = {0: 1, 1: 1}
PLAIN_TOKENS = {0: 1.0, 1: 1.0}


def prices() -> Fixed:
    cost = Fixed(9)
    cost.t_step = [0.0] + [0.045 + 0.019 * (n - 1) for n in range(1, 10)]
    cost.t_draft, cost.t_catchup = 0.011, 0.003
    return cost


def member(sid: int, acceptance: float = 1.0, lag: int = 0, future: float = 128.0, asked: int = 0) -> Member:
    expected = [expected_tokens(acceptance, k) for k in range(9)]
    return Member(sid, Offer(0, Support(), expected, lag, future), asked)


def test_drafts_that_pay_only_together_are_made_together() -> None:
    """One sequence's draft beside the other's plain row does not pay at these prices (its draft
    steps are its own, and its rows are a pass of their own); both drafting, the draft steps carry
    a row of each and the rows go in one pass of equal widths."""
    cost = prices()
    alone = cost.batch(((0, 9), (1, 1))) + 8 * cost.t_draft
    assert 10 / alone < 1.05 * 2 / cost.batch(tuple(PLAIN_ROWS.items()))
    got = choose([member(0), member(1)], PLAIN_ROWS, PLAIN_TOKENS, cost, 0, 512, 1.05)
    assert got is not None
    k, extra = got
    together = cost.batch(((0, k + 1), (1, k + 1))) + k * cost.draft_step(2)
    assert 2 * (k + 1) / together > 1.05 * 2 / cost.batch(tuple(PLAIN_ROWS.items()))
    assert extra == (together - cost.batch(tuple(PLAIN_ROWS.items()))) / 2  # the draft steps and rows, shared


def test_drafts_that_rarely_hold_are_not_made_together() -> None:
    cost = prices()
    assert choose([member(0, 0.3), member(1, 0.3)], PLAIN_ROWS, PLAIN_TOKENS, cost, 0, 512, 1.05) is None


def test_a_probe_is_no_step_to_beat() -> None:
    """One member's own round probes the model (8 tokens it does not expect to pay): a joint round
    that only beats that step, not the members stepping plain, is not taken (the padded pair at
    N = 4 once caught three prompts up into the draft model, 2.8 s, against a step that held a
    probe)."""
    cost = prices()
    members = [member(0, 0.5, asked=8), member(1, 0.5, lag=400, future=96)]
    rows, tokens = {0: 9, 1: 1}, {0: expected_tokens(0.5, 8), 1: 1.0}
    assert choose(members, rows, tokens, cost, 0, 512, 1.05) is None


def test_a_catch_up_is_made_only_where_the_tokens_to_go_repay_it() -> None:
    """A 424-token prompt to prefill into the draft model (1.3 s) against what drafting together
    saves a step: worth it over a long answer, not over a few tokens."""
    cost = prices()
    long = [member(0, lag=424, future=512), member(1, future=512)]
    short = [member(0, lag=424, future=16), member(1, future=16)]
    assert choose(long, PLAIN_ROWS, PLAIN_TOKENS, cost, 0, 512, 1.05) is not None
    assert choose(short, PLAIN_ROWS, PLAIN_TOKENS, cost, 0, 512, 1.05) is None


def test_a_catch_up_counts_in_the_step_only_where_others_wait_for_it() -> None:
    """The members' catch-up is theirs to repay (judged above); a stream outside the group, here
    a plain row on stream 3, waits for it, so what the drafts add to the step (the fair check's
    price of them) carries it there, in equal shares."""
    cost = prices()
    lagging, caught_up = [member(0, lag=100, future=512), member(1, future=512)], [member(0), member(1)]
    inside = [choose(m, PLAIN_ROWS, PLAIN_TOKENS, cost, 0, 512, 1.0) for m in (lagging, caught_up)]
    assert inside[0] == inside[1] is not None
    rows, tokens = {**PLAIN_ROWS, 3: 1}, {**PLAIN_TOKENS, 3: 1.0}
    beside = [choose(m, rows, tokens, cost, 0, 512, 1.0) for m in (lagging, caught_up)]
    assert beside[0] is not None and beside[1] is not None and beside[0][0] == beside[1][0]
    assert abs(beside[0][1] - beside[1][1] - 100 * cost.t_catchup / 2) < 1e-12


def test_a_joint_draft_fits_n_batch() -> None:
    cost = prices()
    got = choose([member(0), member(1)], {**PLAIN_ROWS, 2: 500}, {**PLAIN_TOKENS}, cost, 0, 512, 1.0)
    assert got is None or 2 * (got[0] + 1) + 500 <= 512


def test_draft_steps_carry_every_draft_still_going() -> None:
    cost = prices()
    assert draft_seconds(cost, [3, 1]) == cost.draft_step(2) + 2 * cost.draft_step(1)
    assert draft_seconds(cost, [0, 0]) == 0.0
    cost.draft_beside = 0.5
    assert cost.draft_step(3) == cost.t_draft * 2.0


def test_a_row_beside_others_in_a_draft_step_is_learnt() -> None:
    """Drafts made together report even shares of the steps: what their company shows of a row's
    price beside others updates draft_beside, and leaves the lone step's price as it was."""
    from sidecar.engine.adaptive import CostModel

    cost = CostModel(9)
    cost.t_draft = 0.0117
    for _ in range(40):
        cost.observe_draft(8, 8 * 0.0179 / 2, company=2.0)  # two rows a step: 17.9 ms, half each
    assert cost.t_draft == 0.0117
    assert abs(cost.draft_beside - (0.0179 / 0.0117 - 1)) < 0.01


def test_a_model_beside_a_free_source_is_offered_once_its_share_shows() -> None:
    """A hybrid's request shows how much plain steps make (the model's share) only after 32
    tokens; before, a joint round could catch an edit's prompt up into the model while n-gram
    copies it, so its model is not offered. A model-only pair's is, from the first token."""
    from sidecar.engine.adaptive import SpeculativeConfig
    from sidecar.engine.planner import Plan
    from sidecar.engine.rounds import Source

    cost = prices()
    model = Source("model", has_cost=True, lag=lambda: 400)
    hybrid = Plan.start(SpeculativeConfig(), cost, [Source("ngram"), model], -1)
    alone = Plan.start(SpeculativeConfig(), cost, [model], -1)
    assert hybrid.offer(0, 128, 1000) is None
    assert hybrid.offer(32, 96, 1000) is not None
    offered = alone.offer(0, 128, 1000)
    assert offered is not None and offered.lag == 400 and offered.future == 128
    assert alone.offer(0, 1, 1000) is None  # no room for a draft
