"""Sampling, written once.

`Sampler.probs(logits, history)` turns raw logits into the exact probability vector that the next
token is drawn from. Plain decoding samples from it, the draft model draws its proposal from it
(q), and the speculative verifier scores draft tokens with it (p): because all three go through this
one function, p and q are shaped by the same penalties, top-k, temperature, top-p and min-p.

The order follows Ollama's own sampler (sample/samplers.go): penalties on logits, then top-k,
temperature, softmax, top-p, min-p. Temperature 0 is greedy: a one-hot vector on the argmax of the
penalised logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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

    def probs(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The final sampling distribution over the whole vocabulary (float64, sums to 1)."""
        p = self.params
        logits = self.penalise(logits, history)
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
        # Inverse-CDF draw: one uniform per token, the same number as plain decoding uses.
        c = np.cumsum(probs)
        return int(min(np.searchsorted(c, self.rng.random() * c[-1], side="right"), len(c) - 1))
