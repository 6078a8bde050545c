"""Drafters: cheap guesses of the next tokens, behind one `propose` shape.

`propose(context, max_tokens)` gets every committed token (prompt, output, and the pending token the
target has not scored yet) and returns up to `max_tokens` guesses. A drafter that draws from a
distribution returns it as q so the verifier can run exact rejection sampling; a deterministic one
(n-gram lookup) returns q = None and is verified by sample-and-match.

Under a grammar (`format`) `propose` also gets the committed grammar state: a model drafter draws
from the same masked distribution the target uses (walking a clone of the state along its own
guesses), so it never proposes a token the target must reject for grammar reasons. The n-gram
drafter ignores it; the verifier's masked p rejects whatever the grammar forbids.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from sidecar.engine.grammar import Grammar
from sidecar.engine.llama import Context, ContextFull
from sidecar.engine.sampling import Sampler


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    q: list[np.ndarray] | None = None
    seconds: float = 0.0  # what drafting cost in all (catching the draft's cache up included)
    step_seconds: float | None = None  # the drafting steps alone; the cost model's per-token basis
    caught_up: int = 0  # tokens prefilled to catch the drafter's cache up before drafting


class Drafter(Protocol):
    name: str
    has_cost: bool  # False when drafting is free next to a target step (n-gram lookup)

    def begin(self, sampler: Sampler) -> None:
        """Start a new request (its sampling settings, a fresh history)."""

    def propose(self, context: Sequence[int], max_tokens: int, grammar: Grammar | None = None) -> Proposal: ...

    def lag(self, context: Sequence[int]) -> int:
        """Tokens of `context` the drafter would have to process before it can propose."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by bisection over C-speed slice comparisons."""
    lo, hi = 0, min(len(a), len(b))
    if list(a[:hi]) == list(b[:hi]):
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class NgramDrafter:
    """Prompt lookup: continue the most recent earlier occurrence of the longest trailing n-gram.

    Costs no model pass, so it pays off whenever the answer re-uses the prompt (editing code,
    summarising, quoting). The index is incremental: each call only hashes the new tokens."""

    name = "ngram"
    has_cost = False

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("ngram sizes need 1 <= min_n <= max_n")
        self.min_n = min_n
        self.max_n = max_n
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def begin(self, sampler: Sampler) -> None:
        self._index.clear()
        self._indexed = 0

    def propose(self, context: Sequence[int], max_tokens: int, grammar: Grammar | None = None) -> Proposal:
        t0 = time.perf_counter()
        n_ctx = len(context)
        if self._indexed > n_ctx:  # within a request the context only grows
            self.begin(None)  # type: ignore[arg-type]
        # Index every n-gram that has at least one following token: end <= n_ctx - 1.
        index = self._index
        for end in range(max(self._indexed, self.min_n), n_ctx):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index[tuple(context[end - n : end])] = end
        self._indexed = max(self._indexed, n_ctx)
        tokens: list[int] = []
        for n in range(min(self.max_n, n_ctx), self.min_n - 1, -1):
            end = index.get(tuple(context[n_ctx - n :]))
            if end is not None:
                tokens = list(context[end : end + max_tokens])
                break
        return Proposal(tokens, None, time.perf_counter() - t0)

    def lag(self, context: Sequence[int]) -> int:
        return 0  # indexing new tokens is a dictionary insert each


class ModelDrafter:
    """A small model on the target's vocabulary, with its own KV cache kept in step.

    Each call reuses the KV prefix it shares with the committed context, drops what was rejected,
    and decodes only the new tokens. It drafts the argmax when the request is greedy and samples
    from q otherwise, stopping early when its confidence (top probability) falls below p_min."""

    name = "model"
    has_cost = True

    def __init__(self, ctx: Context, p_min: float = 0.0) -> None:
        self.ctx = ctx
        self.p_min = p_min
        self._sampler: Sampler | None = None

    def begin(self, sampler: Sampler) -> None:
        self._sampler = sampler

    def propose(self, context: Sequence[int], max_tokens: int, grammar: Grammar | None = None) -> Proposal:
        assert self._sampler is not None, "begin() first"
        t0 = time.perf_counter()
        ctx, sampler = self.ctx, self._sampler
        keep = self._reusable(context)
        ctx.truncate(keep)
        history = list(context)
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        walker = grammar.clone() if grammar is not None else None
        try:
            caught_up = len(context) - 1 - keep
            if caught_up:
                ctx.prefill(context[keep:-1])
            if caught_up > 2:
                # A catch-up after target-only stretches is a one-off, timed apart. The token or
                # two missed after a fully accepted round recur, so they count as drafting cost.
                t_steps = time.perf_counter()
            else:
                t_steps, caught_up = t0, 0
            logits = ctx.decode([context[-1]], rows=[0])[0]
            for i in range(max_tokens):
                q = sampler.probs(logits, history, walker)
                if self.p_min > 0.0 and float(q.max()) < self.p_min:
                    break
                tok = sampler.draw(q)
                tokens.append(tok)
                qs.append(q)
                history.append(tok)
                if i + 1 < max_tokens:
                    if walker is not None:
                        if ctx.weights.is_eog(tok):
                            break  # the target stops there; a grammar has no state past the end
                        walker.accept(tok)
                    logits = ctx.decode([tok], rows=[0])[0]
        except ContextFull:
            t_steps, caught_up = time.perf_counter(), 0
        finally:
            if walker is not None:
                walker.close()
        now = time.perf_counter()
        return Proposal(tokens, qs, now - t0, now - t_steps, caught_up)

    def lag(self, context: Sequence[int]) -> int:
        return len(context) - 1 - self._reusable(context)

    def _reusable(self, context: Sequence[int]) -> int:
        """Cached positions that match `context`; the last token is always decoded afresh."""
        return min(common_prefix(self.ctx.tokens, context), len(context) - 1)
