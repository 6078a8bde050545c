"""The verifiers are lossless: whatever the draft, emitted tokens follow the target's distribution p.

Each verifier is fed known distributions (pure numpy, fixed seeds) and the empirical distribution
of what it emits is compared with p by a chi-square goodness-of-fit test. A verifier that leaks the
draft distribution into its output fails these tests by a wide margin (see the soft-q trap below,
which also shows the test has the power to notice).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
from numpy.typing import NDArray

from sidecar.engine.verify import DistFn, verify_greedy, verify_greedy_rows, verify_rejection, verify_sample_and_match
from tests.stats import chi2_sf

pytestmark = pytest.mark.pure

Dist = NDArray[np.float64]
ALPHA = 1e-3  # a correct verifier fails a single check with this probability (fixed seeds: never)


# -- chi-square goodness of fit (the survival function lives in tests/stats.py) --------------------


def gof_pvalue(counts: NDArray[np.int64], probs: Dist) -> float:
    """Chi-square goodness-of-fit p-value of counts against probs.

    A count on a zero-probability cell is an outright failure (p-value 0). Cells expected to hold
    fewer than 5 observations are pooled."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if np.any(counts[probs == 0.0] > 0):
        return 0.0
    keep = probs > 0.0
    obs, exp = counts[keep], counts.sum() * probs[keep]
    small = exp < 5.0
    if small.any():
        big_o, big_e = list(obs[~small]), list(exp[~small])
        pooled_o, pooled_e = float(obs[small].sum()), float(exp[small].sum())
        if pooled_e < 5.0 and big_e:
            j = int(np.argmin(big_e))
            big_o[j] += pooled_o
            big_e[j] += pooled_e
        else:
            big_o.append(pooled_o)
            big_e.append(pooled_e)
        obs, exp = np.array(big_o), np.array(big_e)
    if len(obs) < 2:
        return 1.0
    stat = float(np.sum((obs - exp) ** 2 / exp))
    return chi2_sf(stat, len(obs) - 1)


def assert_follows(counts: NDArray[np.int64], probs: Dist) -> None:
    pv = gof_pvalue(counts, probs)
    freq = np.round(counts / counts.sum(), 4)
    assert pv > ALPHA, f"emitted {freq.tolist()} does not follow p={np.round(probs, 4).tolist()} (p={pv:.2e})"


def test_chi2_sf_matches_tables() -> None:
    """The hand-rolled survival function agrees with standard table values."""
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-6)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-6)
    assert chi2_sf(0.5, 30) == pytest.approx(1.0, abs=1e-12)
    for x in (0.1, 1.0, 7.0, 40.0):  # df = 2 is exactly exp(-x/2)
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)


def test_gof_rejects_a_wrong_distribution() -> None:
    """The goodness-of-fit check has the power to see a 0.5 vs 0.55 difference at these counts."""
    rng = np.random.default_rng(0)
    counts = np.bincount(rng.choice(2, size=6000, p=[0.55, 0.45]), minlength=2)
    assert gof_pvalue(counts, np.array([0.5, 0.5])) < ALPHA
    assert gof_pvalue(counts, np.array([0.55, 0.45])) > ALPHA
    assert gof_pvalue(np.array([10, 1]), np.array([1.0, 0.0])) == 0.0  # mass where p has none


# -- known distributions --------------------------------------------------------------------------


def _dist(rng: np.random.Generator, v: int, zeros: Sequence[int]) -> Dist:
    x = rng.dirichlet(np.full(v, 0.8))
    x[list(zeros)] = 0.0
    return x / x.sum()


def _cases() -> dict[str, tuple[Dist, Dist]]:
    rng = np.random.default_rng(20240601)
    v = 10
    close_p = _dist(rng, v, [0, 7])
    close_q = 0.7 * close_p + 0.3 * _dist(rng, v, [3])  # q-mass on p's zeros 0 and 7
    close_q[5] = 0.0
    far_q = np.zeros(v)
    far_q[[0, 2, 9]] = [0.5, 0.3, 0.2]  # token 0 has q-mass but no p-mass
    return {
        "random": (_dist(rng, v, [1, 4]), _dist(rng, v, [4, 6])),  # zeros in both, q > 0 = p at 1
        "close": (close_p, close_q / close_q.sum()),
        "far": (_dist(rng, v, [0, 5]), far_q),
    }


CASES = _cases()
N_TRIALS = 6000


def _first_emitted(draft: Sequence[int], accepted: int, next_token: int) -> int:
    return draft[0] if accepted >= 1 else next_token


def _fixed(rows: Sequence[Dist]) -> DistFn:
    return lambda i: rows[min(i, len(rows) - 1)]


def test_cases_cover_the_edge_cases() -> None:
    """The fixtures really contain zeros in p, zeros in q, and q-mass where p has none."""
    for p, q in CASES.values():
        assert p.sum() == pytest.approx(1.0) and q.sum() == pytest.approx(1.0)
        assert (p == 0).any() and (q == 0).any()
        assert ((q > 0) & (p == 0)).any()


