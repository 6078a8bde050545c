"""What speculation costs on this hardware: a pair's settings and the measured cost model.

On a GPU, scoring k+1 tokens in one pass costs about as much as scoring one; on a CPU it does not
(SmolLM2 Q4_1 on 2 cores: a batch of 4 costs ~2.4x one token, a batch of 8 ~4.1x). So the draft
length is not a constant: each round (engine.planner) picks the k that maximises

    expected tokens per round / expected seconds per round
    = (1 - a^(k+1)) / (1 - a)  /  (draft_cost(k) + t_step(k+1))

where a is the per-position acceptance observed so far for drafts of this kind (the drafter's
support class: an n-gram draft continuing a long verbatim match is not a short one's kind) and
t_step(n) is the measured time to decode n rows on the target. CostModel holds those times (and,
where a GPU makes a batch of the previous decode's shape cheaper, t_same(n)), and the acceptance
evidence per class, for all of a pair's requests.

A pass also costs more the deeper the cache it attends over. On the padded SmolLM2 target on 2
cores, 65 rows cost 1.12x, 1.37x and 1.51x their price on an empty cache at 400, 800 and 1,200
cells, and one row 1.08x, 1.25x and 1.33x. The cold cache a draft model's passes leave behind
costs nothing measurable (0.98-1.02x). So t_step is kept at one KV_BLOCK of depth and priced at
the depth a round runs at (CostModel.depth).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.engine.hosttime import HostPrice
from sidecar.engine.layout import Layout, passes, shapes
from sidecar.engine.timing import Calibration


@dataclass(frozen=True)
class Step:
    """The rest of the step a sequence's round joins (engine.step): the sequence's own id, the rows
    the other sequences put in it as (sequence id, rows), and the tokens they are expected to make.
    A lone sequence's step has no other rows, and its own stream's cells."""

    seq: int = 0
    rows: tuple[tuple[int, int], ...] = ()
    tokens: float = 0.0
    cells: int = 0  # what its passes attend over before these rows: the deepest stream's cells


ALONE = Step()


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
    min_gain: float = 1.05  # predicted speed-up to start drafting (keeping on alone needs > 1)
    horizon: int = 512  # tokens a request without num_predict is assumed to have left
    acceptance_prior: float = 0.7  # per-position acceptance assumed before any evidence
    prior_weight: float = 0.5  # weak: on a CPU only near-certain acceptance pays, so evidence must rule
    adaptive: bool = True  # False: always draft n_max (llama.cpp's fixed draft length), no fallback


DRAFT_BESIDE = 0.5
"""What one more sequence's row adds to a draft step before any were made together, as a share of a
lone draft step (CostModel.draft_beside)."""

SHARED_MIN, SHARED_MAX = 0.5, 3.0
"""The range a shared step's learnt cost factors (CostModel.shared, .beside) are held in: one decode
a busy machine slowed must not price every shared step at ten times the curve."""

KV_BLOCK = 256
"""llama.cpp sizes the cache a pass attends over by its deepest stream's cells, padded to this
(`llama_kv_cache::get_n_kv`, src/llama-kv-cache.cpp), so a pass's price rises a block at a time."""

BESIDE_FADE = 0.02
"""How far each plain shared step brings `CostModel.beside` back toward 1 (the curve's own price).
It is learnt only from decodes that hold a pass of one stream (a draft's rows past the others'), so
a price learnt high would otherwise stay so for good once it priced every draft out: at N = 8 on
2 cores a row is near a plain token's price, and after a cold repetition's few drafts an n-gram
daemon drafted nothing in its next 16 requests ("verification too costly"), where another drafted
110-125 tokens of each. From 2, about 65 plain steps bring it under 1.27."""

DEPTH_MAX = 0.5
"""The most one more KV_BLOCK may add to a pass, as a share of its price at one block: what one-row
steps at several depths say is held here, as SHARED_MAX holds the shared steps' factors."""

