"""One schedule per step: which sequence drafts how many tokens from which source.

Each decoding sequence offers a menu (engine.sequence, `Sequence.menu`): for each source that has a
draft ready, the tokens a round is expected to emit at each draft length k (k = 0 is one, a plain
row), drawn from the evidence (engine.evidence), whether the draft model makes it, and the catch-up
that model owes. `schedule` picks every sequence's (source, k) at once, maximising the step's
expected tokens per second, where a step costs the device's seconds (engine.cost, by its layout)
plus the host's (engine.hosttime: a fixed part, per sequence, per token, per drafting sequence and
per drafted row) plus the draft model's steps (which every sequence drafting from it shares).

Constraints:
- no stream's progress may fall below (1 - slack) of what the all-plain step gives it: a step
  that carries drafts may take at most 1 / (1 - slack) of the plain step's seconds per token
  its slowest stream makes (a plain stream makes one). On a CPU, where a row costs ~0.4 of a
  step, one stream's copy beside seven plain streams is then not taken; on a GPU, where rows
  cost little beside the pass, it is;
- each sequence's draft fits its window and the step's n_batch (`Menu.room`);
- the step as a whole must beat the plain step by `need` (SpeculativeConfig.min_gain; 1 where
  the last step drafted: hysteresis, so a pair at break-even does not flap).

The search is greedy over sequences: every sequence's every option and length is priced at once
(numpy, one matrix), the best upgrade is taken, and the others are priced again against it,
until no upgrade raises the step's rate. A catch-up is charged in proportion to the share of the
request's remaining tokens this round makes (pay as you go), so a model draft starts where its
gain over the rest of the request repays its catch-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from sidecar.engine.cost import CostModel, blocks
from sidecar.engine.hosttime import HostPrice


@dataclass(frozen=True)
class Option:
    """One source's draft for a sequence's round: `expected[k]`, the tokens a round drafting k
    emits (expected[0] = 1); `model`, drafted by the draft model, which first prefills `lag`
    tokens it missed, repaid over `future` tokens the request may still make. Model drafts of one
    `group` (a pair's draft context) share their draft steps."""

    source: int
    expected: np.ndarray
    model: bool = False
    lag: int = 0
    future: float = 1.0
    group: int = 0


@dataclass(frozen=True)
class Menu:
    """What a decoding sequence offers the step: its options (none: it steps plain) and the most
    tokens it may draft (its window's room, the step's n_batch)."""

    sid: int
    options: tuple[Option, ...] = ()
    room: int = 0


@dataclass(frozen=True)
class Choice:
    """A sequence's round in the step: draft k tokens from source `source` (k = 0: plain)."""

    source: int = 0
    k: int = 0
    expected: float = 1.0


PLAIN = Choice()


@dataclass
class Plan:
    """The step's schedule as a value: each drafting sequence's choice (the rest step plain), the
    step's price and the expected tokens, and the all-plain step's price."""

    choices: dict[int, Choice] = field(default_factory=dict)
    seconds: float = 0.0
    tokens: float = 0.0
    plain: float = 0.0


def schedule(menus: list[Menu], cost: CostModel, host: HostPrice, cells: int, slack: float, need: float,
             budget: int, changed: bool = False) -> Plan:
    """Each sequence's round for a step of these menus (module docstring). `cells`: the deepest
    stream's KV cells; `budget`: the drafted rows n_batch leaves beside every sequence's plain
    row; `changed`: the plain step's layout differs from the last decode's."""
    n = len(menus)
    w = cost.device.w  # passes, rows, prefill, attention, changed
    d = cost.draft.w  # steps, rows, catchup
    w0, d0 = float(w[0]), float(d[0])
    row = float(w[1] + w[3] * blocks(cells + 1))  # a row's device price at this depth
    rest = float(w[4] * changed + host.fixed + (host.seq + host.token) * n)  # but the passes and rows
    plain = float(w[0] + n * row) + rest
    out = Plan(seconds=plain, tokens=float(n), plain=plain)
    # (menu index, menu, option) of every option with a draft to offer
    rows = [(s, m, o) for s, m in enumerate(menus) if m.room > 0 for o in m.options if len(o.expected) > 1]
    if not rows or plain <= 0:
        return out
    tops = [min(m.room, len(o.expected) - 1) for _, m, o in rows]
    if n == 1 and not any(_may_pay(o.expected[: t + 1], plain, row + d0 * o.model)
                          for (_, _, o), t in zip(rows, tops, strict=True)):
        return out
    k_max = max(tops)
    ks = np.arange(k_max + 1)
    # Tokens beyond a plain row's one; -inf at k = 0 (no upgrade) and past an option's end.
    gain = np.full((len(rows), k_max + 1), -np.inf)
    for r, ((_, _, o), top) in enumerate(zip(rows, tops, strict=True)):
        gain[r, 1 : top + 1] = o.expected[1 : top + 1]
    gain -= 1.0
    # A round's own seconds, all but the passes, rows and draft steps: its rows' host work and the
    # host's work on the tokens it emits beyond a plain row's.
    emitted = np.maximum(gain, 0.0)
    own = host.drafting + ks * host.row + host.token * emitted
    model = [o.model for _, _, o in rows]
    models = any(model)
    if models:
        # A model draft's also: its rows in the draft steps, and the catch-up's share this round
        # makes of what is left (a length past its end is priced at its last: its gain is -inf).
        flags = np.array(model)
        mr = np.flatnonzero(flags)
        made = np.array([(ex := rows[r][2].expected[: tops[r] + 1].tolist()) + ex[-1:] * (k_max - tops[r])
                         for r in mr])
        share = np.minimum(1.0, made / np.array([[max(rows[r][2].future, 1.0)] for r in mr]))
        lag = np.array([[d[2] * rows[r][2].lag] for r in mr])
        own[mr] = host.drafting + ks * host.row + ks * d[1] + lag * share + host.token * emitted[mr]
    group = [o.group for _, _, o in rows]
    seq = [s for s, _, _ in rows]
    first = float(w[4] * (not changed))  # the first draft changes the plain step's layout
    # Each sequence's rows (contiguous in `rows`) and, per length, the row of its best option there
    # (what a joint upgrade takes): fixed, as an upgrade closes a whole sequence.
    span: dict[int, tuple[int, int]] = {}
    for r, s in enumerate(seq):
        span[s] = (span.get(s, (r, r))[0], r + 1)
    at = {s: i for i, s in enumerate(span)}
    best_rows: np.ndarray | None = None  # None: one option a sequence, its best at every length
    best_gain, best_own = gain, own
    if len(span) < len(rows):
        best_rows = np.array([a + gain[a:b].argmax(axis=0) for a, b in span.values()])
        best_gain, best_own = gain[best_rows, ks], own[best_rows, ks]
    # A row's device price by the rows a decode carries (`split`), and the padded decode's by its longest draft.
    row_at = row * np.arange(n + len(span) * k_max + 1)
    padded_at = w0 + row * n * (ks + 1)

    def device(drafted: int, longest: int, widths: int) -> float:
        """The decode's passes and rows, split (a pass per width beside the plain rows, as
        llama.cpp's split peels a run of streams) or padded to the longest draft (one pass), the
        cheaper (the step loop pads where that is cheaper)."""
        return min(w0 * (1 + widths * (n > 1)) + row * (n + drafted), w0 + row * n * (longest + 1))

    def devices(drafted: int, each: int, longest: int, widths: set[int]) -> np.ndarray:
        """`device` for every length k of the upgrade: `each` sequences drafting k more beside
        `drafted` rows, whose lengths take `widths`."""
        wide = len(widths) + 1  # widths at a length no draft has yet
        split = w0 * (1 + wide * (n > 1)) + row_at[n + drafted : n + drafted + each * k_max + 1 : each]
        for k in widths:
            split[k] = w0 * (1 + (wide - 1) * (n > 1)) + row_at[n + drafted + each * k]
        padded = padded_at
        if longest:
            padded = padded_at.copy()
            padded[:longest] = padded_at[longest]
        return np.minimum(split, padded)

    def price(sel: dict[int, int]) -> float:
        """The step's seconds with rows `sel` (row of `rows` -> k) drafting."""
        if not sel:
            return plain
        steps: dict[int, int] = {}
        for r, k in sel.items():
            if model[r]:
                steps[group[r]] = max(steps.get(group[r], 0), k)
        ks_sel = sel.values()
        dev = device(sum(ks_sel), max(ks_sel), len(set(ks_sel)))
        return float(rest + first + dev + sum(float(own[r, k]) for r, k in sel.items()) + d0 * sum(steps.values()))

    # Greedy: take the upgrade that most raises the step's tokens per second, and price the rest
    # against it, until none does; drafts fit `budget`. An upgrade is one sequence's round, or
    # every open sequence drafting the same length (rows that share a width share a pass, and
    # model drafts share their draft steps: each alone may not pay where all together do).
    sel: dict[int, int] = {}
    tokens, seconds = float(n), plain
    live = gain.copy()  # the open sequences' gains: a taken sequence's rows are -inf
    alive = sorted(span)  # the open sequences
    while alive:
        ks_sel = list(sel.values())
        drafted, longest, widths = sum(ks_sel), max(ks_sel, default=0), set(ks_sel)
        base = seconds - device(drafted, longest, len(widths)) - (first if sel else 0.0)
        t = base + first + own
        steps_made = {group[r]: k for r, k in sel.items() if model[r]}
        if models:
            made_k = np.array([[steps_made.get(g, 0)] for g in group])
            t += np.where(flags[:, None], np.maximum(0, ks[None, :] - made_k) * d0, 0.0)
        t += devices(drafted, 1, longest, widths)
        e = tokens + live
        if budget < k_max:
            e[:, max(budget + 1, 0) :] = -np.inf  # past the budget
        rate = e / t
        r, k = divmod(int(rate.argmax()), k_max + 1)
        best = float(rate[r, k])
        # Every open sequence at one length, each by its best option there, in menu order.
        joint = list(alive)
        joint_rate, joint_k = -np.inf, 0
        if len(joint) > 1:
            members = [at[s] for s in joint]
            if members == list(range(len(span))):  # all, in order (the first upgrade): no copies
                g, o = best_gain.sum(axis=0), best_own.sum(axis=0)
            else:
                g, o = best_gain[members].sum(axis=0), best_own[members].sum(axis=0)
            jt = base + first + o
            if models:
                shared = np.maximum(0, ks - max(steps_made.values(), default=0)) * d0
                drafting = flags[members][:, None] if best_rows is None else flags[best_rows[members]]
                jt += np.where(drafting.any(axis=0), shared, 0.0)
            jt += devices(drafted, len(joint), longest, widths)
            jr = (tokens + g) / jt
            if budget < len(joint) * k_max:
                jr[max(budget // len(joint) + 1, 0) :] = -np.inf  # past the budget
            joint_k = int(jr.argmax())
            joint_rate = float(jr[joint_k])
        if max(best, joint_rate) <= tokens / seconds or not math.isfinite(max(best, joint_rate)):
            break
        takes = [(r, k)]
        if joint_rate > best:
            takes = [(span[s][0] if best_rows is None else int(best_rows[at[s], joint_k]), joint_k) for s in joint]
        for r, k in takes:
            sel[r] = k
            tokens += float(gain[r, k])
            budget -= k
            a, b = span[seq[r]]
            live[a:b] = -np.inf
            alive.remove(seq[r])
        seconds = price(sel)

    def slowest(sel: dict[int, int]) -> float:
        """The fewest tokens a stream makes in the step: a plain one's, or the least drafted."""
        return min([1.0] * (n > len(sel)) + [1.0 + float(gain[r, k]) for r, k in sel.items()])

    # No stream below (1 - slack) of its plain progress: take back the draft that buys least.
    bound = plain / (1.0 - slack)
    while sel and seconds > slowest(sel) * bound:
        del sel[min(sel, key=lambda r: float(gain[r, sel[r]]))]
        seconds = price(sel)
    tokens = n + sum(float(gain[r, k]) for r, k in sel.items())
    if sel and tokens / seconds >= need * n / plain:
        out.choices = {rows[r][1].sid: Choice(rows[r][2].source, k, 1.0 + float(gain[r, k])) for r, k in sel.items()}
        out.seconds, out.tokens = seconds, tokens
    return out


def _may_pay(expected: np.ndarray, plain: float, per_token: float) -> bool:
    """Whether one stream's draft may beat its plain step at some length k: a step drafting k costs
    at least the plain step and k rows (and, from a model, k draft steps) at `per_token` each, all
    else it adds (host, catch-up, a changed layout) being no less than 0, and a draft is taken only
    where the step's rate reaches the plain one (`need` >= 1). So the k tokens it adds beyond one
    must at least pay for k rows at the plain rate. A pair whose drafts do not pay (SmolLM2
    drafted by its own first 8 layers: acceptance near 0) stops its steps' schedule here, before
    the matrices: ~0.1 ms a step on this CPU, where a step costs ~8 ms."""
    k = np.arange(1, len(expected))
    return bool(((expected[1:] - 1.0) * plain >= k * per_token).any())
