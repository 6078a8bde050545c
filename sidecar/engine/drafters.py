"""Drafters: cheap guesses of the next tokens, behind one narrow `propose` shape.

A drafter has a name, says whether drafting costs a model pass (`has_cost`), and has three calls:

* `begin(sampler)` starts a request (its sampling settings, a fresh history);
* `propose(context, max_tokens, grammar)` gets every committed token (prompt, output, and the
  pending token the target has not scored yet) and returns up to `max_tokens` guesses together with
  their `Support`, the class the schedule prices them by. `max_tokens = 0` drafts nothing and costs
  nothing: it is how a sequence learns a source's class (and a model's catch-up `lag`) before it
  decides whether drafting pays;
* `shift(context, keep, discard)`: within a request the context only grows, except at a context
  shift (engine.window), when the committed context is about to lose a stretch.

A drafter that draws from a distribution returns it as q so the verifier can run exact rejection
sampling; a deterministic one (n-gram lookup) returns q = None and is verified by sample-and-match.
Under greedy sampling no q is built at all: the verifier compares argmaxes.
Under a grammar (`format`) a model drafter draws from the same masked distribution the target uses
(walking a clone of the state along its own guesses); the n-gram drafter ignores it, and the
verifier's masked p rejects whatever the grammar forbids. A drafter that learns across requests
(suffix.SuffixDrafter) is also a `Learner`: at the end of a generation it is handed the request's
prompt and output.

Support classes are small integers that mean something only within their source: the evidence keys
its evidence by (source name, class), rounds.Key, so two sources' classes never mix.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from sidecar.engine.grammar import Grammar
from sidecar.engine.llama import Context, ContextFull
from sidecar.engine.sampling import Sampler
from sidecar.engine.seqview import SeqView


@dataclass(frozen=True)
class Support:
    """What a drafter knows of its draft, before the target verifies it: how it will fare.

    Acceptance is not one number per request: an n-gram draft that continues a 20-token verbatim
    match (copying a line of the prompt) is almost always right, one that continues a 2-token match
    rarely is. A source's drafts of the same class `cls` are expected to fare alike, so engine.evidence
    keeps acceptance evidence per (source, class); `prior` is the acceptance to assume for a class
    with no evidence yet.

    A draft's later tokens need not be of its first token's class: where classes measure a verbatim
    match, each drafted token that holds makes the match one longer, so a copy that has held for a
    while is priced as the long match it has become. `along(j)` is the class of the draft's token j
    (j = 0: this one); None: every token is of this class.

    `under` names the classes of the same source this one is no worse than. The suffix cache's
    classes (suffix.SuffixDrafter) climb an agreement level each time a repeated answer is learnt
    again, so a request would meet a class with only its static prior though the level below held
    for hundreds of tokens; the evidence starts it from the best of theirs instead. The n-gram
    drafter's classes name none: measured on the padded pair, starting its longer match classes
    from the shorter ones' evidence drafted long copies of the article that broke, and the hybrid
    on summarise fell from 1.04 to 0.95 of n-gram alone (paired medians of 4, one process)."""

    cls: int = 0  # the class within its source (the evidence keys evidence by source and class)
    prior: float | None = None  # None: the pair's acceptance_prior
    ready: bool = True  # False: the drafter has nothing to propose here
    along: Callable[[int], Support] | None = field(default=None, compare=False)
    under: tuple[Support, ...] = field(default=(), compare=False)


NOTHING = Support(ready=False)


@dataclass
class Proposal:
    """A draft and what the schedule needs to know of it: its class, and a model's catch-up."""

    tokens: list[int] = field(default_factory=list)
    support: Support = NOTHING
    q: list[np.ndarray] | None = None
    caught_up: int = 0  # tokens prefilled to catch the drafter's cache up before drafting
    lag: int = 0  # tokens a costly drafter must prefill before it can draft (see max_tokens = 0)


