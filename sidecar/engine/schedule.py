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
    row = float(w[1] + w[3] * blocks(cells + 1))  # a row's device price at this depth
    rest = float(w[4] * changed + host.fixed + (host.seq + host.token) * n)  # but the passes and rows
    plain = float(w[0] + n * row) + rest
    out = Plan(seconds=plain, tokens=float(n), plain=plain)
    rows = [(m, o) for m in menus for o in m.options if m.room > 0 and len(o.expected) > 1]
    if not rows or plain <= 0:
        return out
    k_max = max(min(m.room, len(o.expected) - 1) for m, o in rows)
    ks = np.arange(k_max + 1)
    gain = np.full((len(rows), k_max + 1), -np.inf)  # tokens beyond a plain row's one
    own = np.zeros((len(rows), k_max + 1))  # a round's own seconds: all but the passes, rows and draft steps
    model = np.zeros(len(rows), dtype=bool)
    group = np.zeros(len(rows), dtype=np.int64)
    seq = np.zeros(len(rows), dtype=int)
    ids = {m.sid: i for i, m in enumerate(menus)}
    for r, (m, o) in enumerate(rows):
        top = min(m.room, len(o.expected) - 1)
        gain[r, 1 : top + 1] = o.expected[1 : top + 1] - 1.0
        extra = host.drafting + ks * host.row  # its rows' host work
        if o.model:
            # Its rows in the draft steps, and the catch-up's share this round makes of what is left.
            # (A length past this menu's end is priced at its last: the gain there is -inf anyway.)
            made = np.pad(o.expected[: top + 1], (0, k_max - top), mode="edge")
            share = np.minimum(1.0, made / max(o.future, 1.0))
            extra = extra + ks * d[1] + d[2] * o.lag * share
            model[r], group[r] = True, o.group
        own[r] = extra + host.token * np.append(0.0, gain[r, 1:].clip(min=0))
        seq[r] = ids[m.sid]
    gain[:, 0] = -np.inf
    first = w[4] * (not changed)  # the first draft changes the plain step's layout

    def device(drafted: np.ndarray, longest: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """The decode's passes and rows, split (a pass per width beside the plain rows, as
        llama.cpp's split peels a run of streams) or padded to the longest draft (one pass), the
        cheaper (the step loop pads where that is cheaper)."""
        split = w[0] * (1 + widths * (n > 1)) + row * (n + drafted)
        padded = w[0] + row * n * (longest + 1)
        return np.minimum(split, padded)

    def price(sel: dict[int, int]) -> float:
        """The step's seconds with rows `sel` (row of `rows` -> k) drafting."""
        if not sel:
            return plain
        steps: dict[int, int] = {}
        for r, k in sel.items():
            if model[r]:
                steps[int(group[r])] = max(steps.get(int(group[r]), 0), k)
        dev = device(np.array(sum(sel.values())), np.array(max(sel.values())), np.array(len(set(sel.values()))))
        return float(rest + first + dev + sum(float(own[r, k]) for r, k in sel.items()) + d[0] * sum(steps.values()))

    # Greedy: take the upgrade that most raises the step's tokens per second, and price the rest
    # against it, until none does; drafts fit `budget`. An upgrade is one sequence's round, or
    # every open sequence drafting the same length (rows that share a width share a pass, and
    # model drafts share their draft steps: each alone may not pay where all together do).
    sel: dict[int, int] = {}
    tokens, seconds = float(n), plain
    open_ = np.ones(len(rows), dtype=bool)
    while open_.any():
        ks_sel = list(sel.values())
        drafted, longest = sum(ks_sel), max(ks_sel, default=0)
        widths = np.array([len(set(ks_sel) | {int(k)}) for k in ks])
        steps_made = {int(group[r]): k for r, k in sel.items() if model[r]}
        made = np.array([steps_made.get(int(g), 0) for g in group])[:, None]
        steps = np.where(model[:, None], np.maximum(0, ks[None, :] - made) * d[0], 0.0)
        now = device(np.array(drafted), np.array(longest), np.array(len(set(ks_sel))))
        base = seconds - now - (first if sel else 0.0)
        t = base + first + own + steps + device(drafted + ks, np.maximum(longest, ks), widths)[None, :]
        e = tokens + gain
        ok = open_[:, None] & np.isfinite(gain) & (ks <= budget)[None, :]
        rate = np.where(ok, e / t, -np.inf)
        r, k = (int(i) for i in np.unravel_index(int(np.argmax(rate)), rate.shape))
        best = float(rate[r, k])
        # Every open sequence at one length, each by its best option there.
        pick = {}
        for s_ in set(seq[open_].tolist()):
            cand = np.flatnonzero(open_ & (seq == s_))
            pick[s_] = cand[np.argmax(gain[cand], axis=0)]  # per k, the row of that sequence's best option
        joint_rate, joint_k = -np.inf, 0
        if len(pick) > 1:
            members = np.array(list(pick.values()))  # (sequences, k)
            g = np.take_along_axis(gain, members, axis=0).sum(axis=0)
            o = np.take_along_axis(own, members, axis=0).sum(axis=0)
            m_any = np.take_along_axis(np.broadcast_to(model[:, None], gain.shape), members, axis=0).any(axis=0)
            shared = np.maximum(0, ks - max(steps_made.values(), default=0)) * d[0]
            jt = (base + first + o + np.where(m_any, shared, 0.0)
                  + device(drafted + len(pick) * ks, np.maximum(longest, ks), widths))
            jr = np.where(np.isfinite(g) & (len(pick) * ks <= budget), (tokens + g) / jt, -np.inf)
            joint_k = int(np.argmax(jr))
            joint_rate = float(jr[joint_k])
        if max(best, joint_rate) <= tokens / seconds or not np.isfinite(max(best, joint_rate)):
            break
        takes = [(int(pick[s_][joint_k]), joint_k) for s_ in pick] if joint_rate > best else [(r, k)]
        for r, k in takes:
            sel[r] = k
            tokens += float(gain[r, k])
            budget -= k
            open_ &= seq != seq[r]
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
        out.choices = {rows[r][0].sid: Choice(rows[r][1].source, k, 1.0 + float(gain[r, k])) for r, k in sel.items()}
        out.seconds, out.tokens = seconds, tokens
    return out
