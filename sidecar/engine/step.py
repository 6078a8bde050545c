"""The step loop: the one place that decodes on a target's llama.cpp context.

A target context holds `n_seq` sequences, each on a KV stream of its own (engine.llama.Context).
`StepLoop` runs every sequence admitted to it together: each `step` asks each running sequence
(engine.sequence) for the rows it needs scored, applies the KV cache changes it asks for (keep its
first `kv_len` positions, shift a full window), decodes every sequence's rows in ONE llama_decode,
and hands each sequence its logits back. A sequence never touches the context, so one sequence
alone and one among many run the same code.

What a step does (the design page, docs/design/scheduler.md, walks one through):
1. Every running sequence says whether it goes on (`Sequence.ready`: done, cancelled, or its
   full window shifted). Each decoding one offers a menu (`Sequence.menu`): what each ready
   source's draft is expected to emit at each length, drawn from the evidence (engine.evidence).
2. One schedule picks every sequence's (source, k) for the whole step (engine.schedule), by the
   one fitted cost model (engine.cost) and the host's price (engine.hosttime).
3. Model drafts are made for every sequence that drafts from a model, one batch per draft
   context (drafters.propose_together); a prompt being prefilled takes a chunk that adds at
   most PREFILL_SHARE times the decoding step's price, so running streams keep their pace while
   a long prompt comes in (chunked prefill); alone, a prompt goes in n_batch chunks.
4. One llama_decode over every sequence's rows, in the cheaper of two layouts (each run of
   consecutive streams padded to one width, or split as llama.cpp splits it); its seconds teach
   the cost model, by the layout's features.
5. Each sequence verifies its rows and commits what holds (`Sequence.take`), then says its text
   (`Sequence.say`: detokenising, stop strings) and leaves with its Result when done (`_emit`).
   On a GPU the saying waits for the next step and runs while that step's decode computes
   (`overlap`): the next rows need the tokens, not their text.

Losslessness: each sequence's stream starts at cell 0 and holds only its own positions, so its rows
read the same cells in the same order as alone (a unified pool would not: docs/design/losslessness.md).

The prefix cache (`_place`; docs/design/kv-layout.md): a finished sequence's stream keeps what it
held, a new prompt goes to the free stream that holds the most of it (else the least recently
used), another stream's longer prefix is copied in (llama_memory_seq_cp), and what a prompt drops
is kept in host memory to be loaded back later (engine.hostcache).
"""

from __future__ import annotations

import itertools
import time
from collections import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sidecar.engine.cost import CostModel, Layout
from sidecar.engine.drafters import ModelDrafter, common_prefix, propose_together
from sidecar.engine.hostcache import HostCache
from sidecar.engine.hosttime import HostTime, device_seconds
from sidecar.engine.layout import passes, runs
from sidecar.engine.llama import Context
from sidecar.engine.schedule import PLAIN, Choice, Menu, Plan, schedule
from sidecar.engine.sequence import Ask, Item, Rows, Sequence
from sidecar.engine.seqview import SeqView

PREFILL_SHARE = 1.2  # a prefill chunk may add this many times the decoding rows' cost to a step
MIN_CHUNK = 1  # ... but never fewer tokens than this, so a prompt always comes in
MIN_COPY = 16  # a prefix shorter than this is prefilled rather than copied


@dataclass
class Stats:
    """What the loop has done, for /metrics and /api/ps."""

    steps: int = 0
    rows: int = 0  # rows decoded, over all steps
    tokens: int = 0  # tokens the sequences emitted, over all steps (live, where a Result counts at the end)
    cached_tokens: int = 0  # prompt tokens reused from a stream's cache instead of prefilled
    copied_tokens: int = 0  # ... of which copied from another stream
    restored_tokens: int = 0  # ... of which loaded back from host memory (engine.hostcache)
    withdrawn: int = 0  # rounds the schedule ran plain though a draft was ready (engine.schedule)
    together: int = 0  # model drafts made in one batch with another sequence's (drafters.propose_together)


