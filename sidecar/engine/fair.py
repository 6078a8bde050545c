"""A shared step's drafts, checked against every stream in it: none may leave another stream behind.

The planner prices each sequence's draft by the step's tokens per second (engine.planner), the
mean request's speed. A draft can raise that a little while it makes every other stream's step
several times longer: on the padded pair at N = 4, one stream drafted 112 tokens at 23.1 tok/s
while the three others fell from 8.2 to 7.6 tok/s, and the batch ended later than with no drafts
at all (0.93 of plain; 0.81 in another run). A drafter that pulls ahead gives the others back only
the row it stops adding to the steps they would have shared, once it is done: on a CPU that is a
fraction of a step, on a GPU next to nothing.

So each stream of a shared step keeps an account against plain steps, in the cost model's
seconds (`Account`): a prompt coming in as well, whose first token waits for the drafts beside
its chunks (it bids a plain round and is only ever owed). A step's plan is weighed for every
stream in it (`balance`):
- its own extra tokens (those past the one a plain step makes) bring its end nearer by one plain
  step each (`Bid.tau`, the step with every round plain); a loss from its own drafts is not
  counted, as it is its planner's to judge (Probing.judge);
- each other stream's extra tokens bring it nearer by one of that stream's rows (`Bid.row`, what
  its row adds to the step): the steps they share end that much sooner (`lead`);
- every draft in the step costs it the seconds the draft adds (Round.seconds).

While a stream would fall behind plain steps by more than `slack` of its plain time (1 -
SpeculativeConfig.fallback_margin: 3%), and further behind than plain rounds would leave it, the
step takes back the draft that costs the others most beyond the lead it gives them (`withdrawals`).
A stream already that far behind is then not held there: drafts that bring it nearer go on. And
a copy of its own that it has ready, but did not draft beside the others' (planner.Plan.could),
counts as made: the stream furthest behind decides first in the next step (engine.step), where
that copy goes. Without these, streams out of phase held each other's copies back for the rest of
their requests (n-gram at N = 4 on SmolLM2: one pair copied 49 tokens each while the other pair's
copies were priced out of the step; the pair left plain, given no lead since each of its rows
merges the others' passes, had the copies taken back, and the next step the roles swapped;
tests/test_fair.py). Copying streams that all draft pay each other's
rows with their own tokens and go on; a lone draft goes on only where its lead repays the others'
wait, or while they are ahead from drafts of their own. A lone sequence's steps are not accounted:
no one else waits on them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class Account:
    """A stream's standing over the shared steps it has run (seconds, the cost model's)."""

    plain: float = 0.0  # what those steps would have taken with every round plain
    ahead: float = 0.0  # how much sooner than that its output came (negative: later)


@dataclass(frozen=True)
class Bid:
    """A stream's round in the step being planned (or, once decoded, as it went)."""

    tokens: float  # tokens the round emits (1 for a plain round): expected, or once decoded, made
    extra: float  # seconds its draft adds to the step (Round.seconds)
    tau: float  # the step with every round plain
    row: float  # what one plain row adds to that step
    could: float = 1.0  # tokens its own ready free draft would make (planner.Plan.could): 1, none


def balance(sid: int, bids: dict[int, Bid], account: Account) -> float:
    """Stream `sid`'s account after a step of these bids (module docstring)."""
    own = bids[sid]
    others = [b for s, b in bids.items() if s != sid]
    return account.ahead + max(0.0, (own.tokens - 1.0) * own.tau - own.extra) + sum(lead(b) - b.extra for b in others)


def lead(bid: Bid) -> float:
    """What a stream's extra tokens give back to each other stream: the row it will no longer add to
    their steps, once it is done. By llama.cpp's split a row between two others' may merge their
    passes and add less than nothing (CostModel.batch); its leaving then gives nothing back."""
    return max(0.0, bid.tokens - 1.0) * max(0.0, bid.row)  # one that ended made no token: no lead


def withdrawals(bids: dict[int, Bid], accounts: dict[int, Account], slack: float) -> tuple[list[int], dict[int, Bid]]:
    """The streams whose drafts the step must take back, in order, so that no stream falls behind
    plain steps by more than `slack` of its plain time through the others' drafts; and the bids
    with those drafts taken back."""
    bids, out = dict(bids), list[int]()
    while True:
        short = {s for s, b in bids.items() if _short(s, bids, accounts[s], slack)}
        # What each draft costs the others beyond the lead it gives them; a stream short only by
        # its own account is not helped by taking back its own draft.
        harm = {s: b.extra - lead(b) for s, b in bids.items() if b.extra > 0 and short - {s}}
        worst = max(harm, key=harm.__getitem__, default=None)
        if worst is None or harm[worst] <= 0:
            return out, bids
        out.append(worst)
        bids[worst] = replace(bids[worst], tokens=1.0, extra=0.0)


def _short(sid: int, bids: dict[int, Bid], account: Account, slack: float) -> bool:
    """Whether this step's drafts leave stream `sid` behind plain steps by more than `slack` of its
    plain time, and further behind than a plain step would: a stream already that far behind is
    not helped by taking back drafts that bring it nearer (its own, or copies whose lead repays
    their wait). A copy of its own that it has ready but did not draft beside the others' counts
    as made: it drafts it in a step of its own (it decides first there, engine.step)."""
    own = bids[sid]
    after = balance(sid, bids, account) + max(0.0, own.could - own.tokens) * own.tau
    return after < -slack * (account.plain + own.tau) and after < account.ahead


def settle(bids: dict[int, Bid], accounts: dict[int, Account]) -> None:
    """Book a decoded step (bids with the tokens each stream made) into every stream's account."""
    after = {s: balance(s, bids, accounts[s]) for s in bids}
    for s, b in bids.items():
        accounts[s].ahead = after[s]
        accounts[s].plain += b.tau
