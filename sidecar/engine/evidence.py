"""How often each kind of draft holds, and the one rule for paying to learn: Thompson sampling.

Acceptance is not one number per pair: an n-gram draft that continues a 20-token verbatim match is
almost always right, one that continues a 2-token match rarely is. A source's drafts of one class
(drafters.Support.cls) are expected to fare alike, so evidence is kept per (source, class), for all
of a pair's requests: a Beta posterior over the per-position acceptance, starting from the class's
prior (Support.prior, else the pair's acceptance_prior) with `prior_weight` pseudo-observations.
Each observation first discounts the class's old ones by MEMORY, so a class follows the text it
sees now (about 10 observations' memory). A copy's tokens are not independent draws: a file written
back holds for hundreds of tokens, and a longer memory (0.98, ~50 observations) carried that
certainty into the next turn's free text, whose quoted lines match as long but break. On
bench/agent_replay.py the turns after an edit ran at 0.76 and 0.78x plain at 0.98; at 0.9, 1.07 and
1.20x in one run, 0.50 and 0.92x in another: shorter memory narrows the harm, it does not end it
(a copy teaches every match class it grows through, and each must fail on its own).

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
