"""Verifiers: decide how much of a draft the target keeps, without changing its distribution.

Each takes the draft tokens and `p_at(i)`, the target's processed distribution (engine.sampling) at
draft position i given the prefix plus draft[:i]; it returns (accepted, next_token): the first
`accepted` draft tokens are kept and `next_token` follows them (the correction on a rejection, the
bonus token when everything was accepted). `p_at` is lazy because a rejection at i makes every
later row irrelevant, and computing p with penalties costs real time.

- greedy:            accept while the draft equals the target's argmax.
- rejection:         Leviathan/Chen exact rejection sampling with the draft distributions q.
- sample_and_match:  draw from p at each row and accept while it equals the draft; exact for any
                     drafter, used when there is no q (n-gram drafts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from sidecar.engine.sampling import Sampler, draw

DistFn = Callable[[int], np.ndarray]


def verify_greedy(draft: Sequence[int], p_at: DistFn) -> tuple[int, int]:
    """p_at may return anything whose argmax is the target's choice (probabilities or logits)."""
    for i, tok in enumerate(draft):
        best = int(np.argmax(p_at(i)))
        if best != tok:
            return i, best
    return len(draft), int(np.argmax(p_at(len(draft))))


def verify_greedy_rows(logits: np.ndarray, draft: Sequence[int]) -> tuple[int, int]:
    """verify_greedy where the target's choice is each row's plain argmax (no penalties, no grammar):
    `logits` holds the rows (llama.cpp's own buffer, never copied). The argmax is taken a block of
    rows at a time (1, 2, 4, ... rows), up to the block with the first mismatch: a rejection at the
    first row costs one row, and a 65-row copy seven numpy calls rather than 65."""
    n, i, size = len(draft), 0, 1
    while True:
        hi = min(n + 1, i + size)
        for j, best in enumerate(logits[i:hi].argmax(axis=1).tolist(), i):
            if j == n or best != draft[j]:
                return j, best
        i, size = hi, 2 * size


def verify_sample_and_match(
    draft: Sequence[int], p_at: DistFn, rng: np.random.Generator
) -> tuple[int, int]:
    for i, tok in enumerate(draft):
        t = draw(p_at(i), rng)
        if t != tok:
            return i, t
    return len(draft), draw(p_at(len(draft)), rng)


def verify_rejection(
    draft: Sequence[int], q: Sequence[np.ndarray], p_at: DistFn, rng: np.random.Generator
) -> tuple[int, int]:
    """Accept draft[i] with probability min(1, p(x)/q(x)); on rejection draw from norm(max(0, p - q)).

    q[i] must be the distribution draft[i] was really drawn from (one-hot for an argmax draft)."""
    for i, tok in enumerate(draft):
        p = p_at(i)
        qi = q[i]
        px, qx = float(p[tok]), float(qi[tok])
        if qx > 0.0 and rng.random() * qx < px:
            continue
        residual = np.maximum(p - qi, 0.0)
        total = residual.sum()
        # total == 0 only when p == q exactly, where rejection has probability 0; be safe anyway.
        return i, draw(residual if total > 0.0 else p, rng)
    return len(draft), draw(p_at(len(draft)), rng)


def verify(sampler: Sampler, draft: Sequence[int], q: list[np.ndarray] | None, p_at: DistFn) -> tuple[int, int]:
    """The verifier a round calls for: greedy under greedy sampling, rejection sampling where the
    drafter gave its distributions q, sample-and-match otherwise; a round with no draft draws its
    one token from p."""
    if sampler.params.greedy:
        return verify_greedy(draft, p_at)
    if not draft:
        return 0, sampler.draw(p_at(0))
    if q is not None:
        return verify_rejection(draft, q, p_at, sampler.rng)
    return verify_sample_and_match(draft, p_at, sampler.rng)
