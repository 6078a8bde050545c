"""Per request and per round: whether to draft, from which source, how many tokens, at what shape.

`Plan.decide` answers with a value, a `Round` (source, k, rows); `Plan.record` takes the round back
with what came of it. In a shared step, `Plan.offer` prices the model's draft for a round made
with other sequences' (engine.together) without deciding anything, and `Plan.join` books the
round when the step takes it. What a request reports (drafted and accepted tokens, per source) is its
`Tally` (engine.tally); when a model draft that does not pay is probed, and when one that drafts
is switched off, is its `Probing` (engine.probing).

Each round drafts the k with the most expected tokens per second (engine.adaptive) from the source
that offers the most: a pair may draft from several (hybrid.HybridDrafter), each priced by its own
support classes and cost, so a near-certain free match skips the model's draft pass. If no draft
beats plain decoding (k = 0, rate 1/t_step(1)) the round runs target-only.

A draft's expected tokens take each drafted token at the acceptance of its own class: a verbatim
match that holds grows into a longer one (Support.along), so a copy under way is priced as one.

A free source is judged class by class: by the acceptance evidence the planner prices it by. A
costly (model) source is also judged by its realised rate, and probed where it does not pay.

Where a batch of the last decode's shape costs less (CostModel.t_same: a GPU replaying a captured
graph) a stretch of drafting keeps one shape: its first round picks the shape its rounds do best at,
and later rounds pad a shorter draft up to it. On a CPU t_same is empty and nothing is padded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count, islice

from sidecar.engine import adaptive
from sidecar.engine.adaptive import ALONE, CostModel, SpeculativeConfig, Step, expected_tokens, round_seconds
from sidecar.engine.drafters import Support
from sidecar.engine.probing import PROBE_TOKENS, Probing
from sidecar.engine.rounds import PLAIN, Key, Offer, Round, Source
from sidecar.engine.tally import Tally

RETRY_TOKENS = 2  # a retry's draft (Plan._retry): a rejected one costs ~0.6 steps a token on a CPU


@dataclass
class Plan:
    """Per-request speculation state: acceptance evidence, fallback, and the counters it reports."""

    config: SpeculativeConfig
    cost: CostModel
    sources: list[Source] = field(default_factory=list)
    enabled: bool = True
    fallback: str | None = None
    tally: Tally = field(default_factory=Tally)
    probing: Probing = field(default_factory=Probing)
    _evidence: dict[Key, list[float]] = field(default_factory=dict)  # key -> [accepted, rejected]
    _last: Key | None = None  # what the last round drafted: staying on needs no margin
    _since_batch: int = 0  # plain steps since the last batch (the prompt's prefill is one)
    _prev_rows: int = 0  # rows of the last decode; 0: the prompt's prefill
    _rent: float = 0.0  # seconds plain steps lost to a model held back by its catch-up (decide)
    _price: float = 0.0  # ... and the catch-up it was held back for, when the holding began
    _tried: set[Key] = field(default_factory=set)  # the classes this request has drafted itself (_retry)
    _ready: tuple[list[Support], int] = ([], 0)  # the last decision's supports and k_cap (`could`)

    @classmethod
    def start(cls, config: SpeculativeConfig, cost: CostModel, sources: Sequence[Source], num_predict: int) -> Plan:
        plan = cls(config, cost, list(sources), tally=Tally(by_source={s.name: [0, 0] for s in sources}))
        plan.probing.backoff = config.probe_interval
        cost.age()
        # A list: the pair's other slots may add a class while this one reads.
        for key, (succ, fail) in list(cost.evidence.items()):
            # Earlier requests' evidence, capped so this request's own rounds can still move it.
            scale = min(1.0, 64.0 / (succ + fail)) if succ + fail > 0 else 1.0
            plan._evidence[Key(*key)] = [succ * scale, fail * scale]
        # A model draft known not to pay (it has one class): probe late and rarely.
        costly = plan._costly
        if costly is not None:
            support = plan.sources[costly].support()
            key = plan._key(costly, support)
            if sum(cost.evidence.get(key, ())) >= 8 and not plan._best(costly, support, config.n_max, 0)[0]:
                plan.probing.backoff = config.probe_interval * 4
        if not sources:
            plan.enabled = False
        elif 0 <= num_predict < config.min_predict:
            plan.enabled = False
            plan.fallback = f"short output: num_predict {num_predict} < {config.min_predict}"
        return plan

    def _key(self, i: int, support: Support) -> Key:
        return Key(self.sources[i].name, support.cls)

    @property
    def _costly(self) -> int | None:
        """The source whose drafts cost a model pass (hybrid.HybridDrafter allows one), if any."""
        return next((i for i, s in enumerate(self.sources) if s.has_cost), None)

    @property
    def _warm(self) -> bool:
        """Whether plain steps run at full speed again: two since the last batch (see t_switch)."""
        return self._since_batch >= 2

    def expected(self, rnd: Round) -> float:
        """Tokens a round is expected to emit (1 for a plain step)."""
        return self._expected(rnd.source, rnd.support, rnd.k, rnd.retry)[rnd.k] if rnd.k else 1.0

    def acceptance(self, rnd: Round) -> float:
        """Per-position acceptance expected of a round's draft (its support class)."""
        return self._acceptance(rnd.source, rnd.support, rnd.retry)

    def _acceptance(self, i: int, s: Support, retry: bool = False) -> float:
        """Per-position acceptance of a class: its evidence, earlier requests' and this one's, over its
        prior, or over the best that the classes just under it (Support.under) have shown; in a retry
        (_retry), the prior at least."""
        prior = self._prior(s)
        a = self._posterior(i, s, max([prior, *(self._posterior(i, u, self._prior(u)) for u in s.under)]))
        return max(a, prior) if retry else a

    def _prior(self, s: Support) -> float:
        return self.config.acceptance_prior if s.prior is None else s.prior

    def _posterior(self, i: int, s: Support, prior: float) -> float:
        succ, fail = self._evidence.get(self._key(i, s), (0.0, 0.0))
        return (succ + prior * self.config.prior_weight) / (succ + fail + self.config.prior_weight)

    def _retry(self, i: int, s: Support) -> bool:
        """Whether a draft of this class may be retried: a free source's class that this request has
        not drafted yet, which the evidence prices below its prior.

        How such a class fares depends on the request (code's short matches break, a summary's hold),
        and under the weak prior one rejection in an earlier request priced it below paying for good,
        with no evidence of this request's to revive it (bench/replay.py --shape prior). So where no
        draft pays on the evidence, a retry is priced at the prior of each class along it and
        drafts at most RETRY_TOKENS (decide); every other draft is priced on the evidence alone."""
        return (not self.sources[i].has_cost and self._key(i, s) not in self._tried
                and self._acceptance(i, s) < self._prior(s))

    def _expected(self, i: int, support: Support, k_max: int, retry: bool = False) -> list[float]:
        """Expected tokens of a round drafting k = 0..k_max tokens of this support class."""
        return list(islice(self._along(i, support, retry), k_max + 1))

    def _along(self, i: int, support: Support, retry: bool = False) -> Iterator[float]:
        """Expected tokens of rounds drafting k = 0, 1, ... tokens (Leviathan et al.), each token at its own
        class's acceptance (Support.along); lazily, as `_best` stops short of a copy's 64 where rows add nothing."""
        yield 1.0
        along = support.along
        if along is None:
            a = self._acceptance(i, support, retry)
            yield from (expected_tokens(a, k) for k in count(1))
            return
        e, holds = 1.0, 1.0
        known: dict[tuple[int, float | None], float] = {}  # a copy's tokens fall in a few classes
        for j in count():
            s = along(j)
            got = known.get(c := (s.cls, s.prior))
            holds *= known.setdefault(c, self._acceptance(i, s, retry)) if got is None else got
            e += holds
            yield e

    def _rows_cost(self, n: int, step: Step) -> float:
        """Seconds n rows add to a step the other sequences of `step` fill: less when a lone
        sequence's last decode had that shape (CostModel.t_same)."""
        same = self.cost.t_same
        if same and not step.rows and n == self._prev_rows:
            return same[n]
        return self.cost.added(n, step)

    def _host_base(self, step: Step) -> float:
        """The host's seconds for a step of these sequences whatever they draft (engine.hosttime):
        its fixed part and each decoding sequence's."""
        host = self.cost.host
        return host.fixed + host.seq * (len(step.rows) + 1)

    def _plain_rate(self, step: Step) -> float:
        """Tokens per second of the step with this sequence's round plain: the others' expected
        tokens and its one over the device's seconds and the host's."""
        cost, tokens = self.cost, step.tokens + 1.0
        seconds = cost.batch(step.rows, step.cells) + cost.added(1, step) + self._host_base(step)
        return tokens / (seconds + cost.host.token * tokens)

    def _best(self, i: int, support: Support, k_cap: int, pad_cap: int, step: Step = ALONE, retry: bool = False
              ) -> tuple[int, int, float, float]:
        """Source i's best draft length and batch rows, the round's expected tokens per second and
        the rate it is ranked by; k = 0 when no draft beats plain decoding.

        Inside a shared step the rate is the step's: every sequence's expected tokens over the
        step's seconds (the others' rows and tokens come in `step`), so a draft is worth its rows
        only while it adds more tokens than it slows every other sequence down; alone, it is the
        round's own rate.

        Starting to draft takes a predicted gain of `min_gain`; alone, staying on (the same source
        and class as the last round) only beats plain, so a pair at break-even does not flap. In a
        shared step staying on takes the margin too: a price there is ~10% off per decode
        (bench/replay_prices.py), and a stretch kept on at +1-2% is a coin toss the others pay for.

        A batch of the last decode's shape may cost less (a GPU replays its graph, CUDA graphs):
        then a round inside a stretch of batches may pad its draft up to that shape (at most
        `pad_cap` drafted rows), and a stretch's first round picks the shape whose rounds do best
        at the same-shape price, provided this round pays at its own. On a CPU shapes cost the same
        and every round verifies its own draft."""
        cost = self.cost
        t, same = cost.t_step, cost.t_same
        if t[1] <= 0:
            return 0, 1, 0.0, 0.0
        src = self.sources[i]
        others, host = step.tokens, cost.host
        # The step's seconds before this sequence's rows: the others' rows on the device, and the
        # host's work for the step (engine.hosttime); each token emitted costs the host too.
        shared = cost.batch(step.rows, step.cells) + self._host_base(step)
        plain = self._plain_rate(step)
        need = (1.0 if self._last == self._key(i, support) and not step.rows else self.config.min_gain) * plain
        t_d = cost.t_draft if src.has_cost else 0.0
        switch = cost.t_switch if self._warm else 0.0  # a batch now costs the warm plain steps
        stretch = self._prev_rows if same and self._since_batch == 0 and self._prev_rows > 1 else 0
        best = (0, 1, 0.0, 0.0)
        k_max = min(k_cap, len(t) - 2)
        expected = [next(along := self._along(i, support, retry))]
        prev_k, prev_e = 0, expected[0]
        for k in adaptive.draft_lengths(max(1, self.config.n_min), k_max):
            if t[k + 1] <= 0:
                continue
            expected.extend(islice(along, max(0, k + 1 - len(expected))))
            e = expected[k]
            if e - prev_e < adaptive.MIN_HOLD * (k - prev_k):
                break  # the rows from here on add (almost) no tokens
            prev_k, prev_e = k, e
            for n in (k + 1, stretch) if stretch > k + 1 and stretch - 1 <= pad_cap else (k + 1,):
                # The draft's host work (proposing, pricing, verifying its rows) is the step's too.
                seconds = round_seconds(k, t_d, self._rows_cost(n, step), switch) + host.draft(k)
                rate = (others + e) / (shared + seconds + host.token * (others + e))
                if rate <= need:
                    continue
                # Inside a stretch the round's own price ranks; a stretch's first round sets its shape.
                rank = rate if stretch or not same else e / (round_seconds(k, t_d, same[n]) + host.draft(k))
                if rank > best[3]:
                    best = (k, n, rate, rank)
        return best

    def decide(self, produced: int, remaining: float, room: int, step: Step = ALONE) -> Round:
        """This round: from which source to draft how many tokens, and the rows to decode.

        `produced` tokens so far, `remaining` at most to go, `room` left in the window; `step`, the
        rest of the decode this round joins (what the other sequences put in it)."""
        c = self.config
        self._ready = ([], 0)
        if not self.enabled:
            return PLAIN
        k_cap = int(min(c.n_max, remaining - 1, room, len(self.cost.t_step) - 2))
        if k_cap < c.n_min:
            return PLAIN
        probing = self.probing
        supports = [s.support() if not (s.has_cost and probing.off(produced)) else Support(ready=False)
                    for s in self.sources]
        ready = [i for i, s in enumerate(supports) if s.ready]
        if not c.adaptive:  # llama.cpp's rule: the first source that has a draft, at full length
            if not ready:
                return PLAIN
            return Round(ready[0], k_cap, k_cap + 1, supports[ready[0]])
        if not ready:  # nothing to propose: a plain step
            probing.wait(self.cost, step)
            self._last = None
            return PLAIN
        self._ready = (supports, k_cap)
        best, best_rank = PLAIN, 0.0
        held = 0.0  # what a model round would have saved over this plain step, had it not been held back
        for i in ready:  # the first of equals: the configured order
            support = supports[i]
            pad_cap = min(room, len(self.cost.t_step) - 2)
            ki, rows, rate, rank = self._best(i, support, k_cap, pad_cap, step)
            retry = not ki and self._retry(i, support)
            if retry:
                ki, rows, rate, rank = self._best(i, support, min(k_cap, RETRY_TOKENS), pad_cap, step, retry)
            # A model draft must first prefill what it missed; starting pays only if the time the
            # gain saves over the tokens still to come (at most `horizon`) covers that. It gains
            # only where the free sources would not have drafted: the share of this request's
            # tokens that plain steps produced (a copying request's is small). Beside a free
            # source that share is unknown until the request shows it, so the catch-up is also
            # a ski rental (`_rent`): paid only once the plain steps the model would have sped up
            # have cost as much as it. A request the free source covers (an edit that copies its
            # prompt) never pays to prefill its prompt into the draft model, and one it does not
            # cover waits at most what the catch-up costs.
            if ki and self.sources[i].has_cost and self._last != self._key(i, support):
                share = 1.0 - self.tally.free_tokens / produced if produced >= 32 else 1.0
                gain = 1.0 / self._plain_rate(step) - 1.0 / rate
                catchup = self.sources[i].lag() * self.cost.t_catchup
                # The rental's price is the catch-up when it started: every plain step it holds
                # the model back adds a token to the lag, and a price that grew with the rent
                # could outrun it (a gain under t_catchup a token never buys).
                price = self._price or catchup
                # This step's loss counts: a catch-up of a free round's few tokens is bought at once.
                rented = self._rent + gain >= price or len(self.sources) == 1
                if min(remaining, c.horizon) * share * gain < catchup or not rented:
                    held, ki = gain, 0
                    self._price = price
                    # A model that would pay, once caught up: not one that "does not pay".
                    self.fallback = f"draft held back: catching up {self.sources[i].lag()} tokens would not repay yet"
            if ki:
                # Against the other sources, a model's round pays the catch-up of what they drafted
                # while it sat out: a copying stretch stays with the free source.
                t_d, lag = (self.cost.t_draft, self.sources[i].lag()) if self.sources[i].has_cost else (0.0, 0)
                seconds = round_seconds(ki, t_d, self._rows_cost(rows, step)) + self.cost.host.draft(ki)
                catchup = lag * self.cost.t_catchup
                rank *= seconds / (seconds + catchup)
            if ki and rank > best_rank:
                extra = seconds + catchup - self.cost.added(1, step)
                best, best_rank = Round(i, ki, rows, support, retry=retry, seconds=extra), rank
        if best.k:
            self._last = self._key(best.source, best.support)
            if self.sources[best.source].has_cost:
                self._rent = self._price = 0.0  # bought: the next catch-up is weighed against the steps after this
            self.fallback = None  # speculating again: `fallback` reports why it is off, if it is
            return best
        self._last = None
        self._rent += held
        return self._nothing_pays(supports, k_cap, Round(ready[0], 0, 1, supports[ready[0]]), step)

    @property
    def could(self) -> float:
        """Tokens the best draft a free source had ready at the last decision would make, whatever was
        decided (1: none); the shared step's check counts it as made (engine.fair, Bid.could)."""
        supports, k_cap = self._ready
        ready = [i for i, s in enumerate(supports) if s.ready and not self.sources[i].has_cost]
        return max([1.0, *(self._expected(i, supports[i], k_cap)[-1] for i in ready)])

    def withdraw(self) -> None:
        """The step took this round's draft back (engine.fair): it ran plain."""
        self._last = None

    def offer(self, produced: int, remaining: float, room: int) -> Offer | None:
        """This round's model draft, priced for a step that drafts it with other sequences'
        (engine.together); None where the costly source may not draft now (none, switched off,
        nothing to propose, no room). Changes nothing: `join` takes the round if the step does."""
        c, i = self.config, self._costly
        k_cap = int(min(c.n_max, remaining - 1, room, len(self.cost.t_step) - 2))
        if not (self.enabled and c.adaptive) or i is None or self.probing.off(produced) or k_cap < c.n_min:
            return None
        src = self.sources[i]
        support = src.support()
        # Beside a free source, a request shows how much of it plain steps make (the model's
        # share) only after 32 tokens: before, a joint round could catch an edit's prompt up
        # into the model while n-gram copies it (decide rents that catch-up instead).
        if not support.ready or (len(self.sources) > 1 and produced < 32):
            return None
        share = 1.0 - self.tally.free_tokens / produced if produced >= 32 else 1.0
        return Offer(i, support, self._expected(i, support, k_cap), src.lag(), min(remaining, c.horizon) * share)

    def join(self, rnd: Round) -> None:
        """The step drafts `rnd` from the model with other sequences (engine.together), whatever
        `decide` answered: book it as `decide` books a model round it picks."""
        self._last = self._key(rnd.source, rnd.support)
        self._rent = self._price = 0.0
        self.fallback = None

    def _nothing_pays(self, supports: list[Support], k_cap: int, plain: Round, step: Step) -> Round:
        """No draft pays this round: say why, and probe a costly source now and then (Probing.due) so
        new evidence can arrive. A free source is not probed: its classes carry priors, so evidence
        arrives from the classes that look worth drafting, and a probe would only buy a wider batch
        for a class already expected to lose. The plain round answered carries the class that was
        priced (the first ready source's)."""
        costly = self._costly
        i = costly if costly is not None and supports[costly].ready else None  # a costly source to probe
        # A free source that has drafted this request was not switched off: only this class of
        # draft is skipped, so it reports no fallback.
        if self.fallback is None and (i is not None or not self.tally.rounds):
            self.fallback = (f"draft does not pay: acceptance {self._acceptance(i, supports[i]):.2f}"
                             if i is not None and self.tally.rounds else "verification too costly on this hardware")
        self.probing.wait(self.cost, step)
        if i is None:
            return plain
        # Probe in full so one round is real evidence (a model drafter still stops early where
        # its own confidence falls below p_min).
        src, k = self.sources[i], min(k_cap, PROBE_TOKENS)
        if not self.probing.due(self.cost, self.config, src.name, k, src.lag, len(self.sources) > 1):
            return plain
        return Round(i, k, k + 1, supports[i], probe=True)

    def record(self, rnd: Round, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float,
               produced: int, step_seconds: float | None = None, caught_up: int = 0, rows: int = 0,
               observe: bool = True, plain_seconds: float | None = None, step: Step = ALONE,
               company: float = 1.0) -> None:
        """Account one round as decided (`rnd`) and as it went: `drafted` tokens (0: a plain step;
        a drafter may propose fewer than rnd.k), `accepted` of them. step_seconds: drafting without
        catch-up, which prefilled `caught_up` tokens. rows: the batch decoded (drafted + 1 unless
        padded). observe: `verify_seconds` timed these rows alone (in a shared step it timed the
        other sequences' rows too, and teaches the cost model nothing). plain_seconds: in a shared
        step, what the round's tokens had cost stepping plain there (CostModel.shares); alone,
        a one-row step each. step: the step the round was decided for (its depth, Step.cells). company:
        the rows its draft steps carried (drafters.Proposal.company)."""
        rows = rows or drafted + 1
        # A lone probe corrects a disturbance's prices; in a shared step its draft's time is a share
        # of the drafts made with it (drafters.propose_together), which says nothing of a lone draft.
        if rnd.probe and drafted and observe:
            self.cost.recover((draft_seconds if step_seconds is None else step_seconds) / drafted)
        warm = self._warm
        same = rows == self._prev_rows
        self._since_batch = self._since_batch + 1 if drafted == 0 else 0
        self._prev_rows = rows
        if observe and (drafted or warm):  # the plain steps just after a batch are t_switch's, not t_step[1]'s
            self.cost.observe_step(rows, verify_seconds, same, step.cells)
        if step_seconds is not None:
            self.cost.observe_catchup(caught_up, draft_seconds - step_seconds)
        if drafted == 0:
            if rnd.probe:
                self.probing.unanswered()
            return
        src = self.sources[rnd.source]
        # What the round's tokens had cost stepping plain there, against what drafting and
        # verifying them took (catch-up included): /metrics' speed-up over target-only.
        plain = (accepted + 1) * self.cost.added(1, step) if plain_seconds is None else plain_seconds
        self.tally.saved_seconds += plain - draft_seconds - verify_seconds
        self.learn(rnd.source, rnd.support, drafted, accepted)
        if not src.has_cost:
            self.tally.free_tokens += accepted + 1
        self.tally.add(src.name, drafted, accepted)
        if not src.has_cost:
            return
        self.probing.answered(self.cost)
        draft = draft_seconds if step_seconds is None else step_seconds
        self.cost.observe_draft(drafted, draft, company)
        # A catch-up prefill is paid once, when drafting starts; whether to go on drafting must
        # not count it (it would stop drafting just as the investment starts to pay).
        self._judge(src.name, accepted + 1, draft + verify_seconds + (self.cost.t_switch if warm else 0.0), plain,
                    produced)

    def _judge(self, name: str, tokens: int, seconds: float, plain: float, produced: int) -> None:
        """Switch a costly source off for a back-off when its realised rate falls behind plain
        decoding (Probing.judge), and say why."""
        verdict = self.probing.judge(self.config, tokens, seconds, plain, produced)
        if verdict is not None:
            drafted, accepted = self.tally.by_source[name]
            self.fallback = (f"slower than target-only: {verdict[0]:.1f} vs {verdict[1]:.1f} tok/s "
                             f"at acceptance {accepted / drafted:.2f}")

    def learn(self, i: int, support: Support, drafted: int, accepted: int) -> None:
        """Evidence from a draft whose first `accepted` tokens held: for each token's class (see
        Support.along) the tokens that held, and the one that did not, if one did not. Also what a
        free source would have drafted in a model's round (engine.sequence, shadows)."""
        if support.along is None:
            parts = [(self._key(i, support), drafted, accepted)]
        else:
            parts = []
            for j in range(min(drafted, accepted + 1)):  # the tokens whose fate is known
                key = self._key(i, support.along(j))
                if not parts or parts[-1][0] != key:
                    parts.append((key, 0, 0))
                k, d, a = parts[-1]
                parts[-1] = (k, d + 1, a + (j < accepted))
        for key, d, a in parts:
            self._tried.add(key)
            self.cost.observe_acceptance(key, d, a)
            ev = self._evidence.setdefault(key, [0.0, 0.0])
            ev[0] += a
            ev[1] += 1 if a < d else 0  # the token that broke the draft, if one did
