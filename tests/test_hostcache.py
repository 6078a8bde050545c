"""Prompts kept in host memory (engine.hostcache): what is kept and dropped, and on real llama.cpp,
that a prompt loaded back scores exactly as a prefill of it does."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.engine.decoder import Request
from sidecar.engine.hostcache import HostCache
from sidecar.engine.llama import Context, ContextParams, Snapshot, Weights
from tests.test_batch import GREEDY, Batch, solo
from tests.test_lossless import chat_prompt


def snap(tokens: list[int], size: int = 10) -> Snapshot:
    return Snapshot(tokens, np.zeros(size, dtype=np.uint8))


@pytest.mark.pure
def test_kept_within_budget_longest_match_and_extensions_replace() -> None:
    cache = HostCache(budget=30)
    a, b = snap([1, 2, 3, 4]), snap([7, 8, 9])
    cache.put(a)
    cache.put(b)
    assert cache.best([1, 2, 3, 5]) == (a, 3)
    assert cache.best([5]) == (None, 0)
    cache.put(snap([1, 2]))  # a part of `a`: nothing new is kept
    assert cache.kept == [b, a] and cache.size == 20  # ... but `a` was used last
    longer = snap([1, 2, 3, 4, 5, 6])
    cache.put(longer)  # extends `a`, which goes
    assert cache.kept == [b, longer] and cache.size == 20
    cache.put(snap([4, 4], size=11))  # over the budget: the least recently used goes
    assert cache.kept[0] is longer and cache.size == 21
    cache.put(snap([6], size=31))  # larger than the whole budget: not kept
    assert cache.size == 21 and len(cache.kept) == 2


@pytest.mark.model
def test_a_restored_stream_scores_as_a_prefill(smollm2_engines: tuple[Weights, Context, Context]) -> None:
    """Saved from one stream, loaded into another that held something else: the next rows' logits
    are those of a fresh prefill, to the bit, whole or cut to a prefix."""
    weights = smollm2_engines[0]
    prompt = weights.tokenize("The quick brown fox jumps over the lazy dog. " * 20, add_special=True,
                              parse_special=False)
    other = weights.tokenize("A title for a chat about the sea. " * 8, add_special=True, parse_special=False)
    ctx = Context(weights, ContextParams(n_ctx=512, n_seq=2))
    ref = Context(weights, ContextParams(n_ctx=512, n_seq=2))
    try:
        ctx.prefill(other, seq=1)
        ctx.prefill(prompt[:-1], seq=0)
        kept = ctx.save(0)
        assert kept.tokens == prompt[:-1] and kept.data.size > 0
        assert ctx.restore(1, kept) and ctx.held(1) == prompt[:-1] and ctx.fresh_of(1) == len(prompt) - 1
        ref.prefill(prompt[:-1], seq=0)
        np.testing.assert_array_equal(ctx.decode([prompt[-1]], seq=1), ref.decode([prompt[-1]], seq=0))
        ctx.prefill(other, seq=0)  # stream 0 now holds another prompt
        assert ctx.restore(0, kept)
        ctx.truncate(40, 0)
        ref.truncate(40, 0)
        np.testing.assert_array_equal(ctx.decode(prompt[40:45], seq=0), ref.decode(prompt[40:45], seq=0))
    finally:
        ctx.close()
        ref.close()


@pytest.mark.model
def test_titles_on_every_stream_leave_the_shared_head_in_host_memory(
        smollm2_engines: tuple[Weights, Context, Context]) -> None:
    """Open WebUI's shape with two streams: a chat, then two title requests that take both streams;
    the next chat with the same system prompt loads the head back instead of prefilling it, and
    says what the target alone says."""
    weights = smollm2_engines[0]
    head = chat_prompt(weights, "You are a careful assistant. " * 40 + "Say hello.")
    titles = [chat_prompt(weights, f"A three-word title for chat {i}, please.") for i in range(2)]
    chat2 = Request(head[:-3] + chat_prompt(weights, "Other question?"), GREEDY, num_predict=12)
    for keep in (False, True):
        b = Batch(weights, 2)
        b.loop.host_cache = HostCache(2**30) if keep else None
        try:
            b.add(0, Request(head, GREEDY, num_predict=4))
            list(b.drain())
            for i, t in enumerate(titles, 1):
                b.add(i, Request(t, GREEDY, num_predict=4))
            list(b.drain())
            b.add(3, chat2)
            list(b.drain())
            cached = b.runs[3].result.prompt_cached  # type: ignore[union-attr]
            if keep:
                assert cached >= len(head) - 4 and b.loop.stats.restored_tokens == cached
                assert b.runs[3].tokens == solo(weights, chat2).tokens
            else:
                assert cached < 16  # the head was gone from both streams
        finally:
            b.close()