class Drafter(Protocol):
    name: str
    has_cost: bool  # False when drafting is free next to a target step (n-gram lookup)

    def begin(self, sampler: Sampler) -> None:
        """Start a new request (its sampling settings, a fresh history)."""

    def propose(self, context: Sequence[int], max_tokens: int, grammar: Grammar | None = None) -> Proposal:
        """Up to max_tokens guesses and their class; with max_tokens 0 only the class and the lag.

        Like every call it assumes the context only grows between `begin()` calls and shifts."""

    def shift(self, context: Sequence[int], keep: int, discard: int) -> None:
        """`context` (the committed tokens) is about to lose positions [keep, keep + discard)."""


@runtime_checkable
class Learner(Protocol):
    """A drafter that learns from finished requests."""

    def finish(self, prompt: Sequence[int], output: Sequence[int], done_reason: str) -> None:
        """A generation ended (decoder.Result's tokens and done_reason), speculative or not."""


def match_class(match: int, cap: int) -> tuple[int, float]:
    """The class of a verbatim match of `match` tokens (counted up to `cap`), and its prior.

    Class c holds matches of m = 2^c to 2m - 1 tokens. With no evidence yet, assume a match of the
    class goes on with probability m / (m + 2): a short one is a coin toss at best. Both n-gram
    lookup and the suffix cache class their drafts by it."""
    c = min(match, cap).bit_length() - 1
    m = 1 << c
    return c, m / (m + 2)