@pytest.mark.parametrize("case", CASES)
def test_rejection_first_token_follows_p(case: str) -> None:
    """Draft drawn from q, verified against p with q: the first emitted token is distributed as p."""
    p, q = CASES[case]
    other = np.roll(p, 3)  # later rows must not influence the first token
    rng = np.random.default_rng(1)
    drafts = rng.choice(len(q), size=(N_TRIALS, 2), p=q)
    counts = np.zeros(len(p), dtype=np.int64)
    for row in drafts:
        draft = [int(row[0]), int(row[1])]
        accepted, nxt = verify_rejection(draft, [q, q], _fixed([p, other, other]), rng)
        assert 0 <= accepted <= 2
        counts[_first_emitted(draft, accepted, nxt)] += 1
    assert_follows(counts, p)


@pytest.mark.parametrize("case", CASES)
def test_sample_and_match_first_token_follows_p(case: str) -> None:
    """A deterministic draft (argmax of q, as an n-gram lookup would give) is verified exactly."""
    p, q = CASES[case]
    rng = np.random.default_rng(2)
    draft = [int(np.argmax(q)), 3]
    counts = np.zeros(len(p), dtype=np.int64)
    for _ in range(N_TRIALS):
        accepted, nxt = verify_sample_and_match(draft, _fixed([p, np.roll(p, 1)]), rng)
        counts[_first_emitted(draft, accepted, nxt)] += 1
    assert_follows(counts, p)


