"""A costly (model) source's two verdicts: when one that does not pay drafts again, as a probe, and
when one that drafts is switched off because it runs behind plain decoding.

A model draft's price (its draft steps, the catch-up of what it missed) is measured, not known, so
its acceptance alone does not say whether it pays: its realised rate is watched (`judge`), and a
draft judged not to pay is probed now and then (`due`) so new evidence can arrive. A free source
is neither probed nor judged: its only price is the verify batch, which the cost model tracks, and
its acceptance is priced class by class (engine.planner); a whole-drafter verdict mixed classes and
switched a copying request's long matches off with its short ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sidecar.engine.adaptive import CostModel, SpeculativeConfig, Step

PROBE_TOKENS = 8  # a probe's draft: enough for one round to be evidence (a model draft's default n_max)


@dataclass
class Probing:
    """A request's probing state: a probe waits `backoff` plain steps (doubling with every probe),
    and a source switched off drafts again from `off_until` tokens on."""

    backoff: int = 0
    idle: int = 0  # plain steps since the last evidence
    off_until: int = 0
    # Its rounds since it was last judged: their tokens, the seconds they took, and the seconds
    # plain steps would have taken for the same tokens.
    tokens: float = 0.0
    seconds: float = 0.0
    plain: float = 0.0
    rounds: int = 0

    def off(self, produced: int) -> bool:
        """Whether the costly source is switched off at `produced` tokens."""
        return produced < self.off_until

    def wait(self, cost: CostModel, step: Step) -> None:
        """A plain step: towards this request's back-off, and towards the pair's probe budget in wall
        time, where a sequence in a step with others counts its share of it, since a probe's
        catch-up holds up the whole step."""
        self.idle += 1
        cost.unprobed += 1.0 / (1 + len(step.rows))

    def due(self, cost: CostModel, config: SpeculativeConfig, name: str, k: int, lag: Callable[[], int],
            beside: bool) -> bool:
        """Whether source `name`, whose draft does not pay this round, drafts k tokens now as a probe,
        `lag()` tokens behind the target (asked only where it matters: it reads the whole context);
        `beside`: a free source drafts beside it. If so, the probe is booked (the back-off doubles,
        the pair's budget is spent).

        A source the pair has no evidence of at all is probed once, the first time it could draft
        (a request's start, where its catch-up is the prompt): judged by the prior alone, a model
        draft on a CPU never looks worth a round, and a draft that agrees far better than the prior
        (a distilled or same-family draft) would never show it. Beside a free source that probe is
        rented as a catch-up is (Plan.decide): it waits until this request's plain steps have cost
        what prefilling the model costs, so a request the free source covers (an edit) never pays
        the prompt into it.

        Any other probe waits out the back-off, and then for its price to fit `probe_budget` of the
        target-only time since the last evidence. A probe that is rejected costs the wider verify
        batch (on a CPU, 9 rows cost ~4-5 steps), the prefill of everything the draft missed and k
        draft steps: for a draft that does not pay, pure loss. The plain steps are counted across
        the pair's requests (CostModel.unprobed): within one request the catch-up grows faster than
        its budget, and a model draft whose first evidence had to come from one request alone was
        never probed at all. A probe is priced at the load's prices where the learnt ones are
        higher (CostModel.probe_seconds): those may be a disturbance's."""
        explore = name not in cost.explored
        behind = lag() if explore and beside else None
        if behind is not None:
            explore = self.idle * cost.t_step[1] >= behind * cost.t_catchup
        if not explore and (self.idle < self.backoff or cost.probe_seconds(k, lag() if behind is None else behind)
                            > config.probe_budget * cost.unprobed * cost.t_step[1]):
            return False
        self.idle = 0
        self.backoff *= 2
        cost.unprobed = 0.0
        cost.explored.add(name)
        return True

    def unanswered(self) -> None:
        """A probe's drafter had nothing to offer: probe again next round, at the old back-off."""
        self.idle = self.backoff
        self.backoff //= 2

    def answered(self, cost: CostModel) -> None:
        """The costly source drafted: evidence arrived, so plain steps count anew towards a probe."""
        self.idle = 0
        cost.unprobed = 0.0

    def judge(self, config: SpeculativeConfig, tokens: int, seconds: float, plain: float, produced: int
              ) -> tuple[float, float] | None:
        """A round of the costly source made `tokens` in `seconds` where plain steps would have taken
        `plain`: every `fallback_rounds` rounds, the realised and the plain rate if the source falls
        behind plain decoding by `fallback_margin`, and then it is switched off for a back-off.

        Plain decoding is priced where each round ran: alone, a one-row step a token; in a shared
        step, what a plain row and the step's plain rate cost there. A row beside seven others adds
        less than a step of its own, so the lone rate made a draft that slowed a batch of eight look
        like a gain."""
        self.rounds += 1
        self.tokens += tokens
        self.seconds += seconds
        self.plain += plain
        if not config.adaptive or self.rounds < config.fallback_rounds or self.seconds <= 0 or self.plain <= 0:
            return None
        realised, plain_rate = self.tokens / self.seconds, self.tokens / self.plain
        self.rounds, self.tokens, self.seconds, self.plain = 0, 0.0, 0.0, 0.0
        if realised >= config.fallback_margin * plain_rate:
            return None
        self.off_until = produced + self.backoff
        self.backoff *= 2
        return realised, plain_rate