@functools.lru_cache(maxsize=4096)
def match_support(match: int, cap: int) -> Support:
    """The support of a draft continuing a verbatim match: its token j continues one j tokens longer.

    Cached: a menu prices up to 64 tokens along each draft, every step, for every sequence."""
    c, prior = match_class(match, cap)
    return Support(cls=c, prior=prior, along=lambda j: match_support(match + j, cap))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by bisection over C-speed slice comparisons (slices of
    two lists compare as they are: 25 us at 8k tokens, where converting both took 45)."""
    lo, hi = 0, min(len(a), len(b))
    same = type(a) is type(b) and isinstance(a, (list, tuple))  # not arrays: their == is elementwise

    def equal(n: int) -> bool:
        return a[:n] == b[:n] if same else list(a[:n]) == list(b[:n])

    if equal(hi):
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if equal(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


class NgramDrafter:
    """Prompt lookup: continue the most recent earlier occurrence of the longest trailing n-gram.

    Costs no model pass, so it pays off whenever the answer re-uses the prompt (editing code,
    summarising, quoting). The index is incremental: each call only hashes the new tokens.

    How far the match really reaches back (up to `MATCH_CAP` tokens, beyond the n-gram that found it)
    is the drafter's evidence: a long verbatim stretch means the answer is copying, and a copy tends
    to go on. Its drafts are classed by that length in powers of two (`match_support`)."""

    name = "ngram"
    has_cost = False
    MATCH_CAP = 64

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("ngram sizes need 1 <= min_n <= max_n")
        self.min_n = min_n
        self.max_n = max_n
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index
        self._found: tuple[int, int, int, int] = (-1, -1, 0, 0)  # (length, last token, match, start)

    def begin(self, sampler: Sampler | None) -> None:
        self._index.clear()
        self._indexed = 0
        self._found = (-1, -1, 0, 0)

    def _lookup(self, context: Sequence[int]) -> tuple[int, int]:
        """(match length, where its continuation starts); length 0 when nothing matches."""
        n_ctx = len(context)
        # Within a request (begin() starts one) the context only grows, so its length and last token
        # identify it; a menu's look (max_tokens 0) and the draft of one round share a lookup.
        if self._found[:2] == (n_ctx, context[-1] if n_ctx else -1):
            return self._found[2], self._found[3]
        if self._indexed > n_ctx:
            self.begin(None)
        # Index every n-gram that has at least one following token: end <= n_ctx - 1.
        index = self._index
        for upto in range(max(self._indexed, self.min_n), n_ctx):
            for n in range(self.min_n, min(self.max_n, upto) + 1):
                index[tuple(context[upto - n : upto])] = upto
        self._indexed = max(self._indexed, n_ctx)
        match = start = 0
        for n in range(min(self.max_n, n_ctx), self.min_n - 1, -1):
            end = index.get(tuple(context[n_ctx - n :]))
            if end is not None:
                match, start = n, end
                while match < self.MATCH_CAP and match < end and context[end - 1 - match] == context[n_ctx - 1 - match]:
                    match += 1
                break
        self._found = (n_ctx, context[-1] if n_ctx else -1, match, start)
        return match, start

    def propose(self, context: Sequence[int], max_tokens: int, grammar: Grammar | None = None) -> Proposal:
        match, start = self._lookup(context)
        if not match:
            return Proposal()
        tokens = list(context[start : start + max_tokens])
        # A continuation that runs into the context's end is a repetition (the latest occurrence of
        # a periodic text's n-gram is one period back): copy on from the draft itself, as LZ77's
        # overlapping copies do, not stop a period in. A model stuck in a loop ("record_record_...")
        # drafted 2 tokens a round.
        period = len(context) - start
        while len(tokens) < max_tokens:
            tokens.append(tokens[len(tokens) - period])
        return Proposal(tokens, match_support(match, self.MATCH_CAP))

    def shift(self, context: Sequence[int], keep: int, discard: int) -> None:
        # Every n-gram's position after the cut moves and those across it vanish: index the shifted
        # context afresh at the next lookup (a few dictionary inserts per token, once per shift).
        self.begin(None)


class ModelDrafter:
    """A small model on the target's vocabulary, with its own KV cache kept in step.

    Each call reuses the KV prefix it shares with the committed context, drops what was rejected,
    and decodes only the new tokens. It drafts the argmax when the request is greedy and samples
    from q otherwise, stopping early when q's top probability falls below p_min (a greedy draft's
    q would be one-hot: it drafts as long as the schedule asks)."""

    name = "model"
    has_cost = True

    def __init__(self, ctx: Context | SeqView, p_min: float = 0.0) -> None:
        self.ctx = ctx
        self.p_min = p_min
        self._sampler: Sampler | None = None

    def begin(self, sampler: Sampler) -> None:
        self._sampler = sampler

    def propose(self, context: Sequence[int], max_tokens: int, grammar: Grammar | None = None) -> Proposal:
        if max_tokens <= 0:  # a menu's look: one class (how well a model drafts shows in its acceptance)
            return Proposal(support=Support(), lag=len(context) - 1 - self._reusable(context))
        return propose_together([(self, context, max_tokens, grammar)])[0][0]

    def shift(self, context: Sequence[int], keep: int, discard: int) -> None:
        """Shift the draft's cache as the target's, when it holds the whole stretch that moves.

        Otherwise (it lags behind, or its memory cannot move positions) it keeps the head, and the
        next `propose` prefills the rest. A shifted cache is not what a prefill would compute, but a
        draft only needs to guess well: the target's verification keeps the output exact."""
        ctx = self.ctx
        held = common_prefix(ctx.tokens, context)
        ctx.truncate(held)  # whatever it drafted past the committed tokens
        if held >= keep + discard and ctx.can_shift:
            ctx.shift(keep, discard)
        else:
            ctx.truncate(keep)

    def _reusable(self, context: Sequence[int]) -> int:
        """Cached positions that match `context`; the last token is always decoded afresh."""
        return min(common_prefix(self.ctx.tokens, context), len(context) - 1)