def test_sample_and_match_draft_on_a_zero_probability_token() -> None:
    """A draft token p rules out is never accepted; the output is still p."""
    p, _ = CASES["random"]
    zero_tok = int(np.flatnonzero(p == 0)[0])
    rng = np.random.default_rng(3)
    counts = np.zeros(len(p), dtype=np.int64)
    for _ in range(N_TRIALS // 2):
        accepted, nxt = verify_sample_and_match([zero_tok], _fixed([p]), rng)
        assert accepted == 0
        counts[nxt] += 1
    assert_follows(counts, p)


@pytest.mark.parametrize("case", CASES)
def test_greedy_emits_the_argmax_deterministically(case: str) -> None:
    """Greedy verification emits argmax p whatever the draft proposes."""
    p, q = CASES[case]
    best = int(np.argmax(p))
    for tok in range(len(p)):
        accepted, nxt = verify_greedy([tok, tok], _fixed([p, q]))
        assert _first_emitted([tok, tok], accepted, nxt) == best
        expected = 0 if tok != best else 2 if tok == int(np.argmax(q)) else 1  # row 1 is q here
        assert accepted == expected


def test_greedy_accepts_the_matching_prefix_and_adds_the_bonus() -> None:
    """A draft equal to the argmax chain is accepted whole, followed by the argmax of the next row."""
    rows = [np.eye(6)[i] * 0.5 + 0.1 for i in (2, 4, 1, 5)]
    assert verify_greedy([2, 4, 1], _fixed(rows)) == (3, 5)
    assert verify_greedy([2, 3, 1], _fixed(rows)) == (1, 4)
    assert verify_greedy([], _fixed(rows)) == (0, 2)


def test_greedy_rows_in_blocks_answer_as_row_by_row() -> None:
    """The block-wise argmax on raw logits (engine.sequence's plain greedy path) keeps what
    verify_greedy keeps, wherever the first mismatch falls (blocks of 1, 2, 4, ... rows), ties
    included (the first index, as np.argmax)."""
    rng = np.random.default_rng(5)
    for _ in range(500):
        k = int(rng.integers(0, 70))
        logits = rng.integers(0, 4, size=(k + 1, 7)).astype(np.float32)  # small ints: many ties
        best = logits.argmax(axis=1)
        draft = [int(t) for t in best[:k]]
        if k and rng.random() < 0.7:
            i = int(rng.integers(0, k))
            draft[i] = (draft[i] + 1) % 7
        assert verify_greedy_rows(logits, draft) == verify_greedy(draft, lambda i, lg=logits: lg[i])


# -- two tokens: the decode loop -------------------------------------------------------------------


V2 = 5


def _joint_model() -> tuple[Dist, NDArray[np.float64], Dist, NDArray[np.float64]]:
    rng = np.random.default_rng(77)
    p1 = _dist(rng, V2, [3])
    p2 = np.stack([_dist(rng, V2, [i]) for i in range(V2)])  # p(x2 | x1) never repeats x1
    q1 = _dist(rng, V2, [0])
    q2 = np.stack([_dist(rng, V2, [(i + 1) % V2]) for i in range(V2)])
    return p1, p2, q1, q2


def _rows(first: Dist, second: NDArray[np.float64], base: list[int], draft: list[int]) -> DistFn:
    """p_at for a round: row i is the distribution after base + draft[:i]."""
    context = [*base, *draft]
    return lambda i: _cond(first, second, context[: len(base) + i])


def _cond(first: Dist, second: NDArray[np.float64], prefix: Sequence[int]) -> Dist:
    if len(prefix) == 0:
        return first
    if len(prefix) == 1:
        return second[prefix[0]]
    return np.full(V2, 1.0 / V2)


def test_rejection_two_token_draft_joint_follows_p() -> None:
    """Decode loop with 2-token drafts from q: (x1, x2) is distributed as p(x1)·p(x2|x1)."""
    p1, p2, q1, q2 = _joint_model()
    rng = np.random.default_rng(5)
    counts = np.zeros((V2, V2), dtype=np.int64)
    rounds_accepting_both = 0
    for _ in range(N_TRIALS):
        out: list[int] = []
        while len(out) < 2:
            draft: list[int] = []
            qs: list[Dist] = []
            for _k in range(2):
                qd = _cond(q1, q2, out + draft)
                draft.append(int(rng.choice(V2, p=qd)))
                qs.append(qd)
            base = list(out)
            accepted, nxt = verify_rejection(draft, qs, _rows(p1, p2, base, draft), rng)
            rounds_accepting_both += accepted == 2 and not base
            out += [*draft[:accepted], nxt]
        counts[out[0], out[1]] += 1
    assert_follows(counts, p1[:, None] * p2)
    assert rounds_accepting_both > 0  # the second draft position was really exercised


def test_sample_and_match_two_token_draft_joint_follows_p() -> None:
    """The same decode loop with a deterministic (argmax) drafter and sample-and-match."""
    p1, p2, q1, q2 = _joint_model()
    rng = np.random.default_rng(6)
    counts = np.zeros((V2, V2), dtype=np.int64)
    for _ in range(N_TRIALS):
        out: list[int] = []
        while len(out) < 2:
            draft: list[int] = []
            for _k in range(2):
                draft.append(int(np.argmax(_cond(q1, q2, out + draft))))
            base = list(out)
            accepted, nxt = verify_sample_and_match(draft, _rows(p1, p2, base, draft), rng)
            out += [*draft[:accepted], nxt]
        counts[out[0], out[1]] += 1
    assert_follows(counts, p1[:, None] * p2)


# -- the q passed must be the one the draft was drawn from ----------------------------------------


def _always_zero(q_given: Dist, trials: int, seed: int) -> NDArray[np.int64]:
    p = np.array([0.5, 0.5])
    rng = np.random.default_rng(seed)
    counts = np.zeros(2, dtype=np.int64)
    for _ in range(trials):
        accepted, nxt = verify_rejection([0], [q_given], _fixed([p]), rng)
        counts[_first_emitted([0], accepted, nxt)] += 1
    return counts


def test_argmax_draft_with_one_hot_q_is_exact() -> None:
    """Correct usage: an argmax drafter proposes token 0 with certainty, so q is one-hot (1, 0).

    Then token 0 is kept with probability p(0) = 0.5 and the residual puts the rest on token 1."""
    assert_follows(_always_zero(np.array([1.0, 0.0]), 4000, 8), np.array([0.5, 0.5]))


def test_argmax_draft_with_soft_q_is_biased() -> None:
    """The trap: the same argmax draft verified against the drafter's soft q = (0.6, 0.4).

    Token 0 is then kept with probability min(1, 0.5/0.6) = 5/6 instead of 0.5, so the output is
    not p; this is why q must be the distribution the draft token was actually drawn from."""
    counts = _always_zero(np.array([0.6, 0.4]), 4000, 8)
    assert gof_pvalue(counts, np.array([0.5, 0.5])) < 1e-12
    assert counts[0] / counts.sum() == pytest.approx(5 / 6, abs=0.02)


# -- acceptance counts ----------------------------------------------------------------------------


def test_rejection_accepts_everything_when_q_equals_p() -> None:
    """q == p: every draft token passes (the acceptance ratio is 1) and a bonus token follows."""
    rng = np.random.default_rng(9)
    rows = [_dist(rng, 10, [i]) for i in range(5)]
    for _ in range(500):
        draft = [int(rng.choice(10, p=rows[i])) for i in range(4)]
        accepted, nxt = verify_rejection(draft, rows[:4], _fixed(rows), rng)
        assert accepted == 4
        assert rows[4][nxt] > 0


def test_rejection_accepts_nothing_with_disjoint_supports() -> None:
    """q and p disjoint: the first draft token is always rejected, the correction follows p."""
    p = np.array([0.0, 0.0, 0.0, 0.2, 0.3, 0.5])
    q = np.array([0.3, 0.3, 0.4, 0.0, 0.0, 0.0])
    rng = np.random.default_rng(10)
    counts = np.zeros(6, dtype=np.int64)
    for _ in range(2000):
        draft = [int(rng.choice(6, p=q)) for _ in range(3)]
        accepted, nxt = verify_rejection(draft, [q, q, q], _fixed([p]), rng)
        assert accepted == 0
        counts[nxt] += 1
    assert_follows(counts, p)
