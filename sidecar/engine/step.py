"""The step loop: the one place that decodes on a target's llama.cpp context.

A target context holds `n_seq` sequences, each on a KV stream of its own (engine.llama.Context).
`StepLoop` runs every sequence admitted to it together: each `step` asks each running sequence
(engine.sequence) for the rows it needs scored, applies the KV cache changes it asks for (keep its
first `kv_len` positions, shift a full window), decodes every sequence's rows in ONE llama_decode,
and hands each sequence its logits back. A sequence never touches the context, so one sequence
alone and one among many run the same code.

What a step holds:
- A decoding sequence's rows: its pending token, plus the draft its planner priced for this step
  (engine.planner, `Step`): the furthest behind plain steps first (one whose draft the last step
  took back last), each sequence sees the rows the others put in the step
  (those before it as decided, those after it as plain rows), so a draft is taken only where it
  adds more tokens than it slows the whole step down, and drafts shrink as the batch fills. A pass
  over several sequences' streams costs more than as many rows of one stream; every shared decode
  teaches the cost model by how much (CostModel.observe_shared). Before the step is decoded, the
  drafts that would leave another stream behind plain steps, or hold up a prompt's first token,
  are taken back (engine.fair).
- Model drafts for those rows: every sequence whose round drafts from a draft model gets its draft
  from its own stream of the pair's one draft context, all in one llama_decode per draft step
  (drafters.propose_together). Since no single sequence's decision sees what its draft costs
  when the others draft too (the draft steps carry all their rows, the verify rows go in one
  pass), the sequences on one draft context are offered a joint round once they have decided,
  where it beats their step (engine.together).
- A chunk of any prompt being prefilled. While other sequences decode, the chunk is cut so that
  it adds at most `PREFILL_SHARE` times what their rows cost, so running streams keep their pace
  while a long prompt comes in (chunked prefill); alone, a prompt goes in n_batch chunks. What a
  prompt token adds to a step is learnt from the steps that carried its chunks (`_Chunking`): the
  verify curve prices a row that computes logits over a short context, and a prefill row computes
  none, but attends over everything before it, which grows as a long prompt comes in.

Losslessness: each sequence's stream starts at cell 0 and holds only its own positions, so its
rows read the same cells in the same order as when it runs alone, and llama.cpp's CPU kernels
score a row independently of the rows beside it (README, Losslessness). A unified pool would put
a sequence's cells wherever the others left room, which changes its logits (measured: up to 0.64
on SmolLM2), so greedy output would part from the target alone.

The prefix cache: a finished sequence's stream keeps what it held. A new sequence goes to the free
stream that holds the most of its prompt when that is at least half of what the stream holds (the
same conversation one turn later) or all of the prompt (the same question again); otherwise to the
stream used least recently, so a short side request (a title, tags) does not evict the
conversation it sits beside. If another stream, busy or
free, holds more of the prompt, its prefix is copied over (llama_memory_seq_cp) instead of
prefilled: two clients with one long system prompt.
"""

from __future__ import annotations

import itertools
import time
from collections import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from sidecar.engine.adaptive import Step
from sidecar.engine.drafters import ModelDrafter, common_prefix, propose_together
from sidecar.engine.fair import Account, Bid, settle, withdrawals
from sidecar.engine.hosttime import HostTime, device_seconds
from sidecar.engine.layout import runs
from sidecar.engine.llama import Context
from sidecar.engine.rounds import Round
from sidecar.engine.sequence import Ask, Item, Rows, Sequence
from sidecar.engine.seqview import SeqView
from sidecar.engine.together import Member, choose

PREFILL_SHARE = 1.2  # a prefill chunk may add this many times the decoding rows' cost to a step
MIN_CHUNK = 1  # ... but never fewer tokens than this, so a prompt always comes in
PRICE_ROWS = 4  # before a chunk was timed, a prompt token is priced as a share of what this many rows add
MIN_COPY = 16  # a prefix shorter than this is prefilled rather than copied