class _Draw:
    """One sequence's model draft under way (propose_together)."""

    def __init__(self, drafter: ModelDrafter, context: Sequence[int], max_tokens: int,
                 grammar: Grammar | None) -> None:
        assert drafter._sampler is not None, "begin() first"
        self.drafter, self.max_tokens = drafter, max_tokens
        self.sampler = drafter._sampler
        self.history = list(context)
        self.tokens: list[int] = []
        self.qs: list[np.ndarray] = []
        self.walker = grammar.clone() if grammar is not None else None
        ctx = drafter.ctx
        keep = drafter._reusable(context)
        ctx.truncate(keep)
        self.caught_up = len(context) - 1 - keep
        if self.caught_up:
            ctx.prefill(context[keep:-1])
        self.feed: int | None = context[-1]  # the next token to decode; None: done

    def take(self, logits: np.ndarray) -> None:
        """The draft model's logits for the token just fed: draw the next guess, or stop.

        Greedy: the guess is the argmax, and no distribution is built (the verifier compares
        argmaxes); q would be one-hot, whose top is 1, so p_min never stops a greedy draft.
        Sampled: the guess is drawn from q, kept for rejection sampling, and q's top is the
        confidence."""
        sampler, p_min = self.sampler, self.drafter.p_min
        self.feed = None
        if sampler.params.greedy:
            tok = int(np.argmax(sampler.choice_logits(logits, self.history, self.walker)))
        else:
            q = sampler.probs(logits, self.history, self.walker)
            if p_min > 0.0 and float(q.max()) < p_min:
                return
            tok = sampler.draw(q)
            self.qs.append(q)
        self.tokens.append(tok)
        self.history.append(tok)
        if len(self.tokens) >= self.max_tokens:
            return
        if self.walker is not None:
            if self.drafter.ctx.weights.is_eog(tok):
                return  # the target stops there; a grammar has no state past the end
            self.walker.accept(tok)
        ctx = self.drafter.ctx
        if len(ctx) + 1 <= ctx.n_ctx:
            self.feed = tok

    def close(self) -> None:
        if self.walker is not None:
            self.walker.close()


def propose_together(asks: Sequence[tuple[ModelDrafter, Sequence[int], int, Grammar | None]]
                     ) -> tuple[list[Proposal], int, int]:
    """Model drafts for several sequences at once: (drafter, context, max_tokens, grammar) each;
    with the draft steps made and the rows they carried (the cost model's features, engine.cost).

    Drafters on streams of one shared draft context (llama.SeqView) decode together, one
    llama_decode per draft step for every sequence still drafting, as the target's step loop
    batches their verification (engine.step); each sequence's draft is what it would draft alone.
    Each drafter first catches its stream up with its context (`Proposal.caught_up`)."""
    steps = rows = 0
    together = len({id(a[0].ctx.base) if isinstance(a[0].ctx, SeqView) else id(a[0]) for a in asks}) == 1
    draws = [_Draw(*ask) for ask in asks]
    try:
        live = [d for d in draws if d.feed is not None]
        while live:
            steps, rows = steps + 1, rows + (len(live) if together else 1)
            for d, logits in zip(live, _decode_draws(live), strict=True):
                d.take(logits)
            live = [d for d in live if d.feed is not None]
    except ContextFull:
        pass
    finally:
        for d in draws:
            d.close()
    return [Proposal(d.tokens, Support(), d.qs or None, caught_up=d.caught_up) for d in draws], steps, rows


def _decode_draws(live: Sequence[_Draw]) -> list[np.ndarray]:
    """Each live draw's fed token, decoded in one llama_decode where their streams share a context.
    There the rows are views of llama.cpp's buffer, not copies (a copy a row cost 196 KB at a 49k
    vocabulary, 1 MB at 262k): each draw takes its row before the next draft step decodes."""
    views = [d.drafter.ctx for d in live]
    base = views[0].base if isinstance(views[0], SeqView) else None
    if base is not None and all(isinstance(v, SeqView) and v.base is base for v in views):
        parts = [(v.seq, [d.feed], 1) for v, d in zip(views, live, strict=True)]  # type: ignore[union-attr]
        got = base.decode_many(parts, copy=False)  # type: ignore[arg-type]
        return [g[0] for g in got]  # type: ignore[index]
    return [d.drafter.ctx.decode([d.feed], rows=[0])[0] for d in live]  # type: ignore[list-item]
