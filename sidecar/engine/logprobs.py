"""Log probabilities of emitted tokens (Ollama's `logprobs` / `top_logprobs`).

They are the target's, from its raw logits: the log-softmax of the row that scored the token, before
penalties, grammar or truncation shape it, as llama-server reports them with post_sampling_probs
off (the mode Ollama uses). Under speculation that row comes from the verify batch, which on the
CPU build holds the same numbers a plain step would, so the values do not depend on the drafter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class Alternative(NamedTuple):
    """One of the most likely tokens at a position."""

    token: str
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token, its log probability, and the `top` most likely tokens (best first)."""

    id: int
    token: str  # its text, decoded on its own (errors="replace"): a piece may split a character
    bytes: bytes
    logprob: float
    top: tuple[Alternative, ...] = ()


@dataclass(frozen=True)
class Logprobs:
    """What the decoder yields right before the text of the tokens it describes, one entry each."""

    entries: tuple[TokenLogprob, ...]


def token_logprob(logits: np.ndarray, token: int, n_top: int, text: Callable[[int], bytes]) -> TokenLogprob:
    """The entry for `token` drawn at a position whose raw logits are `logits`.

    Ties among the top tokens go to the lower id, so the order is a function of the logits alone."""
    x = logits.astype(np.float64)
    peak = float(x.max())
    norm = peak + float(np.log(np.exp(x - peak).sum()))
    top: tuple[Alternative, ...] = ()
    if n_top > 0:
        k = min(n_top, len(x))
        # Every token tied with the k-th best is a candidate, so the cut does not depend on how
        # argpartition happens to order equal values.
        floor = x[np.argpartition(-x, k - 1)[k - 1]]
        ids = np.flatnonzero(x >= floor)
        ids = ids[np.lexsort((ids, -x[ids]))][:k]
        top = tuple(_alternative(int(i), float(x[i]) - norm, text) for i in ids)
    raw = text(token)
    return TokenLogprob(token, raw.decode("utf-8", "replace"), raw, float(x[token]) - norm, top)


def _alternative(token: int, logprob: float, text: Callable[[int], bytes]) -> Alternative:
    raw = text(token)
    return Alternative(raw.decode("utf-8", "replace"), raw, logprob)
