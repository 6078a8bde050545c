"""One sequence of a shared llama.cpp context, with a one-sequence context's face.

A target or draft context holds a KV stream per sequence (engine.llama.Context). Code written for
a context of its own (a model drafter's cache, a calibration's scratch decodes) runs on one of
those streams through a `SeqView`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sidecar.engine.llama import Context


class SeqView:
    """One sequence of a shared Context, used as a one-sequence Context is: a model drafter drafts
    on its stream of the draft context, a calibration times decodes on a free stream."""

    def __init__(self, ctx: Context, seq: int) -> None:
        self.base, self.seq = ctx, seq
        self.weights, self.params = ctx.weights, ctx.params
        self.n_ctx, self.n_batch, self.n_vocab = ctx.n_ctx, ctx.n_batch, ctx.n_vocab
        self.n_threads, self.can_shift = ctx.n_threads, ctx.can_shift

    @property
    def tokens(self) -> list[int]:
        return self.base.held(self.seq)

    @property
    def fresh(self) -> int:
        return self.base.fresh_of(self.seq)

    def __len__(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        self.base.truncate(n, self.seq)

    def clear(self) -> None:
        self.base.truncate(0, self.seq)

    def shift(self, keep: int, discard: int) -> bool:
        return self.base.shift(keep, discard, self.seq)

    def prefill(self, tokens: Sequence[int]) -> None:
        self.base.prefill(tokens, self.seq)

    def decode(self, tokens: Sequence[int], rows: Sequence[int] | None = None) -> np.ndarray:
        return self.base.decode(tokens, rows, self.seq)

    def set_threads(self, n: int) -> None:
        self.base.set_threads(n)

    def synchronize(self) -> None:
        self.base.synchronize()
