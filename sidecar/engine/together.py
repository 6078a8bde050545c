"""Model drafts priced together: the sequences of a step that draft from one draft model share its passes.

Each sequence decides its round against the rows the others put in the step (engine.planner), so a
model draft is priced as the step's only one: draft steps of its own, and its rows in a pass beside
the others' plain rows. Where every sequence drafts, the draft steps carry a row of each and the
verify rows go in one pass of equal widths, which no single decision sees. Measured on the padded
pair at N = 2 (2 cores, in-process): two plain rows 75 ms a step; one stream drafting 8 tokens
beside a plain row, 8 draft steps of 11.7 ms and a 9 + 1 row decode of 272 ms, 10 tokens in 366 ms
(1.03x the plain rows' rate); both drafting 8, draft steps of 17.9 ms and a 2 x 9 row decode of
399 ms, 18 tokens in 542 ms (1.25x).

So once the sequences have decided, `choose` weighs, for each group of sequences on one draft
context (those whose round is plain or a model draft, and whose model may draft: Plan.offer), a
round in which every member drafts k tokens from the model, at the k whose step makes the most
tokens per second:
- the step's seconds are the decode of every sequence's rows (CostModel.batch) and k draft steps
  that carry the members' rows (CostModel.draft_step); its tokens, the others' as decided and each
  member's expected tokens at k;
- it is taken where that rate beats the step as decided by `need` (SpeculativeConfig.min_gain; 1
  for a group that drafted together in the step before: staying on), and where the catch-ups it
  adds (members whose model lags and whose own round did not draft from it) are repaid by what it
  saves while the members go on, as Plan.decide weighs one sequence's catch-up.
Each member's round then drafts k (Sequence.join), and the check on shared steps (engine.fair)
still takes back a draft that would leave another stream behind. The members' catch-ups are
their own investment, which the rule above judged; the check counts them only where streams
outside the group wait for them too (a lone catch-up is another's wait, engine.fair).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.engine.adaptive import CostModel, draft_lengths
from sidecar.engine.rounds import Offer


@dataclass(frozen=True)
class Member:
    """A sequence the step may draft together with others: what its model offers, and the model
    draft its own round asked for (0: none)."""

    sid: int
    offer: Offer
    asked: int


def draft_seconds(cost: CostModel, ks: Sequence[int]) -> float:
    """The draft steps of model drafts of these lengths, made together: step j carries every draft
    longer than j."""
    return sum(cost.draft_step(sum(k > j for k in ks)) for j in range(max(ks, default=0)))


def choose(members: Sequence[Member], rows: dict[int, int], tokens: dict[int, float], cost: CostModel,
           cells: int, n_batch: int, need: float) -> tuple[int, float] | None:
    """The draft length every member drafts, and what each one's draft then adds to the step
    (rounds.Round.seconds, its share of the draft steps, rows and catch-ups beyond plain rows);
    None: the step as decided. `rows` and `tokens` are every sequence's rows and expected tokens
    as decided (a prompt's chunk has rows and no tokens)."""
    if cost.t_step[1] <= 0 or cost.t_draft <= 0:
        return None
    ids = {m.sid for m in members}
    others = sum(t for s, t in tokens.items() if s not in ids)
    # The step to beat: as decided, or with every member plain where that is better (a member's
    # own round may be a probe, whose rate is no measure of what the members would do next).
    # Catch-ups are a one-off: the rates compare without them, and what the joint round adds
    # over the step it beats (every member's, or those whose own round did not draft from the
    # model) must be repaid by what it saves (below).
    lag = sum(m.offer.lag for m in members) * cost.t_catchup
    plain = cost.batch(tuple({**rows, **dict.fromkeys(ids, 1)}.items()), cells)
    decided = cost.batch(tuple(rows.items()), cells) + draft_seconds(cost, [m.asked for m in members])
    base, made, catchup = max(
        [(plain, others + len(members), lag),
         (decided, sum(tokens.values()), sum(m.offer.lag for m in members if not m.asked) * cost.t_catchup)],
        key=lambda b: b[1] / b[0])
    if base <= 0 or made <= 0:
        return None
    best: tuple[float, int, float, float] | None = None  # (rate, k, seconds, member tokens)
    k_max = min(len(m.offer.expected) - 1 for m in members)
    for k in draft_lengths(1, k_max):
        joint = {**rows, **dict.fromkeys(ids, k + 1)}
        if sum(joint.values()) > n_batch:
            break
        seconds = cost.batch(tuple(joint.items()), cells) + k * cost.draft_step(len(members))
        mine = sum(m.offer.expected[k] for m in members)
        rate = (others + mine) / seconds
        if best is None or rate > best[0]:
            best = (rate, k, seconds, mine)
    if best is None or best[0] <= need * made / base:
        return None
    rate, k, seconds, mine = best
    if catchup > 0:
        saved = (others + mine) * base / made - seconds  # a step's tokens, as before against together
        steps = min(m.offer.future / m.offer.expected[k] for m in members)  # while every member goes on
        if steps * saved < catchup:
            return None
    # What the members' drafts add to the step, in equal shares. The catch-ups are the members'
    # own investment, judged above, unless streams outside the group wait for them too.
    return k, (seconds + (lag if rows.keys() - ids else 0.0) - plain) / len(members)
