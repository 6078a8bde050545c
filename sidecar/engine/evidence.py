"""How often each kind of draft holds, and the one rule for paying to learn: Thompson sampling.

Acceptance is not one number per pair: an n-gram draft that continues a 20-token verbatim match is
almost always right, one that continues a 2-token match rarely is. A source's drafts of one class
(drafters.Support.cls) are expected to fare alike, so evidence is kept per (source, class), for all
of a pair's requests: a Beta posterior over the per-position acceptance, starting from the class's
prior (Support.prior, else the pair's acceptance_prior) with `prior_weight` pseudo-observations.
Each observation first discounts the class's old ones by MEMORY, so a class follows the text it
sees now (about 10 observations' memory).

A request believes its pair's evidence only so far (`Belief`): as at most TRUST tokens of each
class, beside its own observations in full. A copy's tokens are not independent draws: a file
written back holds for hundreds of tokens, and pooled over requests that certainty carried into
the next turn's free text, whose quoted lines match as long but break; each match class the copy
grew through had to fail many times on its own before it was doubted, and on a CPU deep in a
conversation, where a drafted row costs ~0.8 of a step, each failure of a long draft costs steps.
On bench/agent_replay.py the turns after an edit ran at 0.50-0.94x plain pooled (bench/results/
2026-12-07-fit.md has the runs with the request's own belief).

Every step each sequence prices its drafts at a *draw* from its classes' posteriors, not at their
means (`Evidence.draw`). That is the whole of exploration: a class with little evidence draws
widely and is tried now and then, for what it would teach; one with much evidence draws near its
mean and is tried only where it pays. It replaces probes with their back-off and budget, retries
of classes priced below their prior, evidence ageing and caps, and the catch-up's ski rental: a
model draft's catch-up is simply part of its price in the schedule (engine.schedule). The draws
come from a generator seeded per pair, so a run is reproducible.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sidecar.engine.drafters import Support

MEMORY = 0.9  # each observation of a class keeps this share of its older ones
PRIOR_EDGE = 1e-3  # the nearest a prior mean may come to 0 or 1
TRUST = 8.0  # a request believes the pair's evidence of a class as at most this many tokens' worth


class Key(NamedTuple):
    """What acceptance evidence is kept under: a source's name and its class (drafters.Support.cls)."""

    source: str
    cls: int


class Evidence:
    """Per (source, class): accepted and rejected drafted tokens, discounted (module docstring)."""

    def __init__(self, prior: float = 0.7, weight: float = 0.5, seed: int = 0) -> None:
        self.prior, self.weight = prior, weight
        self.counts: dict[Key, list[float]] = {}  # key -> [accepted, rejected]
        self._rng = np.random.default_rng(seed)

    def _start(self, source: str, s: Support) -> float:
        """A class's prior mean: its own, or the best its lower classes (Support.under) have shown."""
        prior = self.prior if s.prior is None else s.prior
        if s.under:
            prior = max([prior, *(self.mean(source, u) for u in s.under)])
        return prior

    def _beta(self, source: str, s: Support) -> tuple[float, float]:
        prior = self._start(source, s)
        acc, rej = self.counts.get(Key(source, s.cls), (0.0, 0.0))
        # A prior of exactly 0 or 1 (a class known never or always to hold) is not a Beta; keep
        # both shapes positive so the posterior stays a distribution to draw from.
        prior = min(max(prior, PRIOR_EDGE), 1.0 - PRIOR_EDGE)
        return acc + prior * self.weight, rej + (1.0 - prior) * self.weight

    def mean(self, source: str, s: Support) -> float:
        a, b = self._beta(source, s)
        return a / (a + b)

    def draw(self, source: str, s: Support) -> float:
        """A sample of the class's acceptance from its posterior (Thompson sampling)."""
        a, b = self._beta(source, s)
        return float(self._rng.beta(a, b))

    def observe(self, source: str, s: Support, drafted: int, accepted: int) -> None:
        """A draft of this class whose first `accepted` of `drafted` tokens held. Where classes
        follow a copy along (Support.along), each token counts for its own class."""
        parts: list[tuple[int, int, int]] = []  # (class, drafted, accepted) in runs
        for j in range(min(drafted, accepted + 1)):  # the tokens whose fate is known
            cls = s.cls if s.along is None else s.along(j).cls
            if parts and parts[-1][0] == cls:
                c, d, a = parts[-1]
                parts[-1] = (c, d + 1, a + (j < accepted))
            else:
                parts.append((cls, 1, int(j < accepted)))
        for cls, d, a in parts:
            ev = self.counts.setdefault(Key(source, cls), [0.0, 0.0])
            ev[0] = ev[0] * MEMORY + a
            ev[1] = ev[1] * MEMORY + (1.0 if a < d else 0.0)  # the token that broke the draft

    def request(self) -> Belief:
        """A request's view of this evidence (Belief)."""
        return Belief(self)


class Belief:
    """A request's evidence (module docstring): the pair's, believed as at most TRUST tokens of each
    class, and its own in full, pooled over each source's classes: a request whose drafts broke
    doubts every match length of that source at once, where per class each had to break on its
    own (and on a CPU deep in a conversation each break of a long draft costs steps)."""

    def __init__(self, pair: Evidence) -> None:
        self.pair = pair
        self.own = Evidence(pair.prior, pair.weight)

    def _beta(self, source: str, s: Support) -> tuple[float, float]:
        a, b = self.pair._beta(source, s)
        if a + b > TRUST:
            a, b = a * TRUST / (a + b), b * TRUST / (a + b)
        own_a, own_b = self._own(source)
        return a + own_a, b + own_b

    def _own(self, source: str) -> tuple[float, float]:
        """This request's accepted and rejected tokens of the source, over all its classes."""
        acc, rej = self.own.counts.get(Key(source, POOLED.cls), (0.0, 0.0))
        return acc, rej

    def draw(self, source: str, s: Support) -> float:
        """A sample of the class's acceptance from this request's posterior (Thompson sampling)."""
        a, b = self._beta(source, s)
        return float(self.pair._rng.beta(a, b))

    def cap(self, source: str) -> int:
        """The longest draft this request risks from a source: two tokens more than twice those
        its drafts have had accepted here (slow start). The pair's evidence, however sure, is
        another request's; until this request's own drafts hold, a break costs a few rows."""
        return int(2 + 2 * self._own(source)[0])

    def observe(self, source: str, s: Support, drafted: int, accepted: int) -> None:
        self.pair.observe(source, s, drafted, accepted)
        self.own.observe(source, POOLED, drafted, accepted)


POOLED = Support(cls=-1)  # the class a request's own evidence keeps each source's drafts under
