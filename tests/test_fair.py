"""engine.fair: which drafts a shared step takes back (pure arithmetic on the cost model's seconds).

The numbers are a CPU's: a plain step of four streams costs 1.0, a row adds 0.2 to it, so a
stream that ends early gives each other stream 0.2 a token of its lead."""

import pytest

from sidecar.engine.fair import Account, Bid, balance, settle, withdrawals

pytestmark = pytest.mark.pure

PLAIN = Bid(tokens=1.0, extra=0.0, tau=1.0, row=0.2)
SLACK = 0.03


def bids(*rounds: tuple[float, float]) -> dict[int, Bid]:
    return {i: Bid(tokens, extra, 1.0, 0.2) for i, (tokens, extra) in enumerate(rounds)}


def fresh(n: int) -> dict[int, Account]:
    return {i: Account() for i in range(n)}


def test_a_lone_draft_that_slows_three_plain_streams_is_taken_back() -> None:
    """The padded pair at N = 4: a model draft that makes 6 tokens for 1.5 steps more raises the
    step's tokens per second (9 / 2.5 > 4 / 1), but each plain stream waits 1.5 steps for a lead
    that gives it 5 x 0.2 = 1.0 back."""
    step = bids((6.0, 1.5), (1.0, 0.0), (1.0, 0.0), (1.0, 0.0))
    held, after = withdrawals(step, fresh(4), SLACK)
    assert held == [0]
    assert after == {**step, 0: Bid(1.0, 0.0, 1.0, 0.2)}  # the step as it runs: that round plain


def test_a_lone_draft_whose_lead_repays_the_wait_goes_on() -> None:
    """A long copy: 20 tokens for 3 steps more; each other stream gets 19 x 0.2 = 3.8 back."""
    step = bids((20.0, 3.0), (1.0, 0.0), (1.0, 0.0), (1.0, 0.0))
    assert withdrawals(step, fresh(4), SLACK)[0] == []


def test_streams_that_all_draft_pay_each_other_with_their_own_tokens() -> None:
    """Every stream copies: each waits for the others' rows but makes five tokens itself."""
    step = bids(*[(5.0, 1.0)] * 4)
    assert withdrawals(step, fresh(4), SLACK)[0] == []
    assert all(balance(s, step, Account()) > 0 for s in step)


def test_a_stream_ahead_from_its_own_drafts_can_afford_the_others() -> None:
    step = bids((6.0, 1.5), (1.0, 0.0))
    accounts = fresh(2)
    assert withdrawals(step, accounts, SLACK)[0] == [0]
    accounts[1].ahead = 2.0  # it copied earlier: it is two plain steps ahead
    assert withdrawals(step, accounts, SLACK)[0] == []


def test_the_slack_is_a_share_of_the_plain_time_so_far() -> None:
    """3% of 100 plain steps is 3 steps: a wait of 1.5 less a lead of 1.0 fits, once."""
    step = bids((6.0, 1.5), (1.0, 0.0))
    accounts = {0: Account(), 1: Account(plain=100.0)}
    assert withdrawals(step, accounts, SLACK)[0] == []
    accounts[1].ahead = -2.6
    assert withdrawals(step, accounts, SLACK)[0] == [0]


def test_the_draft_that_costs_the_others_most_goes_first() -> None:
    """Two lone drafts that stream 2 cannot afford together; taking back the costlier is enough."""
    step = bids((3.0, 0.5), (2.0, 1.0), (1.0, 0.0))
    accounts = fresh(3)
    accounts[1].ahead = accounts[2].ahead = 0.5
    assert withdrawals(step, accounts, SLACK)[0] == [1]


def test_a_stream_short_by_its_own_losses_does_not_stop_its_own_draft() -> None:
    """Its own rejected drafts are its planner's to judge: they never count against the others,
    and a stream behind for them alone keeps its own draft."""
    step = bids((3.0, 0.5), (1.0, 0.0))
    accounts = fresh(2)
    accounts[0].ahead, accounts[1].ahead = -5.0, 1.0
    assert withdrawals(step, accounts, SLACK)[0] == []
    made = bids((1.0, 0.5), (1.0, 0.0))  # the draft was rejected: one token for 0.5 more
    settle(made, accounts)
    assert accounts[0].ahead == -5.0 and accounts[0].plain == 1.0
    assert accounts[1].ahead == 0.5  # the other stream waited for it


def test_a_stream_that_ended_gives_no_negative_lead() -> None:
    """One that stopped at its first row made no token; the others are not charged for that."""
    accounts = fresh(2)
    settle({0: Bid(0.0, 0.0, 1.0, 0.2), 1: PLAIN}, accounts)
    assert accounts[1].ahead == 0.0


def test_streams_behind_are_not_held_there_by_each_others_drafts() -> None:
    """Two streams seven plain steps behind (their prompts waited for copies beside them), and all
    four streams copying, five tokens each for 1.7 plain steps more: the step brings both nearer
    (each makes four tokens more and loses less than that to the others' rows), so it runs. Taking
    every draft back, as the check once did (each draft costs the other short stream a little),
    left both where they were, and every later step the same."""
    accounts = {i: Account(plain=100.0) for i in range(4)}
    accounts[2].ahead = accounts[3].ahead = -7.0
    step = bids(*[(6.0, 1.7)] * 4)
    assert withdrawals(step, accounts, SLACK)[0] == []
    assert all(balance(s, step, accounts[s]) > accounts[s].ahead for s in (2, 3))


def test_a_stream_behind_still_refuses_drafts_that_set_it_further_back() -> None:
    """Behind, and unable to draft itself: a copy whose lead does not repay its wait is taken back
    as for any stream past the slack."""
    accounts = {i: Account(plain=100.0) for i in range(2)}
    accounts[1].ahead = -7.0
    step = bids((6.0, 1.5), (1.0, 0.0))
    assert withdrawals(step, accounts, SLACK)[0] == [0]


def test_a_stream_with_a_copy_of_its_own_ready_does_not_hold_the_others_back() -> None:
    """A daemon's step at N = 4 on SmolLM2 (n-gram, the suffix cache's second repetition), from
    its log: three streams copy, the fourth has a copy of 49 tokens ready but the others' rows
    priced it out of this step. Its rows merge the others' passes, so no copy gives it a lead.
    Held for it, the copies were all taken back; the next step it and its neighbour decided
    first and copied, the other two were priced out and held for in turn, and so on for the rest
    of the requests (drafts 34-37 tokens a request, against 110-124 in a run that kept in phase).
    Its own copy brings it back in the next step, where it decides first (engine.step), so the
    step runs."""
    accounts = {
        0: Account(plain=1.372, ahead=-0.0373),
        1: Account(plain=1.372, ahead=-0.0373),
        2: Account(plain=1.346, ahead=0.4257),
        3: Account(plain=1.346, ahead=-0.0373),
    }
    step = {
        0: Bid(49.0, 0.2715, 0.0291, -0.0007),
        1: Bid(48.99, 0.1031, 0.0291, -0.0096),
        2: Bid(17.0, 0.0375, 0.0291, -0.0096),
        3: Bid(1.0, 0.0, 0.0291, -0.0007),
    }
    assert withdrawals(step, accounts, SLACK)[0] == [0, 1, 2]  # no copy of its own ready: held for
    step[3] = Bid(1.0, 0.0, 0.0291, -0.0007, could=48.99)
    assert withdrawals(step, accounts, SLACK)[0] == []