NGRAM_N_MAX = 64
"""An n-gram pair's default n_max, llama.cpp's ngram-mod's: its drafts cost nothing to make, a
copied stretch runs long, and on a CPU a wide batch costs less per row (SmolLM2 on 2 cores, all
accepted: 13 rows give 1.73x, 33 rows 2.04x, 65 rows 2.19x). The planner drafts that far only
where a class's acceptance is near-certain (bench/rounds.py)."""


class CostModel(Calibration):
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
        # Seconds per n rows right after a decode of n rows, where that is measurably cheaper than
        # t_step (a GPU replays the graph it captured for that shape); empty where it is not (a CPU).
        self.t_same: list[float] = []
        # What a pass over several sequences' KV streams costs over the curve's price of as many
        # rows of one stream: llama.cpp attends per stream, which costs more than one stream's
        # batch (SmolLM2 on 2 cores: four streams' plain rows 3.1 one-row steps, against 2.5 for
        # four rows of one). Learnt from shared steps (observe_shared); 1 until one ran.
        self.shared = 1.0
        # What a pass of one stream costs beside other sequences' rows over the curve's price at
        # the step's depth (a draft's rows past the others', which a shared step's cache slows).
        self.beside = 1.0
        # What one more sequence's row adds to a draft step, as a share of a lone draft step
        # (t_draft): the draft model's passes carry every sequence drafting with it
        # (drafters.propose_together). SmolLM2 on 2 cores: a row on each of two streams 17.9 ms,
        # one 11.7 ms (0.53). Learnt from the drafts made together (observe_draft); this until then.
        self.draft_beside = DRAFT_BESIDE
        # What one more KV_BLOCK of cache adds to a pass, as a share of its price at one block (where
        # calibrate times the curve). t_step holds prices at one block, and a pass is priced at the
        # depth it attends over (`_at`): a request's plain steps keep the one-row price current as
        # it grows, but its wide rows run now and then, and a curve learnt at mixed depths priced
        # them as on an empty cache (a hybrid's model rounds on the padded target: 1.14-1.29x).
        # Learnt from one-row steps, which run at every depth (`_learn_depth`); 0 until some have.
        self.depth = 0.0
        self._plain_at: dict[int, float] = {}  # blocks -> a one-row step's seconds (moving average)
        # The pair's acceptance across requests (decayed) per (source, class) (rounds.Key), so a
        # new request starts from what this draft has shown rather than from the prior, and a
        # known-bad draft is rarely probed.
        self.evidence: dict[tuple[str, int], list[float]] = {}  # rounds.Key -> [accepted, rejected]
        # Plain steps (in wall time) the pair's requests ran since a model draft last gave evidence:
        # what probing it may spend a share of (probing.Probing.due), across requests.
        self.unprobed = 0.0
        self.explored: set[str] = set()  # costly sources probed once already, evidence or not
        # The load's prices as shares of its one-row step (anchor): t_step, t_draft, t_catchup.
        self._quiet: tuple[list[float], float, float] | None = None
        # What the host's work costs a step (engine.hosttime): the step loop the pair's requests
        # run in fits it and hands it over (StepLoop.add); 0 until then (a plain Decoder, tests).
        self.host = HostPrice()
        self.set_provisional(False)  # provisional: the load-time measurement looked disturbed (calibrate)
        self.calibration_seconds = 0.0
        # (a step's others' rows, its cells, the curve priced by, their decode's price, (seq, n) ->
        # what n rows add): a round prices many draft lengths, from each ready source, against one step.
        self._others: tuple[object, int, object, float, dict[tuple[int, int], float]] = ((), 0, None, 0.0, {})
        # `batch`'s layouts at the curve's price (`_sums`: the passes that span several streams and
        # those of one, split and padded), by layout and KV block (the exact depth near a block's
        # end), at the curve and slope in `_basis`. Each sequence of a step prices its candidate
        # drafts beside the others' rows, and whichever stream drafts, those are mostly the same
        # passes (the others' plain rows, then the draft's own), step after step. The factors
        # (`shared`, `beside`) move with every shared decode, so they are applied after the cache.
        self._priced: dict[tuple[Layout, int], tuple[float, float, float, float]] = {}
        self._basis: tuple[object, float] = (None, 0.0)

    def age(self, factor: float = 0.9) -> None:
        """Fade every class's evidence a little (once per request): a class judged not to pay is
        never drafted, so no evidence of its own would ever revive it; its prior gets to, in time."""
        for ev in list(self.evidence.values()):
            ev[0] *= factor
            ev[1] *= factor

    def _at(self, m: int, cells: int = 0) -> float:
        """Seconds of one pass over m rows after `cells` (see `depth`); wider than the measured
        curve: along its last slope."""
        t = self.t_step
        last = len(t) - 1
        return (t[m] if m <= last else t[last] + (m - last) * (t[last] - t[last - 1])) * self._level(cells + m)

    def _level(self, cells: int) -> float:
        """A pass attending over `cells` against one over a single KV_BLOCK."""
        return 1.0 + self.depth * (blocks(cells) - 1)

    def batch(self, rows: Sequence[tuple[int, int]], cells: int = 0) -> float:
        """Seconds of one decode holding several sequences' rows, `rows` as (sequence id, rows), in
        the cheaper of its two layouts (`padded`), after `cells` (Step.cells)."""
        return min(self._layouts(rows, cells))

    def padded(self, rows: Sequence[tuple[int, int]], cells: int = 0) -> bool:
        """Whether the decode is cheaper with every sequence's rows padded to the widest of its run
        of consecutive ids, so each run is one pass (pad rows are copies of a sequence's pending
        token, never read and rolled back: engine.sequence). Where rows cost little next to a pass
        (a GPU) it is; on a CPU, where each row costs about as much as the pass's fixed part, a
        lone draft is cheaper in a pass of its own."""
        split, padded = self._layouts(rows, cells)
        return padded < split

    def _layouts(self, rows: Sequence[tuple[int, int]], cells: int) -> tuple[float, float]:
        """Seconds of the decode split and padded. A pass over several streams costs `shared` times
        what the curve (one stream's rows) says, and a pass of one stream beside others `beside`
        times; where the decode holds one sequence's rows only, the curve's price."""
        layout = shapes(rows)
        basis = (self.t_step, self.depth)
        if basis != self._basis or len(self._priced) > PRICED_MAX:
            self._priced, self._basis = {}, basis
        # A pass's price moves with the depth only by the KV blocks it attends over (`_level`): where
        # every pass ends in the block the step starts in, any depth in that block prices alike,
        # so the sums hold for the steps of a block, not only for one step's candidates.
        split, padded, several, widest = layout
        block, into = divmod(cells, KV_BLOCK)
        key = (layout, ~block if into + widest <= KV_BLOCK else cells)
        got = self._priced.get(key)
        if got is None:
            got = self._priced[key] = (*self._sums(split, cells), *self._sums(padded, cells))
        spans, ones, padded_spans, padded_ones = got
        alone = self.beside if several else 1.0
        return spans * self.shared + ones * alone, padded_spans * self.shared + padded_ones * alone

    def _sums(self, layout: Sequence[tuple[int, int]], cells: int) -> tuple[float, float]:
        """A decode's passes at the curve's price after `cells`: those that span several streams,
        and those of one."""
        spans = ones = 0.0
        for m, streams in layout:
            if streams > 1:
                spans += self._at(m, cells)
            else:
                ones += self._at(m, cells)
        return spans, ones

    def observe_shared(self, rows: Sequence[tuple[int, int]], seconds: float, cells: int = 0) -> None:
        """A decode of several sequences' rows, as (sequence id, rows) as decoded, took `seconds`:
        what its passes cost beyond the curve's price of their rows.

        llama.cpp times the decode as one sum over its passes, so each factor is learnt where it
        can be told apart: `shared` from decodes whose every pass spans several streams (every
        sequence's plain row, or drafts padded to one width); `beside` from those with passes of
        one stream too (a draft's rows past the others'), given `shared`; the decodes without
        such a pass bring `beside` back toward the curve a little (BESIDE_FADE). Both are over the
        curve's price at the step's depth (`cells`, the deepest stream's); a lone sequence's
        rounds correct the curve as they go, but a shared step's time says nothing about one of
        its passes (one learnt factor for both read 2.7 where the shared passes' alone was 1.2)."""
        spanning, alone = self._sums(passes(rows), cells)
        if alone <= 0 < spanning:
            self.shared += self._smooth * (_bounded(seconds / spanning) - self.shared)
            self.beside += BESIDE_FADE * (1.0 - self.beside)  # no evidence of its own here (BESIDE_FADE)
        elif alone > 0:
            self.beside += self._smooth * (_bounded((seconds - spanning * self.shared) / alone) - self.beside)
        else:  # nothing measured yet
            return
        self._others = ((), 0, None, 0.0, {})  # the rows' prices at the old factors (the sums hold)

    def _repriced(self) -> None:
        """Drop the prices cached at the old curve or depth slope (t_step moves in place)."""
        self._others = ((), 0, None, 0.0, {})
        self._priced = {}

    def added(self, n: int, step: Step | None = None) -> float:
        """Seconds that n rows add to a decode the other sequences of `step` already fill (see
        `batch`): a sequence is priced by what it adds to a shared step. Alone: t_step(n) at its depth."""
        if step is None:
            return self._at(n)
        if not step.rows:
            return self._at(n, step.cells)
        o = self._others
        if o[0] is not step.rows or o[1] != step.cells or o[2] is not self.t_step:
            self._others = o = (step.rows, step.cells, self.t_step, self.batch(step.rows, step.cells), {})
        _, _, _, others, added = o
        got = added.get((step.seq, n))
        if got is None:
            got = added[(step.seq, n)] = self.batch((*step.rows, (step.seq, n)), step.cells) - others
        return got

    def shares(self, n: int, step: Step, seconds: float) -> tuple[float, float, float]:
        """How a shared decode's `seconds` fall to a sequence whose n rows joined the others' of
        `step`: its rows' share (what they add to the others' rows, at this decode's scale), the
        share a plain row of its would have had in the same decode, and the seconds a token of
        that decode had cost had the sequence stepped plain (the step's plain rate, inverted).

        llama.cpp times the decode as one sum, so prices split it. A sequence whose stream fills
        the gap between two others' merges their passes, so by price its rows may add less than
        nothing; a share is never below zero."""
        total = self.batch((*step.rows, (step.seq, n)), step.cells)
        if total <= 0:
            return seconds, 0.0, 0.0
        scale = seconds / total
        plain = self.added(1, step)
        per_token = scale * (self.batch(step.rows, step.cells) + plain) / (step.tokens + 1.0)
        return max(0.0, scale * self.added(n, step)), max(0.0, scale * plain), per_token

    def observe_acceptance(self, key: tuple[str, int], drafted: int, accepted: int) -> None:
        ev = self.evidence.setdefault(key, [0.0, 0.0])
        ev[0] = ev[0] * 0.98 + accepted
        ev[1] = ev[1] * 0.98 + (1.0 if accepted < drafted else 0.0)

    def set_provisional(self, provisional: bool) -> None:
        """A provisional model follows what rounds really cost faster, so the online estimates
        replace a disturbed measurement within a few rounds."""
        self.provisional = provisional
        self._smooth = 0.5 if provisional else 0.2
        self._observed: set[int] = set()  # batch sizes decoded since it turned provisional

    def observe_step(self, n: int, seconds: float, same: bool = False, cells: int = 0) -> None:
        """A decode of n rows after `cells` took `seconds`; `same`: right after a decode of n rows.

        A provisional curve was measured on a busy machine (or is the prior scaled to one step):
        its level is what is wrong, not its shape. So while it is provisional, a one-row step moves
        the sizes not decoded since by the same factor. Otherwise a load on a busy machine left a
        steep curve behind once the machine was quiet again (fast one-row steps beside slow batch
        prices), no draft looked worth a batch, and no batch ever came to correct it."""
        table = self.t_same if same and n > 1 and self.t_same else self.t_step
        if n >= len(table):
            return
        self._repriced()  # prices cached against the old curve
        if table is self.t_step:
            if n == 1:
                self._learn_depth(cells + 1, seconds)
            seconds /= self._level(cells + n)  # t_step is kept at one block
        old = table[n]
        table[n] = self._ewma(old, seconds)
        if self.provisional and table is self.t_step:
            self._observed.add(n)
            if n == 1 and old > 0.0:
                scale = table[1] / old
                for m in range(2, len(table)):
                    if m not in self._observed:
                        table[m] *= scale

    def _learn_depth(self, cells: int, seconds: float) -> None:
        """A one-row step attending over `cells` took `seconds`: `depth` is the slope, per block, of
        those steps' moving averages at each depth against one block's (least squares).

        Where prices are asked at a depth they were learnt at, the slope cancels out (they are
        stored divided by the level they are priced at), so a slope that also holds a change in
        the machine's speed between depths errs only where a price is carried to another depth.
        One row's slope is below a wide pass's on a CPU (above); the wide rows' own rounds
        correct what is left, as they corrected the whole of it before."""
        b = blocks(cells)
        self._plain_at[b] = self._ewma(self._plain_at.get(b, 0.0), seconds)
        base = self._plain_at.get(1, 0.0)
        deeper = [(k - 1, t / base - 1.0) for k, t in self._plain_at.items() if k > 1] if base > 0 else []
        if deeper:
            slope = sum(x * y for x, y in deeper) / sum(x * x for x, _ in deeper)
            self.depth = min(DEPTH_MAX, max(0.0, slope))

    def anchor(self) -> None:
        """Keep the prices as measured at load, as shares of its one-row step, to price probes by.

        Learnt prices move only where their rows or draft run. A disturbance (one busy core made
        every step here 100x slower, README: libgomp) left a hybrid's model draft and wide rows
        priced far above their cost once the machine was quiet again; plain steps brought back
        the one-row step alone, and a draft priced out never ran to correct the rest: its model
        stayed off for four requests. A probe is the measurement that corrects it, so it is priced
        at the cheaper of the learnt prices and the load's at today's one-row step (probe_seconds),
        and one that finds the draft at under half its learnt price restarts from the load's.
        Its one-row step is also the one-block step that `depth` is learnt against."""
        if (t1 := self.t_step[1]) > 0:
            self._quiet = ([t / t1 for t in self.t_step], self.t_draft / t1, self.t_catchup / t1)
            # The one-row step at one block (calibrate times it on a fresh cache), even where the
            # curve is provisional (a wide curve whose sizes did not all fit the budget); on a busy
            # machine it is the fastest of a few steps, and too high a base prices depth at 0.
            self._plain_at.setdefault(1, t1)

    def probe_seconds(self, k: int, lag: int) -> float:
        """What a probe drafting k tokens costs, `lag` tokens behind: the rows past a plain step's,
        the catch-up, the draft steps and what a batch costs the warm plain steps (t_switch)."""
        prices = [(self.t_step, self.t_draft, self.t_catchup)]
        if self._quiet is not None:
            prices.append(self._at_load())
        return min(t[k + 1] - t[1] + lag * catchup + k * draft for t, draft, catchup in prices) + self.t_switch

    def recover(self, draft_seconds: float) -> None:
        """A probe's draft took `draft_seconds` a token: under half the learnt price, the learnt
        prices are a disturbance's, and they restart from the load's (anchor) at today's step."""
        if self._quiet is not None and draft_seconds < 0.5 * self.t_draft:
            self.t_step[:], self.t_draft, self.t_catchup = self._at_load()
            self._repriced()  # prices cached against the old curve

    def _at_load(self) -> tuple[list[float], float, float]:
        """The load's t_step, t_draft and t_catchup (anchor) at today's one-row step."""
        (shares, draft, catchup), t1 = self._quiet, self.t_step[1]  # type: ignore[misc]
        return [s * t1 for s in shares], draft * t1, catchup * t1

    def observe_draft(self, n_tokens: int, seconds: float, company: float = 1.0) -> None:
        """A draft of `n_tokens` that took `seconds`: alone, a price of the lone draft step; made
        with others' (an even share of passes that carried `company` rows on average), what a row
        beside others adds (`draft_beside`), the lone step's price staying as it is."""
        if n_tokens <= 0:
            return
        per = seconds / n_tokens
        if company <= 1.0 or self.t_draft <= 0:
            self.t_draft = self._ewma(self.t_draft, per)
        else:
            beside = (per * company / self.t_draft - 1.0) / (company - 1.0)
            self.draft_beside = self.draft_beside + self._smooth * (min(1.0, max(0.0, beside)) - self.draft_beside)

    def draft_step(self, rows: int) -> float:
        """What a draft step carrying `rows` sequences' rows costs (engine.together)."""
        return self.t_draft * (1.0 + self.draft_beside * max(0, rows - 1))

    def observe_catchup(self, n_tokens: int, seconds: float) -> None:
        if n_tokens >= 8:  # a handful of tokens is dominated by fixed costs, not the per-token rate
            self.t_catchup = self._ewma(self.t_catchup, seconds / n_tokens)

    def _ewma(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self._smooth * (new - old)

    def verify_curve(self) -> list[float]:
        """t_step(n) / t_step(1) for n = 1.., the relative cost of verifying n rows."""
        one = self.t_step[1] or 1.0
        return [t / one for t in self.t_step[1:]]


PRICED_MAX = 4096
"""Layouts CostModel.batch keeps priced: a KV block's worth of steps, and the steps near a block's end."""


def blocks(cells: int) -> int:
    """The KV_BLOCKs a pass over `cells` attends over (one at least)."""
    return -(-max(cells, 1) // KV_BLOCK)


def _bounded(factor: float) -> float:
    return min(SHARED_MAX, max(SHARED_MIN, factor))


MIN_HOLD = 1e-3
"""Draft lengths are weighed until a row adds fewer expected tokens than this: the chance that a
draft holds that far only falls with its length, so no longer draft can pay for its rows (a
sequence weighs up to ~24 lengths per source and step, each priced against the whole step)."""


def draft_lengths(lo: int, hi: int) -> list[int]:
    """The draft lengths a round weighs: every one up to 12, then a sparser ladder up to `hi`.

    A free source's copy may run to 64 tokens (NGRAM_N_MAX), where one length more or less changes
    the expected rate by little; weighing every one would cost each sequence ~64 prices per step."""
    return [k for k in (*range(1, 13), 16, 20, 24, 28, 32, 40, 48, 56, 64) if lo <= k < hi] + ([hi] if hi >= lo else [])


def expected_tokens(a: float, k: int) -> float:
    """Tokens emitted by a round with k drafts at per-position acceptance a (Leviathan et al.)."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def round_seconds(k: int, t_draft: float, t_rows: float, switch: float = 0.0) -> float:
    """What a round drafting k tokens costs: k draft steps (0 for a free source), the rows it
    decodes on the target, and what a batch costs the warm plain steps (t_switch). The one price
    of a round: the planner ranks drafts by it and the pairing probe predicts speed-ups with it."""
    return t_draft * k + t_rows + switch