@dataclass
class Stats:
    """What the loop has done, for /metrics and /api/ps."""

    steps: int = 0
    rows: int = 0  # rows decoded, over all steps
    tokens: int = 0  # tokens the sequences emitted, over all steps (live, where a Result counts at the end)
    cached_tokens: int = 0  # prompt tokens reused from a stream's cache instead of prefilled
    copied_tokens: int = 0  # ... of which copied from another stream
    withdrawn: int = 0  # drafts a shared step took back: another stream could not afford them (engine.fair)
    together: int = 0  # model drafts made in joint rounds: each sequence's round overridden (engine.together)


@dataclass
class _Chunking:
    """A prompt coming in beside decoding sequences: the seconds one of its tokens adds to a step
    (a moving average over the steps that carried its chunks; 0 until one did)."""

    per_token: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            got = seconds / tokens
            self.per_token = got if self.per_token == 0 else self.per_token + 0.3 * (got - self.per_token)


class StepLoop:
    """Steps the sequences on one target context together; owns the context (one thread at a time)."""

    def __init__(self, target: Context) -> None:
        self.target = target
        self.running: dict[int, Sequence] = {}  # stream id -> its sequence
        self._clock = itertools.count(1)
        self._used = [0] * target.n_seq  # when each stream last held a sequence (LRU)
        self._chunking: dict[int, _Chunking] = {}  # stream id -> its prompt's chunk pricing
        self._accounts: dict[int, Account] = {}  # stream id -> its standing over shared steps (engine.fair)
        self._held: set[int] = set()  # streams whose drafts the last step took back
        self._joint: set[int] = set()  # streams the last step drafted together (engine.together)
        self.stats = Stats()
        # The host's part of each step, its histograms and its price (engine.hosttime); every
        # sequence's cost model prices its drafts' host work by it (CostModel.host).
        self.host = HostTime()
        self._held_step: tuple[int, int, int, int] | None = None  # what the last decode held (`step`)

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
        seq.cost.host = self.host.price
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
        if src is not None and (got := match(src)) >= max(have + MIN_COPY, MIN_COPY):
            target.copy(src, sid, got)
            self.stats.copied_tokens += min(got, len(prompt) - 1)
        return sid

    def step(self, skip: Callable[[Sequence], bool] = lambda seq: False
             ) -> list[tuple[Sequence, list[Item] | BaseException]]:
        """One decode over the running sequences (but those `skip` holds back: a client that reads
        slowly); returns each one's output. A sequence that is done gives its last output and
        Result here and leaves; one that failed gives its exception and leaves.

        A step that decoded is timed: its wall time, and the host's part, all but the seconds in
        llama_decode and waiting for its results (engine.hosttime)."""
        t0, d0 = time.perf_counter(), device_seconds()
        self._held_step = None
        out = self._step(skip)
        if self._held_step is not None:
            wall = time.perf_counter() - t0
            self.host.observe(wall, wall - (device_seconds() - d0), *self._held_step)
        return out

    def _step(self, skip: Callable[[Sequence], bool]) -> list[tuple[Sequence, list[Item] | BaseException]]:
        target = self.target
        out: list[tuple[Sequence, list[Item] | BaseException]] = []
        ids = [s for s in sorted(self.running) if not skip(self.running[s])]
        decoding = [s for s in ids if not self.running[s].prefilling]
        # A sequence whose draft the last step took back decides after the others: a draft the
        # step cannot afford must not crowd out theirs; and otherwise the furthest behind plain
        # steps first, so a copy that the others' priced out of one step goes in the next
        # (engine.fair counts it as made).
        accounts = self._accounts
        decoding.sort(key=lambda s: (s in self._held, accounts[s].ahead if s in accounts else 0.0))

        def deepest(sids: abc.Iterable[int]) -> int:
            """The cells a pass over these streams attends over: llama.cpp sizes it by the deepest."""
            return max((len(target.held(s)) for s in sids), default=0)
        # The rows every sequence puts in the step: decided in that order against the others'.
        planned: dict[int, int] = {s: 1 for s in decoding}
        tokens: dict[int, float] = {s: 1.0 for s in decoding}

        def drop(sid: int, got: list[Item] | BaseException | None) -> None:
            planned.pop(sid, None)
            tokens.pop(sid, None)
            if got is not None:
                out.append((self.running[sid], got))
                self._leave(sid)

        asked: list[tuple[int, Rows | Ask]] = []
        # The decoding sequences first, then prompts with what is left of n_batch.
        for sid in [*decoding, *(s for s in ids if s not in planned)]:
            seq = self.running[sid]
            try:
                if seq.prefilling:
                    room = target.n_batch - sum(planned.values())
                    if room < MIN_CHUNK and planned:
                        continue  # no room in this step: the prompt goes on in the next
                    chunk = self._chunk(sid, seq, planned, deepest([*planned, sid])) if planned else room
                    want = seq.rows(budget=min(chunk, room))
                    if isinstance(want, Rows):  # a prompt's chunk: never a model draft's Ask
                        planned[sid] = len(want.tokens)
                else:
                    others = tuple((s, n) for s, n in planned.items() if s != sid)
                    joins = Step(sid, others, sum(v for s, v in tokens.items() if s != sid), deepest([*planned, sid]))
                    want = seq.rows(joins)
                    if want is not None:
                        planned[sid] = len(want.tokens) if isinstance(want, Rows) else want.k + 1
                        tokens[sid] = seq.expect
                if want is None:
                    drop(sid, seq.finish())
                    continue
                asked.append((sid, want))
            except BaseException as e:  # this sequence's failure, not the step's
                drop(sid, e)
        self._together(asked, planned, tokens, deepest(planned))
        bids, self._held = self._fair(asked, planned, deepest(planned), set(decoding))
        parts: list[tuple[int, Rows]] = []
        for sid, rows in self._drafted(asked, drop):
            seq = self.running[sid]
            try:
                if rows.shift is not None:
                    target.shift(*rows.shift, seq=sid)
                if len(target.held(sid)) + len(rows.tokens) > target.n_ctx:
                    seq.full()
                    drop(sid, None)
                    continue
                parts.append((sid, rows))
            except BaseException as e:
                drop(sid, e)
        if not parts:
            return out
        batch = [(sid, list(rows.tokens), rows.read) for sid, rows in parts]  # (stream, tokens, rows read)
        cells = deepest(sid for sid, _ in parts)
        widths = [(sid, len(tokens)) for sid, tokens, _ in batch]
        if all(rows.logits for _, rows in parts) and self.running[parts[0][0]].cost.padded(widths, cells):
            window = {sid: target.n_ctx - len(target.held(sid)) for sid, _ in parts}
            padded = pad_widths(widths, window, target.n_batch)
            # The pending token again, never read (logits are still asked of every row of a round).
            batch = [(sid, tokens + [tokens[0]] * (padded[sid] - len(tokens)), padded[sid]) for sid, tokens, _ in batch]
        t = time.perf_counter()
        try:
            logits = target.decode_many(batch, copy=False)  # each sequence reads its rows before the next decode
        except BaseException as e:  # the decode failed: every sequence in it fails
            for sid, _ in parts:
                out.append((self.running[sid], e))
                self._leave(sid)
            return out
        seconds = time.perf_counter() - t
        self._learn_chunks(parts, seconds, cells)
        if len(parts) > 1 and all(rows.logits for _, rows in parts):
            decoded = [(sid, len(tokens)) for sid, tokens, _ in batch]
            for cost in {id(m): m for m in (self.running[sid].cost for sid, _ in parts)}.values():
                cost.observe_shared(decoded, seconds, cells)
        self.stats.steps += 1
        self.stats.rows += sum(len(rows.tokens) for _, rows in parts)
        alone = len(parts) == 1
        made: dict[int, Bid] = {}
        ended: list[int] = []
        emitted = 0
        for (sid, _), lg in zip(parts, logits, strict=True):
            seq = self.running[sid]
            before = len(seq.result.tokens)
            try:
                items = seq.take(lg, seconds, alone)
                target.truncate(seq.kv_len, sid)
                self.stats.tokens += len(seq.result.tokens) - before
            except BaseException as e:
                out.append((seq, e))
                self._leave(sid)
                continue
            emitted += len(seq.result.tokens) - before
            if sid in bids:
                made[sid] = replace(bids[sid], tokens=float(len(seq.result.tokens) - before))
            if seq.done is not None:  # its Result goes now, not after the next step's decode (a prompt's chunk, maybe)
                items = [*items, *seq.finish()]
                ended.append(sid)
            if items:
                out.append((seq, items))
        settle(made, self._accounts)
        for sid in ended:
            self._leave(sid)
        drafts = [len(rows.tokens) - 1 for _, rows in parts if rows.logits and len(rows.tokens) > 1]
        self._held_step = (sum(1 for _, rows in parts if rows.logits), emitted, len(drafts), sum(drafts))
        return out

    def _drafted(self, asked: list[tuple[int, Rows | Ask]], drop: Callable[[int, BaseException], None]
                 ) -> list[tuple[int, Rows]]:
        """Every sequence's rows: model drafts asked for are drafted together, one batch per
        draft context (drafters.propose_together)."""
        asks = [(sid, a) for sid, a in asked if isinstance(a, Ask)]
        drafted: dict[int, Rows] = {}
        groups: dict[int, list[tuple[int, Ask]]] = {}
        for sid, a in asks:
            groups.setdefault(_context_of(a.drafter), []).append((sid, a))
        for group in groups.values():
            try:
                proposals = propose_together([(a.drafter, a.context, a.k, a.grammar) for _, a in group])
            except BaseException as e:  # the draft context failed: its sequences fail
                for sid, _ in group:
                    drop(sid, e)
                continue
            for (sid, _), proposal in zip(group, proposals, strict=True):
                drafted[sid] = self.running[sid].drafted(proposal)
        return [(sid, a if isinstance(a, Rows) else drafted[sid]) for sid, a in asked
                if isinstance(a, Rows) or sid in drafted]

    def _together(self, asked: list[tuple[int, Rows | Ask]], planned: dict[int, int], tokens: dict[int, float],
                  cells: int) -> None:
        """Offer the decoding sequences on one draft context a round that drafts from the model
        together, where it beats the step as they decided it (engine.together)."""
        groups: dict[int, list[Member]] = {}
        for sid, want in asked:
            if sid not in tokens or (isinstance(want, Rows) and len(want.tokens) > 1):
                continue  # a prompt coming in, or a free source's draft
            seq = self.running[sid]
            offer = seq.offer()
            if offer is None:
                continue
            src = seq.drafter.sources[offer.source]  # type: ignore[union-attr]
            if not isinstance(src, ModelDrafter):
                continue  # drafted on its own
            groups.setdefault(_context_of(src), []).append(Member(sid, offer, want.k if isinstance(want, Ask) else 0))
        joint: set[int] = set()
        for members in groups.values():
            if len(members) < 2:
                continue
            first = self.running[members[0].sid]
            need = 1.0 if {m.sid for m in members} <= self._joint else first.config.min_gain
            got = choose(members, planned, tokens, first.cost, cells, self.target.n_batch, need)
            if got is None:
                continue
            k, extra = got
            for m in members:
                i = next(i for i, (s, _) in enumerate(asked) if s == m.sid)
                seq = self.running[m.sid]
                rnd = Round(m.offer.source, k, k + 1, m.offer.support, seconds=extra)
                asked[i] = (m.sid, seq.join(asked[i][1], rnd))
                planned[m.sid], tokens[m.sid] = k + 1, seq.expect
                joint.add(m.sid)
        self._joint = joint
        self.stats.together += len(joint)

    def _fair(self, asked: list[tuple[int, Rows | Ask]], planned: dict[int, int], cells: int, decoding: set[int]
              ) -> tuple[dict[int, Bid], set[int]]:
        """Each sequence's bid in a shared step, after the drafts that would leave another stream
        behind plain steps are taken back (engine.fair), and the sequences whose drafts were; none
        for a lone sequence's step.

        A prompt coming in is a stream too: its first token waits for every draft in the steps
        that carry its chunks, and a draft decided beside it never saw it (the decoding sequences
        decide first). It bids a plain round's one token and no draft, so it is only ever owed:
        without it, a sequence that started alone drafted (a model draft's catch-up and all) while
        the streams that arrived with it waited for their first token (the padded pair at N = 4:
        325 ms against plain's 163 at fbc7043)."""
        streams = [sid for sid, _ in asked]
        if len(streams) < 2:
            return {}, set()
        plain = tuple((s, 1 if s in decoding else n) for s, n in planned.items())
        tau: dict[int, float] = {}  # the plain step, once per cost model (the pair's streams share one)
        bids: dict[int, Bid] = {}
        # A ready copy counts only against drafts (fair.withdrawals takes back only those that add
        # seconds): in a step without one, nobody's is worked out.
        drafts = any(self.running[s].extra > 0 for s in streams if s in decoding)
        for sid in streams:
            seq = self.running[sid]
            cost = seq.cost
            if id(cost) not in tau:
                tau[id(cost)] = cost.batch(plain, cells)
            t = tau[id(cost)]
            # What its row adds: CostModel.added(1) against the others' rows, from the step priced once.
            row = t - cost.batch(tuple(r for r in plain if r[0] != sid), cells)
            could = seq.plan.could if drafts else 1.0
            bids[sid] = Bid(seq.expect, seq.extra, t, row, could) if sid in decoding else Bid(1.0, 0.0, t, row)
            self._accounts.setdefault(sid, Account())
        slack = 1.0 - self.running[min(streams)].config.fallback_margin
        held, bids = withdrawals(bids, self._accounts, slack)
        for sid in held:
            i = next(i for i, (s, _) in enumerate(asked) if s == sid)
            asked[i] = (sid, self.running[sid].withdraw(asked[i][1]))
        self.stats.withdrawn += len(held)
        return bids, set(held)

    def _chunk(self, sid: int, seq: Sequence, planned: dict[int, int], cells: int) -> int:
        """How much of a prompt a step that others decode in may take (module docstring): what
        adds PREFILL_SHARE times the decoding rows' cost, at the price its earlier chunks showed
        (before any, a share of what PRICE_ROWS rows add by the verify curve: one row's margin can
        read as free where a layout merges passes)."""
        cost = seq.cost
        rows = tuple(planned.items())
        budget = PREFILL_SHARE * cost.batch(rows, cells)
        if budget <= 0:
            return seq.n_batch
        per_token = self._chunking.setdefault(sid, _Chunking()).per_token
        if per_token <= 0:
            per_token = cost.added(PRICE_ROWS, Step(sid, rows, cells=cells)) / PRICE_ROWS
        return max(MIN_CHUNK, min(seq.n_batch, int(budget / per_token))) if per_token > 0 else seq.n_batch

    def _learn_chunks(self, parts: list[tuple[int, Rows]], seconds: float, cells: int) -> None:
        """What the prompt chunks of a step with decoding rows added: the step's seconds beyond
        the decoding rows' price (by the prompt's own cost model, the one `_chunk` budgets with),
        shared among the chunks by their tokens."""
        chunks = [(sid, len(rows.tokens)) for sid, rows in parts if not rows.logits]
        decoding = tuple((sid, len(rows.tokens)) for sid, rows in parts if rows.logits)
        if not chunks or not decoding:
            return
        total = sum(n for _, n in chunks)
        for sid, n in chunks:
            extra = seconds - self.running[sid].cost.batch(decoding, cells)
            self._chunking.setdefault(sid, _Chunking()).observe(n, extra * n / total)

    def _leave(self, sid: int) -> None:
        self._chunking.pop(sid, None)
        self._accounts.pop(sid, None)
        self._held.discard(sid)
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
