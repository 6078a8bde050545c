"""Choosing the draft length from a measured cost model, and falling back when drafting does not pay.

On a GPU, scoring k+1 tokens in one pass costs about as much as scoring one; on a CPU it does not
(SmolLM2 Q4_1 on 2 cores: a batch of 4 costs ~2.4x one token, a batch of 8 ~4.1x). So the draft
length is not a constant: each round picks the k that maximises

    expected tokens per round / expected seconds per round
    = (1 - a^(k+1)) / (1 - a)  /  (draft_cost(k) + t_step(k+1))

where a is the per-position acceptance observed so far for drafts of this kind (the drafter's
support class: an n-gram draft continuing a long verbatim match is not a short one's kind) and
t_step(n) is the measured time to decode n rows on the target. If no k beats plain decoding
(k = 0, rate 1/t_step(1)) the round runs target-only; the realised throughput of speculative rounds
is also watched, and speculation is switched off when it falls behind the plain rate, for a
back-off. A model draft that does not pay is probed now and then; an n-gram draft needs no probe,
because its support classes carry priors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.engine.drafters import Support
from sidecar.engine.llama import Context


@dataclass(frozen=True)
class SpeculativeConfig:
    """Per-pair speculation settings; defaults were measured with bench/bench_spec.py on 2 CPU cores."""

    n_max: int = 8  # longest draft per round
    n_min: int = 1  # shorter drafts are not worth a round
    p_min: float = 0.5  # model drafter stops when its top probability is below this
    min_predict: int = 16  # num_predict below this runs target-only from the start
    fallback_rounds: int = 8  # speculative rounds observed before judging them
    fallback_margin: float = 0.97  # switch off when realised rate < margin x plain rate
    probe_interval: int = 32  # tokens of target-only decoding before probing again (doubles)
    probe_budget: float = 0.03  # most of the target-only time that probing a costly draft may take
    min_gain: float = 1.05  # predicted speed-up needed to start drafting (keeping on needs > 1)
    horizon: int = 512  # tokens a request without num_predict is assumed to have left
    acceptance_prior: float = 0.7  # per-position acceptance assumed before any evidence
    prior_weight: float = 0.5  # weak: on a CPU only near-certain acceptance pays, so evidence must rule
    adaptive: bool = True  # False: always draft n_max (llama.cpp's fixed draft length), no fallback


NGRAM_N_MAX = 12
"""An n-gram pair's default n_max: its drafts cost nothing to make and a copied stretch runs long
(bench_spec pair a, editing: 1.27x with 8, 1.34x with 12)."""


class CostModel:
    """Seconds per target decode of n rows, and per drafted token; shared by a pair's requests.

    Seeded by timing real decodes at load (`calibrate`), then tracked with moving averages of what
    each round actually cost, so it follows the hardware it runs on (CPU, GPU, thermal state)."""

    def __init__(self, n_rows: int) -> None:
        self.t_step = [0.0] * (n_rows + 1)  # index = rows in the batch
        self.t_draft = 0.0  # seconds per drafted token
        self.t_catchup = 0.0  # seconds per token the draft prefills to catch up with the context
        # Extra seconds the first plain steps after a batch cost. A GPU replays one-token decodes as
        # a captured graph (CUDA graphs), which a batch of another shape interrupts, and rebuilding
        # it takes a couple of slow steps; llama.cpp on a CPU has nothing of the kind (0 there).
        self.t_switch = 0.0
        # The pair's acceptance across requests (decayed) per support key (drafters.Support), so a
        # new request starts from what this draft has shown rather than from the prior, and a
        # known-bad draft is rarely probed.
        self.evidence: dict[int, list[float]] = {}  # key -> [accepted, rejected]
        self._smooth = 0.2

    def age(self, factor: float = 0.9) -> None:
        """Fade every class's evidence a little (once per request): a class judged not to pay is
        never drafted, so no evidence of its own would ever revive it; its prior gets to, in time."""
        for ev in list(self.evidence.values()):
            ev[0] *= factor
            ev[1] *= factor

    def observe_acceptance(self, key: int, drafted: int, accepted: int) -> None:
        ev = self.evidence.setdefault(key, [0.0, 0.0])
        ev[0] = ev[0] * 0.98 + accepted
        ev[1] = ev[1] * 0.98 + (1.0 if accepted < drafted else 0.0)

    def calibrate(self, ctx: Context, reps: int = 3) -> None:
        """Time decodes of 1..n rows on a scratch sequence, then give the cache back empty.

        Repetitions are interleaved across sizes and the minimum kept, so a burst of load on the
        machine inflates one sample rather than one size."""
        n_rows = len(self.t_step) - 1
        ctx.clear()
        # A short prefix, then the widest batch and three one-token steps: all within a small num_ctx.
        ctx.prefill([0] * max(0, min(32, ctx.n_ctx - n_rows - 3)))
        base = len(ctx)
        for n in (n_rows, 1):  # warm-up: graph builds and output buffers for both extremes
            ctx.decode([0] * n)
            ctx.truncate(base)
        best = [float("inf")] * (n_rows + 1)
        for _ in range(reps):
            for n in range(1, n_rows + 1):
                ctx.truncate(base)
                best[n] = min(best[n], self._time_decode(ctx, n))
        # Plain decoding is one-token steps in a row, which a GPU runs faster than a step right
        # after a batch (see t_switch): time both.
        steady, switch = float("inf"), float("inf")
        for _ in range(reps):
            ctx.truncate(base)
            ctx.decode([0] * n_rows)
            after = [self._time_decode(ctx, 1) for _ in range(3)]
            run = [self._time_decode(ctx, 1) for _ in range(4)]
            steady = min(steady, *run)
            switch = min(switch, sum(after) - 3 * min(run))
        best[1] = min(best[1], steady)
        # Rebuilding a graph costs at least one step run without it; less is cache effects and
        # timing noise (a CPU measures 0.1-0.2 steps here, and has no graphs to rebuild).
        self.t_switch = switch if switch > 0.5 * best[1] else 0.0
        # Verifying more rows never costs less; flatten noise that says otherwise.
        for n in range(2, n_rows + 1):
            best[n] = max(best[n], best[n - 1])
        self.t_step = [0.0, *best[1:]]
        ctx.clear()

    @staticmethod
    def _time_decode(ctx: Context, n: int) -> float:
        t0 = time.perf_counter()
        ctx.decode([0] * n)
        return time.perf_counter() - t0

    def calibrate_draft(self, draft: Context, reps: int = 3) -> None:
        """Time the draft's one-token step and its catch-up prefill (per token), fastest of `reps`."""
        step = prefill = float("inf")
        m = max(1, min(64, draft.n_ctx - 4))  # prefilled tokens, then four steps
        draft.clear()
        draft.prefill([0] * m)  # warm-up, and the graphs for both shapes
        draft.decode([0])
        for _ in range(reps):
            draft.clear()
            t0 = time.perf_counter()
            draft.prefill([0] * m)
            draft.synchronize()
            prefill = min(prefill, (time.perf_counter() - t0) / m)
            # A draft's steps come in a row, like plain decoding (see calibrate).
            step = min(step, *(self._time_decode(draft, 1) for _ in range(4)))
        draft.clear()
        self.t_draft, self.t_catchup = step, prefill

    def observe_step(self, n: int, seconds: float) -> None:
        if n < len(self.t_step):
            self.t_step[n] = self._ewma(self.t_step[n], seconds)

    def observe_draft(self, n_tokens: int, seconds: float) -> None:
        if n_tokens > 0:
            self.t_draft = self._ewma(self.t_draft, seconds / n_tokens)

    def observe_catchup(self, n_tokens: int, seconds: float) -> None:
        if n_tokens >= 8:  # a handful of tokens is dominated by fixed costs, not the per-token rate
            self.t_catchup = self._ewma(self.t_catchup, seconds / n_tokens)

    def _ewma(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self._smooth * (new - old)

    def verify_curve(self) -> list[float]:
        """t_step(n) / t_step(1) for n = 1.., the relative cost of verifying n rows."""
        one = self.t_step[1] or 1.0
        return [t / one for t in self.t_step[1:]]


def expected_tokens(a: float, k: int) -> float:
    """Tokens emitted by a round with k drafts at per-position acceptance a (Leviathan et al.)."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class Plan:
    """Per-request speculation state: acceptance evidence, fallback, and the counters it reports."""

    config: SpeculativeConfig
    cost: CostModel
    draft_has_cost: bool
    # Tokens a costly drafter would have to prefill before it could draft (its KV cache's lag).
    lag: Callable[[], int] = lambda: 0
    # The drafter's evidence class for its next draft (drafters.Support).
    support: Callable[[], Support] = Support
    enabled: bool = True
    fallback: str | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    _evidence: dict[int, list[float]] = field(default_factory=dict)  # support key -> [accepted, rejected]
    _support: Support = field(default_factory=Support)  # the class of the draft being decided
    _spec_tokens: float = 0.0
    _spec_seconds: float = 0.0
    _spec_rounds: int = 0
    _off_until: int = 0
    _backoff: int = 0
    _idle: int = 0
    _probing: bool = False
    _drafting: bool = False  # the last decision was to draft (staying on needs no start margin)
    _since_batch: int = 0  # plain steps since the last batch (the prompt's prefill is one)

    @classmethod
    def start(cls, config: SpeculativeConfig, cost: CostModel, draft_has_cost: bool, num_predict: int) -> Plan:
        plan = cls(config, cost, draft_has_cost)
        plan._backoff = config.probe_interval
        cost.age()
        # A list: the pair's other slots may add a class while this one reads.
        for key, (succ, fail) in list(cost.evidence.items()):
            # Earlier requests' evidence, capped so this request's own rounds can still move it.
            scale = min(1.0, 64.0 / (succ + fail)) if succ + fail > 0 else 1.0
            plan._evidence[key] = [succ * scale, fail * scale]
        # A model draft known not to pay (its one class is key 0): probe late and rarely.
        if draft_has_cost and sum(cost.evidence.get(0, ())) >= 8 and plan._best_k(config.n_max) == 0:
            plan._backoff = config.probe_interval * 4
        if 0 <= num_predict < config.min_predict:
            plan.enabled = False
            plan.fallback = f"short output: num_predict {num_predict} < {config.min_predict}"
        return plan

    @property
    def _warm(self) -> bool:
        """Whether plain steps run at full speed again: two since the last batch (see t_switch)."""
        return self._since_batch >= 2

    @property
    def acceptance(self) -> float:
        """Per-position acceptance expected of the draft being decided (its support class)."""
        c = self.config
        s = self._support
        succ, fail = self._evidence.get(s.key, (0.0, 0.0))
        prior = c.acceptance_prior if s.prior is None else s.prior
        return (succ + prior * c.prior_weight) / (succ + fail + c.prior_weight)

    def _best_k(self, k_cap: int, remaining: float = float("inf")) -> int:
        """The draft length with the most expected tokens per second; 0 if plain decoding wins.

        Starting to draft takes a predicted gain of `min_gain`, staying on only beats plain: the
        model's estimates are noisy, and a pair right at break-even must not flap into losses.
        A model draft must also first prefill what it missed; starting pays only if the time the
        gain saves over the tokens still to come (at most `horizon`) covers that."""
        a = self.acceptance
        t = self.cost.t_step
        t_d = self.cost.t_draft if self.draft_has_cost else 0.0
        if t[1] <= 0:
            return 0
        plain = 1.0 / t[1]
        best_k, best_rate = 0, (1.0 if self._drafting else self.config.min_gain) * plain
        switch = self.cost.t_switch if self._warm else 0.0  # a batch now costs the warm plain steps
        for k in range(max(1, self.config.n_min), min(k_cap, len(t) - 2) + 1):
            if t[k + 1] <= 0:
                continue
            rate = expected_tokens(a, k) / (t_d * k + t[k + 1] + switch)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k and not self._drafting and self.draft_has_cost:
            saved = min(remaining, self.config.horizon) * (1.0 / plain - 1.0 / best_rate)
            if saved < self.lag() * self.cost.t_catchup:
                best_k = 0
        return best_k

    def _probe_affordable(self, k: int) -> bool:
        """Whether a probe of k tokens fits the probe budget of the target-only time since the last.

        A probe that is rejected costs the wider verify batch (on a CPU, 9 rows cost ~4-5 steps)
        and, for a model draft, the prefill of everything the draft missed (the whole prompt on a
        request's first probe) plus k draft steps. For a draft that does not pay, that is pure
        loss, so it waits for enough plain steps that it stays within `probe_budget` of them."""
        t = self.cost.t_step
        probe = t[k + 1] - t[1] + self.cost.t_switch
        if self.draft_has_cost:
            probe += self.lag() * self.cost.t_catchup + k * self.cost.t_draft
        return probe <= self.config.probe_budget * self._idle * t[1]

    def draft_length(self, produced: int, remaining: float, room: int) -> int:
        """How many tokens to draft this round; 0 means a plain target step."""
        c = self.config
        if not self.enabled or produced < self._off_until:
            return 0
        k_cap = int(min(c.n_max, remaining - 1, room, len(self.cost.t_step) - 2))
        if k_cap < c.n_min:
            return 0
        if not c.adaptive:
            return k_cap
        support = self.support()
        if support.key != self._support.key:
            self._drafting = False  # the start margin applies to each class anew
        self._support = support
        if not support.ready:  # nothing to propose: a plain step
            self._idle += 1
            self._drafting = self._probing = False
            return 0
        a = self.acceptance
        best_k = self._best_k(k_cap, remaining)
        self._drafting = best_k > 0
        if best_k > 0:
            self.fallback = None  # speculating again: `fallback` reports why it is off, if it is
        if best_k == 0:
            # The model says drafting does not pay; probe now and then so new evidence can arrive.
            # A classed (free) drafter that has drafted this request was not switched off: only
            # this class of draft is skipped, so it reports no fallback.
            if self.fallback is None and (self.draft_has_cost or not self.rounds):
                self.fallback = (
                    f"draft does not pay: acceptance {a:.2f}"
                    if self.rounds
                    else "verification too costly on this hardware"
                )
            self._idle += 1
            # A free drafter (n-gram) is not probed: its support classes carry priors, so evidence
            # arrives from the classes that look worth drafting, and a probe would only buy a wider
            # batch for a class already expected to lose.
            if self.draft_has_cost and self._idle >= self._backoff and self._probe_affordable(k_cap):
                # Probe in full so one round is real evidence (a model drafter still stops early
                # where its own confidence falls below p_min).
                self._idle = 0
                self._backoff *= 2
                self._probing = True
                return k_cap
        self._probing = False
        return best_k

    def record(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float, produced: int,
               step_seconds: float | None = None, caught_up: int = 0) -> None:
        """Account one round; drafted = 0 for a plain step. step_seconds: drafting without catch-up,
        which prefilled `caught_up` tokens."""
        warm = self._warm
        self._since_batch = self._since_batch + 1 if drafted == 0 else 0
        if drafted or warm:  # the plain steps just after a batch are t_switch's, not t_step[1]'s
            self.cost.observe_step(drafted + 1, verify_seconds)
        if step_seconds is not None:
            self.cost.observe_catchup(caught_up, draft_seconds - step_seconds)
        if drafted == 0:
            if self._probing:  # the drafter had nothing to offer: probe again next round
                self._idle = self._backoff
                self._backoff //= 2
            return
        self._probing = False
        self._idle = 0  # evidence arrived: count plain steps before the next probe anew
        self.cost.observe_draft(drafted, draft_seconds if step_seconds is None else step_seconds)
        self.cost.observe_acceptance(self._support.key, drafted, accepted)
        self.rounds += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.extend([0] * (drafted - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        ev = self._evidence.setdefault(self._support.key, [0.0, 0.0])
        ev[0] += accepted
        ev[1] += 1 if accepted < drafted else 0
        self._spec_rounds += 1
        self._spec_tokens += accepted + 1
        # A catch-up prefill is paid once, when drafting starts; whether to go on drafting must
        # not count it (it would stop drafting just as the investment starts to pay).
        self._spec_seconds += (draft_seconds if step_seconds is None else step_seconds) + verify_seconds
        if warm:  # this round started a stretch of batches, and its end will pay t_switch
            self._spec_seconds += self.cost.t_switch
        c = self.config
        if c.adaptive and self._spec_rounds >= c.fallback_rounds and self.cost.t_step[1] > 0:
            realised = self._spec_tokens / self._spec_seconds
            plain = 1.0 / self.cost.t_step[1]
            if realised < c.fallback_margin * plain:
                self.fallback = (
                    f"slower than target-only: {realised:.1f} vs {plain:.1f} tok/s "
                    f"at acceptance {self.accepted_tokens / self.draft_tokens:.2f}"
                )
                self._off_until = produced + self._backoff
                self._backoff *= 2
            self._spec_rounds = 0
            self._spec_tokens = 0.0
            self._spec_seconds = 0.0
