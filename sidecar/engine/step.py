"""The step loop: the one place that decodes on a target's llama.cpp context.

Each step asks a sequence (engine.sequence) for the rows it needs scored, applies the KV cache
changes it asks for (keep its first `kv_len` positions, shift a full window), decodes the rows in
one llama_decode, and hands the logits back with the seconds the decode took. The sequence never
touches the context, so the same sequence can be stepped inside a batch of many.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from sidecar.engine.llama import Context, ContextFull
from sidecar.engine.sequence import Item, Sequence


class StepLoop:
    """Steps sequences over one target context, which it owns (one thread at a time)."""

    def __init__(self, target: Context) -> None:
        self.target = target

    def run(self, seq: Sequence) -> Iterator[Item]:
        """Step one sequence to its end: its output as it becomes final, then its Result."""
        target = self.target
        try:
            target.truncate(seq.start(target.tokens, target.fresh))
            while (rows := seq.rows()) is not None:
                if rows.shift is not None:
                    target.shift(*rows.shift)
                if not rows.logits:
                    target.prefill(rows.tokens)
                    seq.take(None)
                    continue
                t = time.perf_counter()
                try:
                    logits = target.decode(rows.tokens)
                except ContextFull:
                    seq.full()
                    continue
                seconds = time.perf_counter() - t
                yield from seq.take(logits, seconds)
                target.truncate(seq.kv_len)
            yield from seq.finish()
        finally:
            seq.close()
