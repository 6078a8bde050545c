"""What a request's speculation did: the counters a decoder.Result reports (its Sequence keeps them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Tally:
    """Drafted and accepted tokens, rounds, per position and per source; free_tokens tells how
    much of the output a model draft may still speed up (its catch-up's repayment, Sequence.menu)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    by_source: dict[str, list[int]] = field(default_factory=dict)  # name -> [drafted, accepted]
    free_tokens: int = 0  # tokens the free sources' rounds produced (drafts held, plus one)
    # Seconds the drafted rounds saved against stepping their tokens plain, by the cost model's
    # prices (negative: lost): with the decode time, the realised speed-up over target-only.
    saved_seconds: float = 0.0

    def add(self, name: str, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        counts, pos = self.by_source[name], self.accepted_per_pos
        counts[0] += drafted
        counts[1] += accepted
        pos.extend([0] * (drafted - len(pos)))  # nothing where it is long enough already
        for i in range(accepted):
            pos[i] += 1
