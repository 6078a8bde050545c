"""Prompts' KV cells kept in host memory after their stream is given to another prompt.

A target context has one KV stream per sequence it runs at once, and a finished sequence's stream
keeps what it held (the prefix cache, engine.step). With few streams that memory is short: Open
WebUI sends a title request beside each chat, and once the titles have taken both streams of a
`num_parallel: 2` target, the next chat prefills its whole system prompt and tool list again
(bench/results/2026-12-07-interactive.md). llama-server keeps such prompts in host memory
(`--cache-ram`, 8 GiB by default) and loads the best one back into a slot; this does the same.

When a new prompt takes a stream and would drop at least MIN_SAVE of its fresh tokens, the
stream's cells are copied out first (`Context.save`, llama_state_seq_get_data). When a new
prompt's stream and the other streams hold less of it than a kept snapshot does (by MIN_COPY
tokens, engine.step), the snapshot is loaded into its stream (`Context.restore`) and the prompt
keeps the part it shares. The cells come back byte for byte into an emptied stream, from cell 0,
so a restored prefix scores the next rows exactly as a prefill of it would (tests/test_hostcache
.py compares the logits). Snapshots are dropped least recently used first to stay within the
budget (`runtime.cache_ram`, MiB); one that extends another replaces it.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.engine.drafters import common_prefix
from sidecar.engine.llama import Context, Snapshot

MIN_SAVE = 64  # a stream whose new prompt drops fewer of its tokens than this is not saved


class HostCache:
    """Snapshots of streams' prompts, newest last, within `budget` bytes (module docstring)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.kept: list[Snapshot] = []  # least recently used first
        self.size = 0  # bytes held

    def exchange(self, ctx: Context, seq: int, prompt: Sequence[int], have: int, beat: int) -> int:
        """Before stream `seq` takes `prompt`, of which it holds `have` tokens: keep what the prompt
        would drop of it, and load back the snapshot that holds the most of the prompt where that
        is at least `beat` tokens. The tokens loaded back (0: none, `seq` is as it was or empty)."""
        if ctx.fresh_of(seq) - have >= MIN_SAVE:
            self.put(ctx.save(seq))
        snap, kept = self.best(prompt)
        kept = min(kept, len(prompt) - 1)  # the last prompt token is always decoded afresh (Sequence.start)
        if snap is None or kept < beat:
            return 0
        self.touch(snap)
        return kept if ctx.restore(seq, snap) else 0

    def best(self, prompt: Sequence[int]) -> tuple[Snapshot | None, int]:
        """The snapshot that holds the longest part of `prompt`, and how long that part is."""
        found, most = None, 0
        for snap in self.kept:
            if (n := common_prefix(snap.tokens, prompt)) > most:
                found, most = snap, n
        return found, most

    def touch(self, snap: Snapshot) -> None:
        """A snapshot was used: it goes last, to be dropped last."""
        self.kept.remove(snap)
        self.kept.append(snap)

    def put(self, snap: Snapshot) -> None:
        """Keep a stream's snapshot: it replaces those it extends, and is not kept where another
        already holds all of it; the oldest go until the budget holds."""
        n = len(snap.tokens)
        for old in self.kept:
            if len(old.tokens) >= n and old.tokens[:n] == snap.tokens:
                self.touch(old)
                return
        if snap.data.size > self.budget:
            return
        self.kept = [*(old for old in self.kept if old.tokens != snap.tokens[:len(old.tokens)]), snap]
        self.size = sum(s.data.size for s in self.kept)
        while self.size > self.budget:
            self.size -= self.kept.pop(0).data.size