Output = tuple[Sequence, list[Item] | BaseException]  # a sequence's output of a step, or its failure
Publish = Callable[[list[Output]], None]


class StepLoop:
    """Steps the sequences on one target context together; owns the context (one thread at a time)."""

    def __init__(self, target: Context, overlap: bool | None = None, host_cache: HostCache | None = None) -> None:
        self.target = target
        self.host_cache = host_cache  # prompts' cells kept in host memory when their stream is reused
        # Say the verified tokens' text while the next decode runs (`_emit`), where llama_decode
        # returns before the device is done: a GPU's. On a CPU the decode is synchronous, so the
        # text would only come a step later.
        self.overlap = target.weights.gpu_layers > 0 if overlap is None else overlap
        self._unsaid: list[int] = []  # streams verified in the last step, their output not yet said
        self.running: dict[int, Sequence] = {}  # stream id -> its sequence
        self._clock = itertools.count(1)
        self._used = [0] * target.n_seq  # when each stream last held a sequence (LRU)
        self.stats = Stats()
        # The host's part of each step, its histograms and its price (engine.hosttime), which
        # the schedule adds to the device's.
        self.host = HostTime()
        self._widths: tuple[tuple[int, int], ...] = ()  # the last decode's rows per stream (Layout.changed)
        self._passes: tuple[tuple[tuple[int, int], ...], int] = ((), 0)  # the last widths `_layout` split
        self._drafted_last = False  # whether the last step drafted (the schedule's hysteresis)
        self._held_step: tuple[int, int, int, int] | None = None  # what the last decode held (`step`)
        self._lessons: list[Callable[[], None]] = []  # what the fits learn of a step, while the next decodes (`_learn`)

    @property
    def full(self) -> bool:
        """Whether every stream holds a running sequence."""
        return len(self.running) >= self.target.n_seq

    def idle_stream(self) -> int | None:
        """A stream no sequence runs on (a scratch cache for a calibration), least recently used."""
        free = [s for s in range(self.target.n_seq) if s not in self.running]
        return min(free, key=lambda s: self._used[s]) if free else None

    def add(self, prompt: abc.Sequence[int], make: Callable[[int], Sequence]) -> Sequence:
        """Start a sequence for `prompt` on a free stream: `make(stream)` builds it (its drafter is
        that stream's). Raises what the sequence's start refuses (PromptTooLong, InvalidToken)."""
        if self.full:
            raise RuntimeError("no free stream")
        sid = self._place(prompt)
        seq = make(sid)
        target = self.target
        try:
            keep = seq.start(target.held(sid), target.fresh_of(sid))
        except BaseException:
            seq.close()
            raise
        target.truncate(keep, sid)
        if not seq.cost.seeded:
            seq.cost.seed()  # from the calibration's prices its owner set (none: every round plain)
        self.stats.cached_tokens += keep
        self.running[sid] = seq
        self._used[sid] = next(self._clock)
        return seq

    def _place(self, prompt: abc.Sequence[int]) -> int:
        """The stream for a new prompt, with the longest cached prefix copied in (module docstring)."""
        target = self.target

        def match(s: int) -> int:
            return min(common_prefix(target.held(s), prompt), target.fresh_of(s))

        free = [s for s in range(target.n_seq) if s not in self.running]
        # A stream fits when most of what it holds is this prompt's (a conversation one turn later)
        # or when it holds all of this prompt (the same question asked again: only the old answer
        # goes, which the new one replaces; a short prompt under a long answer is never "half").
        whole = len(prompt) - 1  # the last prompt token is always decoded afresh (Sequence.start)
        fits = [s for s in free if 2 * match(s) >= len(target.held(s)) or match(s) >= whole > 0]
        # A stream that holds more of this prompt than of anything else, else the least recently used.
        sid = max(fits, key=lambda s: (match(s), -s)) if fits else min(free, key=lambda s: self._used[s])
        have = match(sid)
        src = max((s for s in range(target.n_seq) if s != sid), key=match, default=None)
        got = match(src) if src is not None else 0
        cache = self.host_cache
        if cache is not None and (restored := cache.exchange(target, sid, prompt, have, max(have, got) + MIN_COPY)):
            self.stats.restored_tokens += restored
            return sid
        have = match(sid)  # again: a save keeps only the fresh cells, a failed load none
        if src is not None and got >= max(have + MIN_COPY, MIN_COPY):
            target.copy(src, sid, got)
            self.stats.copied_tokens += min(got, len(prompt) - 1)
        return sid

    def step(self, skip: Callable[[Sequence], bool] = lambda seq: False, publish: Publish | None = None
             ) -> list[Output]:
        """One decode over the running sequences (but those `skip` holds back: a client that reads
        slowly); returns each one's output. A sequence that is done gives its last output and
        Result and leaves; one that failed gives its exception and leaves. Where the loop overlaps,
        the output of the last step's tokens is made while this step's decode runs, and handed to
        `publish` then (if given) rather than returned. A step that decoded is timed: its wall
        time, and the host's part, all but llama_decode and waiting for it (engine.hosttime)."""
        t0, d0 = time.perf_counter(), device_seconds()
        self._held_step = None
        out = self._step(skip, publish)
        if self._held_step is not None:
            wall = time.perf_counter() - t0
            host = self.host
            lesson = (wall, wall - (device_seconds() - d0), *self._held_step)
            self._learn(lambda: host.observe(*lesson))
        return out

    def _learn(self, lesson: Callable[[], None]) -> None:
        """Teach a fit what a step took: now, or where the loop overlaps, while the next step's
        decode runs (~40 us a step on the host, which no decode needs first)."""
        if self.overlap:
            self._lessons.append(lesson)
        else:
            lesson()

    def _step(self, skip: Callable[[Sequence], bool], publish: Publish | None) -> list[Output]:
        target = self.target
        out: list[Output] = []

        def drop(sid: int, got: list[Item] | BaseException) -> None:
            out.append((self.running[sid], got))
            self._leave(sid)

        # What the step says besides its decode (`_emit`): the last step's verified tokens, where
        # the loop overlaps, and the sequences that end now (done, cancelled, a full window).
        said = self._unsaid
        self._unsaid = []

        # The running sequences in one pass (each comprehension or generator over them costs a few
        # us a step on the host): those that go on, decoding or prefilling, and the deepest stream.
        live: list[int] = []
        decoding: list[int] = []
        prompts: list[int] = []
        cells = 0  # a pass attends over its deepest stream
        for sid in sorted(self.running):
            seq = self.running[sid]
            if skip(seq):
                continue
            try:
                if seq.ready():
                    live.append(sid)
                    (prompts if seq.prefilling else decoding).append(sid)
                    cells = max(cells, len(target.held(sid)))
                else:
                    said.append(sid)
            except BaseException as e:  # this sequence's failure, not the step's
                drop(sid, e)
        if not live:
            self._emit(said, (), out)
            return out
        cost = self.running[live[0]].cost
        plan = self._schedule(decoding, cost, cells, drop, priced=bool(prompts))
        asked: list[tuple[int, Rows | Ask]] = []
        for sid in decoding:
            if sid not in self.running:  # its menu failed (`_schedule`)
                continue
            try:
                asked.append((sid, self.running[sid].rows(plan.choices.get(sid, PLAIN))))
            except BaseException as e:
                drop(sid, e)
        used = len(asked)
        for choice in plan.choices.values():
            used += choice.k
        for sid in prompts:  # with what is left of n_batch
            room = target.n_batch - used
            if room < MIN_CHUNK and used:
                break  # no room in this step: the prompts go on in the next
            chunk = self._chunk(cost, plan.seconds, cells) if decoding else room
            try:
                want = self.running[sid].rows(budget=min(chunk, room))
            except BaseException as e:
                drop(sid, e)
                continue
            used += len(want.tokens) if isinstance(want, Rows) else 0
            asked.append((sid, want))
        parts: list[tuple[int, Rows]] = []
        for sid, rows in self._drafted(asked, drop):
            seq = self.running[sid]
            try:
                if rows.shift is not None:
                    target.shift(*rows.shift, seq=sid)
                if len(target.held(sid)) + len(rows.tokens) > target.n_ctx:
                    seq.full()  # it ends in the next step (Sequence.ready)
                    continue
                parts.append((sid, rows))
            except BaseException as e:
                drop(sid, e)
        if not parts:
            self._emit(said, (), out)
            return out
        return self._decode(parts, cost, cells, plan, said, out, publish)

    def _schedule(self, decoding: list[int], cost: CostModel, cells: int,
                  drop: Callable[[int, BaseException], None], priced: bool) -> Plan:
        """The step's plan (engine.schedule) from every decoding sequence's menu; `priced`: a
        prompt comes in beside, whose chunk is sized by the plan's seconds (`_chunk`)."""
        if not decoding:
            return Plan()
        config = self.running[decoding[0]].config
        if config.adaptive and not cost.ready:
            return Plan()  # nothing priced yet (a decoder without a calibration): plain steps
        room = self.target.n_batch - len(decoding)  # drafted rows n_batch leaves beside the plain ones
        menus = []
        offered = False
        for sid in decoding:
            try:
                menus.append(Menu(sid, self.running[sid].menu(room), room))
                offered = offered or bool(menus[-1].options)
            except BaseException as e:
                drop(sid, e)
        if not config.adaptive:  # llama.cpp's rule: the first ready source, as long as it may
            return Plan({m.sid: Choice(m.options[0].source, len(m.options[0].expected) - 1)
                         for m in menus if m.options})
        if not priced and not offered:
            # Nothing to choose and nothing to price: the all-plain step, without the schedule's
            # numpy (~60 us of a plain step's ~360 on the host at N = 1, bench/step_python.py).
            self._drafted_last = False
            return Plan()
        plain = tuple((sid, 1) for sid in decoding)
        need = 1.0 if self._drafted_last else config.min_gain
        plan = schedule(menus, cost, self.host.price, cells, 1.0 - config.fallback_margin, need, room,
                        changed=plain != self._widths)
        self._drafted_last = bool(plan.choices)
        self.stats.withdrawn += sum(1 for m in menus if m.options and m.sid not in plan.choices)
        return plan

    def _decode(self, parts: list[tuple[int, Rows]], cost: CostModel, cells: int, plan: Plan, said: list[int],
                out: list[Output], publish: Publish | None) -> list[Output]:
        """Decode every sequence's rows in one llama_decode, teach the cost model what it took,
        and hand each sequence its logits; `said`'s output is made during the decode where the
        loop overlaps, after it otherwise."""
        target = self.target
        # One pass over the parts for everything the step books (a generator per sum cost a few
        # us each right after a decode): the batch, its widths, its prompt rows, the cost models
        # it teaches and what the host's price learns of it (`_held_step`).
        batch, wide_rows, models = [], [], {}
        prefill = reading = drafting = drafted = 0
        for sid, rows in parts:
            n = len(rows.tokens)
            batch.append((sid, list(rows.tokens), rows.read))  # (stream, tokens, rows read)
            wide_rows.append((sid, n))
            cost_of = self.running[sid].cost
            models[id(cost_of)] = cost_of
            if not rows.logits:
                prefill += n
            else:
                reading += 1
                if n > 1:
                    drafting, drafted = drafting + 1, drafted + n - 1
        widths = tuple(wide_rows)
        layout = self._layout(widths, prefill, cells)
        if reading == len(parts) > 1:
            window = {sid: target.n_ctx - len(target.held(sid)) for sid, _ in parts}
            padded = pad_widths(widths, window, target.n_batch)
            wide = tuple(padded.items())
            if wide != widths and cost.step(self._layout(wide, prefill, cells)) < cost.step(layout):
                # The pending token again, never read (logits are still asked of every row of a round).
                batch = [(sid, tokens + [tokens[0]] * (padded[sid] - len(tokens)), padded[sid])
                         for sid, tokens, _ in batch]
                widths, layout = wide, self._layout(wide, prefill, cells)
        meanwhile = 0.0  # seconds `_emit` took inside the decode's call (not the device's)

        def emit() -> None:
            nonlocal meanwhile
            t = time.perf_counter()
            self._emit(said, flying, out)
            said.clear()
            for lesson in self._lessons:
                lesson()
            self._lessons.clear()
            if publish is not None:
                publish(out[:])
                out.clear()
            meanwhile = time.perf_counter() - t

        flying = {sid for sid, _ in parts}
        t = time.perf_counter()
        try:  # each sequence reads its rows before the next decode (copy=False)
            logits = target.decode_many(batch, copy=False, meanwhile=emit if self.overlap else None)
        except BaseException as e:  # the decode failed: every sequence in it fails
            for sid, _ in parts:
                if sid in self.running:
                    out.append((self.running[sid], e))
                    self._leave(sid)
            self._emit(said, (), out)
            return out
        seconds = time.perf_counter() - t - meanwhile
        fits = list(models.values())

        def lesson() -> None:
            for model in fits:
                model.observe_step(layout, seconds)

        self._learn(lesson)
        self._widths = widths
        self.stats.steps += 1
        self.stats.rows += layout.rows + prefill
        # What each sequence's round saved against the all-plain step, by the schedule's prices:
        # /metrics' realised speed-up over target-only (Result.saved_seconds).
        n = max(1, reading)
        per_plain, per_step = plan.plain / n, plan.seconds / n
        taken: list[int] = []
        emitted = 0
        for (sid, rows), lg in zip(parts, logits, strict=True):
            seq = self.running.get(sid)
            if seq is None:  # it failed while the decode ran (`_emit`)
                continue
            if seq.done is not None:  # a stop string in its last round's text, found while the decode ran
                target.truncate(seq.kv_len, sid)  # it ends in the next step
                continue
            before = len(seq.result.tokens)
            try:
                seq.take(lg)
                target.truncate(seq.kv_len, sid)
            except BaseException as e:
                out.append((seq, e))
                self._leave(sid)
                continue
            made = len(seq.result.tokens) - before
            emitted += made
            if rows.logits and plan.choices:
                seq.tally.saved_seconds += made * per_plain - per_step
            taken.append(sid)
        self.stats.tokens += emitted
        if self.overlap:  # said while the next step's decode runs
            self._unsaid, taken = taken, []
        # Otherwise now: a sequence done now gives its Result now, not after the next step's
        # decode (a long prompt's chunk, maybe). `said` is empty where the decode said it.
        self._emit(said + taken, (), out)
        self._held_step = (reading, emitted, drafting, drafted)
        return out

    def _emit(self, sids: list[int], flying: abc.Collection[int], out: list[Output]) -> None:
        """Each sequence's output of the tokens it has verified (`Sequence.say`: text, stop
        strings), and the Result of those that are done, who then leave; but not those whose
        rows the running decode holds (`flying`): they end in the next step."""
        for sid in sids:
            seq = self.running.get(sid)
            if seq is None:  # said and left already
                continue
            try:
                items = seq.say()
                if seq.done is not None and sid not in flying:
                    items += seq.finish()
                    self._leave(sid)
            except BaseException as e:
                out.append((seq, e))
                self._leave(sid)
                continue
            if items:
                out.append((seq, items))

    def _layout(self, widths: tuple[tuple[int, int], ...], prefill: int, cells: int) -> Layout:
        """The decode as the cost model sees it (engine.cost), `prefill` of its rows a prompt's."""
        total = 0
        for _, n in widths:
            total += n
        if widths != self._passes[0]:  # a steady stretch decodes one layout over and over
            self._passes = widths, len(passes(widths))
        return Layout(self._passes[1], total - prefill, prefill, cells, changed=widths != self._widths)

    def _drafted(self, asked: list[tuple[int, Rows | Ask]], drop: Callable[[int, BaseException], None]
                 ) -> list[tuple[int, Rows]]:
        """Every sequence's rows: model drafts asked for are drafted together, one batch per
        draft context (drafters.propose_together), and their time teaches the pair's cost model."""
        drafted: dict[int, Rows] = {}
        groups: dict[int, list[tuple[int, Ask]]] = {}
        for sid, a in asked:
            if isinstance(a, Ask):
                groups.setdefault(_context_of(a.drafter), []).append((sid, a))
        for group in groups.values():
            t0 = time.perf_counter()
            try:
                proposals, steps, rows = propose_together([(a.drafter, a.context, a.k, a.grammar) for _, a in group])
            except BaseException as e:  # the draft context failed: its sequences fail
                for sid, _ in group:
                    drop(sid, e)
                continue
            seconds = time.perf_counter() - t0
            self.running[group[0][0]].cost.observe_draft(steps, rows, sum(p.caught_up for p in proposals), seconds)
            if len(group) > 1:
                self.stats.together += len(group)
            for (sid, _), proposal in zip(group, proposals, strict=True):
                drafted[sid] = self.running[sid].drafted(proposal)
        return [(sid, a if isinstance(a, Rows) else drafted[sid]) for sid, a in asked
                if isinstance(a, Rows) or sid in drafted]

    def _chunk(self, cost: CostModel, seconds: float, cells: int) -> int:
        """How much of a prompt a step that others decode in may take: what adds PREFILL_SHARE
        times the decoding step's price, at the cost model's price of a prompt row at this depth."""
        per_token = cost.step(Layout(0, 0, 1, cells))
        if per_token <= 0 or seconds <= 0:
            return self.target.n_batch
        return max(MIN_CHUNK, min(self.target.n_batch, int(PREFILL_SHARE * seconds / per_token)))

    def _leave(self, sid: int) -> None:
        seq = self.running.pop(sid)
        seq.close()
        self._used[sid] = next(self._clock)

    def run(self, prompt: abc.Sequence[int], make: Callable[[int], Sequence]) -> Iterator[Item]:
        """Run one sequence alone to its end: its output as it becomes final, then its Result."""
        seq = self.add(prompt, make)
        while seq in self.running.values():
            for s, got in self.step():
                if s is not seq:
                    continue
                if isinstance(got, BaseException):
                    raise got
                yield from got


def _context_of(drafter: ModelDrafter) -> int:
    """The draft context a model drafter's stream belongs to: drafts on one are made together."""
    ctx = drafter.ctx
    return id(ctx.base if isinstance(ctx, SeqView) else ctx)


def pad_widths(widths: abc.Sequence[tuple[int, int]], room: dict[int, int], n_batch: int) -> dict[int, int]:
    """Each sequence's rows once every run of consecutive ids is padded to its widest member (one
    llama.cpp pass per run), where that is possible: a run stays as it is if one of its sequences
    has no room in its window for the padding (it would overflow that sequence's KV stream and fail
    the whole decode), and nothing is padded if the padded step would not fit in n_batch."""
    out = dict(widths)
    for run in runs(widths):
        width = max(n for _, n in run)
        if all(width <= room[sid] for sid, _ in run):
            out.update((sid, width) for sid, _ in run)
    return out if sum(out.values()) <= n_batch else dict(widths)
