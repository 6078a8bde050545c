"""Sampling, written once.

`Sampler.probs(logits, history)` turns raw logits into the exact probability vector that the next
token is drawn from. Plain decoding samples from it, the draft model draws its proposal from it
(q), and the speculative verifier scores draft tokens with it (p): because all three go through this
one function, p and q are shaped by the same penalties, top-k, temperature, top-p and min-p.

The order follows Ollama's own sampler (sample/samplers.go): penalties on logits, then top-k,
temperature, softmax, top-p, min-p. Temperature 0 is greedy: a one-hot vector on the argmax of the
penalised logits.

A grammar (`format`, engine.grammar) enters as a `Mask`: forbidden tokens get -inf logits before
the penalties and truncation shape them, so the distribution is the one the grammar-constrained
target would sample from. Asking the grammar about all 49k tokens of a real vocabulary costs
milliseconds, so the mask is applied lazily where that gives the same result: greedy checks the
argmax first, and top-k sampling checks the best candidates first (the top k allowed tokens are
all a top-k distribution needs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Ollama's sampling options with Ollama's defaults (api/types.go DefaultOptions)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalised(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )


class Mask(Protocol):
    """Which tokens may come next (a grammar state); asking never changes the state."""

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        """A bool per id."""
        ...


class NoTokenAllowed(ValueError):
    """The mask forbids every token: the grammar has nowhere to go."""


def _masked(logits: np.ndarray, mask: Mask, ids: np.ndarray | None = None) -> np.ndarray:
    """logits with -inf outside `ids`' allowed tokens (ids default: the whole vocabulary)."""
    if ids is None:
        ids = np.arange(logits.shape[0], dtype=np.int32)
    ok = ids[mask.allowed(ids)]
    if len(ok) == 0:
        raise NoTokenAllowed("the grammar allows no token here")
    out = np.full(logits.shape[0], -np.inf, dtype=np.float32)
    out[ok] = logits[ok]
    return out


def _greedy_masked(logits: np.ndarray, mask: Mask) -> np.ndarray:
    """logits, or masked logits when the argmax is forbidden: either way the masked argmax."""
    if mask.allowed(np.array([int(np.argmax(logits))], dtype=np.int32))[0]:
        return logits
    return _masked(logits, mask)


class Sampler:
    """Processes logits into probabilities and draws tokens, for one request.

    The random generator is per request, so a fixed `seed` reproduces a run."""

    def __init__(self, params: SamplingParams, n_vocab: int, n_ctx: int) -> None:
        self.params = params
        self.n_vocab = n_vocab
        last_n = params.repeat_last_n
        self._last_n = n_ctx if last_n < 0 else last_n
        seed = params.seed if params.seed >= 0 else None
        self.rng = np.random.default_rng(seed)

    @property
    def history_window(self) -> int:
        """How many trailing tokens the penalties look at (0: history is not needed)."""
        return self._last_n if self.params.penalised else 0

    def penalise(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """llama.cpp's penalties over the last `repeat_last_n` tokens of prompt + output."""
        p = self.params
        if not p.penalised or not history:
            return logits
        window = np.asarray(history[-self._last_n :], dtype=np.int64)
        ids, counts = np.unique(window, return_counts=True)
        ids_ok = ids < logits.shape[0]
        ids, counts = ids[ids_ok], counts[ids_ok]
        out = logits.astype(np.float32, copy=True)
        vals = out[ids]
        if p.repeat_penalty != 1.0:
            vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        vals = vals - counts * p.frequency_penalty - p.presence_penalty
        out[ids] = vals
        return out

    def choice_logits(self, logits: np.ndarray, history: Sequence[int], mask: Mask | None = None) -> np.ndarray:
        """Penalised (and masked) logits whose argmax is the greedy choice; cheaper than probs().

        Only the argmax is meaningful: when the unmasked argmax is allowed it is also the masked
        one (masking only lowers logits), so the mask is computed only when it is not."""
        logits = self.penalise(logits, history)
        return logits if mask is None else _greedy_masked(logits, mask)

    def _apply_mask(self, logits: np.ndarray, mask: Mask) -> np.ndarray:
        """Mask penalised logits, asking the grammar about as few tokens as the result allows.

        With top-k on, the distribution depends only on the k best allowed tokens: if the best
        candidates already hold k allowed ones, no other token can enter. Otherwise (or with
        top-k off) every token is asked."""
        p = self.params
        n = logits.shape[0]
        if p.greedy:
            return _greedy_masked(logits, mask)
        k = p.top_k if 0 < p.top_k < n else n
        m = min(n, max(4 * k, 256))
        if k < n and m < n:
            cand = np.argpartition(logits, -m)[-m:].astype(np.int32)
            ok = mask.allowed(cand)
            if int(ok.sum()) >= k:
                out = np.full(n, -np.inf, dtype=np.float32)
                out[cand[ok]] = logits[cand[ok]]
                return out
        return _masked(logits, mask)

    def probs(self, logits: np.ndarray, history: Sequence[int], mask: Mask | None = None) -> np.ndarray:
        """The final sampling distribution over the whole vocabulary (float64, sums to 1)."""
        p = self.params
        logits = self.penalise(logits, history)
        if mask is not None:
            logits = self._apply_mask(logits, mask)
        out = np.zeros(logits.shape[0], dtype=np.float64)
        if p.greedy:
            out[int(np.argmax(logits))] = 1.0
            return out
        n = logits.shape[0]
        k = p.top_k if 0 < p.top_k < n else n
        ids = np.argpartition(logits, -k)[-k:] if k < n else np.arange(n)
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        # Subtract the max before dividing, and clamp as Ollama does: a tiny temperature must not
        # overflow into NaN.
        x = (logits[ids].astype(np.float64) - float(logits[ids[0]])) / max(p.temperature, 1e-7)
        x = np.exp(x)
        x /= x.sum()
        keep = len(x)
        if p.top_p < 1.0:
            # Keep tokens up to the first whose running mass exceeds top_p (Ollama's topP; 0 keeps one).
            keep = min(keep, int(np.searchsorted(np.cumsum(x), p.top_p, side="right")) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(x[:keep] >= p.min_p * x[0]))))
        x = x[:keep]
        out[ids[:keep]] = x / x.sum()
        return out

    def draw(self, probs: np.ndarray) -> int:
        """One token from a probability vector (argmax when it is one-hot)."""
        if self.params.greedy:
            return int(np.argmax(probs))
        return draw(probs, self.rng)


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a (possibly unnormalised) probability vector.

    Inverse-CDF with one uniform per token: plain decoding, a model draft and the verifiers all
    draw this way, so a seeded run consumes the generator identically on every path."""
    c = np.cumsum(probs)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(c) - 1))
