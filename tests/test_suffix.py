"""SuffixCache and SuffixDrafter: cross-request drafts, on plain token lists and on real llama.cpp."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.cost import CostModel
from sidecar.engine.decoder import Decoder, Request, Result
from sidecar.engine.drafters import NgramDrafter
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.sampling import SamplingParams
from sidecar.engine.suffix import FORMAT_VERSION, LEVELS, Continuation, SuffixCache, SuffixDrafter

pytestmark = pytest.mark.model

ANSWER = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]
TEMPLATE = [7, 8, 9]  # stands for the chat template's "assistant" turn


def naive(seqs: list[list[int]], context: Sequence[int], max_tokens: int, factor: float = 1.0,
          min_prob: float = 0.1, max_depth: int = 64) -> Continuation:
    """Reference: every position of every sequence, its match with the tail, the best match's class
    (longest first, then newest), and the majority path over those rows, one row at a time, with
    each step's vote."""
    tail = list(context[-max_depth:])
    found = []
    for si, seq in enumerate(seqs):
        full = [*seq, -1]
        for p in range(1, len(full)):
            m = 0
            while m < len(tail) and m < p and full[p - 1 - m] == tail[-1 - m]:
                m += 1
            found.append((m, si, p, full))
    best = max((f[0] for f in found), default=0)
    if best < LEVELS[0] or max_tokens <= 0:
        return Continuation()
    limit = min(max_tokens, max(1, int(best * factor + 1e-6)))
    chosen = sorted((f for f in found if f[0] >= 1 << (best.bit_length() - 1)), key=lambda f: (-f[0], -f[1], -f[2]))
    rows = [(f[3][f[2] : f[2] + limit] + [-1] * limit)[:limit] for f in chosen]
    alive, p, tokens, probs, agreeing, votes = rows, 1.0, [], [], 0, []
    for j in range(limit):
        going = [r[j] for r in alive if r[j] != -1]
        if not going:
            break
        tok = max(dict.fromkeys(going), key=going.count)
        p *= going.count(tok) / len(alive)
        if p < min_prob:
            break
        agreeing = agreeing or going.count(tok)
        tokens.append(tok)
        probs.append(p)
        votes.append((going.count(tok), len(alive)))
        alive = [r for r in alive if r[j] == tok]
    return Continuation(tokens, probs, best, len(rows), agreeing, votes)


def test_learns_and_proposes_a_repeated_answer() -> None:
    """The same question in a fresh chat: the prompt's end taught with the answer lets the whole
    answer be drafted from the first output token on."""
    cache = SuffixCache(10_000)
    drafter = SuffixDrafter(cache)
    prompt = [1, 2, 3, 4, 5, *TEMPLATE]
    drafter.begin(None)
    assert drafter.propose(prompt, 0).support.ready is False
    drafter.finish(prompt, ANSWER, "stop")
    drafter.begin(None)
    assert drafter.propose(prompt, 8).tokens == ANSWER[:8]
    s = drafter.propose(prompt, 0).support
    assert s.ready and s.cls == SuffixDrafter.classify(len(prompt), 1, 1).cls
    assert drafter.propose([*prompt, *ANSWER[:5]], 16).tokens == ANSWER[5:]  # the rest, up to its end
    p = drafter.propose(prompt, 4)
    assert p.q is None and p.lag == 0
    assert SuffixDrafter.has_cost is False and SuffixDrafter.name == "suffix"


def test_a_longer_match_drafts_more() -> None:
    cache = SuffixCache(10_000)
    cache.add([20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33])
    short = cache.lookup([99, 24, 25], 16)  # 2 tokens matched: at most 2 drafted
    long = cache.lookup([20, 21, 22, 23, 24, 25], 16)
    assert (short.match, short.tokens) == (2, [26, 27])
    assert (long.match, long.tokens) == (6, [26, 27, 28, 29, 30, 31])
    assert cache.lookup([20, 21, 22, 23, 24, 25], 16, factor=2.0).tokens == list(range(26, 34))
    assert cache.lookup([20, 21, 22, 23, 24, 25], 3).tokens == [26, 27, 28]
    assert cache.lookup([98, 99], 16) == Continuation()
    assert cache.lookup([25], 16) == Continuation()  # one token is no match across requests


def test_frequency_picks_the_majority_continuation() -> None:
    cache = SuffixCache(10_000)
    for tail in ([70, 71, 72], [80, 81, 82], [70, 71, 73]):
        cache.add([10, 11, 12, 13, *tail])
    c = cache.lookup([5, 10, 11, 12, 13], 8)
    # Two of three go on with 70, 71; those two then part one to one, and the newer one is taken.
    assert c.tokens == [70, 71, 73]
    assert (c.match, c.occurrences, c.agreeing) == (4, 3, 2)
    assert c.probs == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert cache.lookup([5, 10, 11, 12, 13], 8, min_prob=0.4).tokens == [70, 71]


def test_the_longest_match_wins_over_a_frequent_shorter_one() -> None:
    cache = SuffixCache(10_000)
    cache.add([1, 2, 3, 4, 5, 6, 40])
    for _ in range(5):
        cache.add([9, 4, 5, 6, 30])
    assert cache.lookup([2, 3, 4, 5, 6], 1).tokens == [40]  # 5 tokens matched, once
    assert cache.lookup([0, 4, 5, 6], 1).tokens == [30]


def test_ends_of_sequences_count_against_a_branch() -> None:
    cache = SuffixCache(10_000)
    cache.add([1, 2, 3, 4])
    cache.add([1, 2, 3])
    cache.add([1, 2, 3])
    c = cache.lookup([1, 2, 3], 4)
    assert (c.tokens, c.probs) == ([4], [pytest.approx(1 / 3)])
    assert cache.lookup([1, 2, 3], 4, min_prob=0.5).tokens == []


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), max_size=14), min_size=1, max_size=4),
    context=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    max_tokens=st.integers(0, 9),
)
def test_lookup_matches_a_naive_search(seqs: list[list[int]], context: list[int], max_tokens: int) -> None:
    """Within PROBES occurrences per n-gram, the cache finds exactly what scanning everything would."""
    cache = SuffixCache(10_000)
    for s in seqs:
        cache.add(s)
    kept = [s for s in seqs if len(s) >= LEVELS[0]]
    assert cache.lookup(context, max_tokens, min_prob=0.2) == naive(kept, context, max_tokens, min_prob=0.2)


def test_a_deep_match_through_every_level() -> None:
    rng = np.random.default_rng(0)
    noise = [rng.integers(100, 200, 90).tolist() for _ in range(3)]
    cache = SuffixCache(10_000)
    for s in noise:
        cache.add(s)
    for cut in (4, 9, 20, 40, 80):
        c = cache.lookup(noise[1][:cut], 8)
        assert c.match == min(cut, 64) and c.tokens == noise[1][cut : cut + min(8, cut)], cut


# -- memory bound and eviction ------------------------------------------------------------------


def test_eviction_keeps_the_bound_and_evicts_the_oldest_whole_requests() -> None:
    cache = SuffixCache(100)
    seqs = [[i * 100 + j for j in range(30)] for i in range(1, 6)]  # 31 slots each with the separator
    for k, s in enumerate(seqs):
        cache.add(s)
        assert cache.size <= 100
        assert cache.sequences == min(k + 1, 3)
    for s in seqs[:2]:  # evicted, wholly: not even their ends remain
        assert cache.lookup(s[:2], 4) == Continuation()
        assert cache.lookup(s[-3:-1], 4) == Continuation()
    for s in seqs[2:]:
        assert cache.lookup(s[:4], 4).tokens == s[4:8]
    assert cache.size == 93


def test_matches_stop_at_the_oldest_sequence_and_run_across_the_ring_end() -> None:
    cache = SuffixCache(64)
    cache.add([5, 6, 7])
    assert cache.lookup([0, 5, 6], 4).match == 2  # the never-written slot before it is no context
    cache.add(list(range(100, 150)))  # 51 slots
    cache.add(list(range(200, 230)))  # 31 more: both earlier ones go; this one wraps past slot 63
    assert cache.sequences == 1
    c = cache.lookup([204, 205, 206, 207, 208, 209], 4)
    assert (c.match, c.tokens) == (6, [210, 211, 212, 213])
    assert cache.lookup([100, 101], 2) == Continuation()


def test_a_sequence_longer_than_the_cache_keeps_its_end() -> None:
    cache = SuffixCache(64)
    cache.add(list(range(1000, 1200)))
    assert cache.size == 64 and cache.sequences == 1
    assert cache.lookup([1190, 1191], 4).tokens == [1192, 1193]
    assert cache.lookup([1100, 1101], 4) == Continuation()


def test_positions_are_rebased_before_int32_runs_out() -> None:
    cache = SuffixCache(100)
    cache._POS_LIMIT = 1000  # type: ignore[misc]  # reached after a few dozen sequences here
    for i in range(200):  # 1400 positions
        cache.add([i % 7 + 1, 50 + i % 5, 60, 61, 62, 63])
        assert cache._next < 1000 and cache.size <= 100
    assert cache.lookup([199 % 7 + 1, 50 + 199 % 5, 60], 3).tokens == [61, 62, 63]
    assert cache.lookup([9, 60, 61], 8).occurrences >= 10


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SuffixCache(10)
    with pytest.raises(ValueError, match="max_depth"):
        SuffixCache(1000, max_depth=8)
    for bad in ([1, -1, 2], [1, 2**31, 2]):
        with pytest.raises(ValueError, match="token ids"):
            SuffixCache(1000).add(bad)
    cache = SuffixCache(1000)
    cache.add([5])  # too short to match anything: not stored
    assert cache.size == 0


# -- persistence ----------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path: Path) -> None:
    cache = SuffixCache(1000, vocab="v1")
    seqs = [[i, i + 1, 10, 11, 12, i + 2] for i in range(20, 40)]
    for s in seqs:
        cache.add(s)
    path = tmp_path / "cache.npz"
    cache.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["cache.npz"]  # no temporary left
    again = SuffixCache(1000, vocab="v1")
    again.add([1, 2, 3])  # replaced by the file's contents
    assert again.load(path)
    assert (again.size, again.sequences) == (cache.size, cache.sequences)
    for ctx in ([25, 26, 10], [10, 11], [1, 2], [30, 31, 10, 11, 12]):
        assert again.lookup(ctx, 4) == cache.lookup(ctx, 4)
    small = SuffixCache(70, vocab="v1")  # 10 sequences of 7 slots fit: the newest are kept
    assert small.load(path)
    assert small.sequences == 10
    assert small.lookup([29, 30], 2) == Continuation() and small.lookup([30, 31], 2).tokens == [10, 11]


def test_an_unusable_file_is_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = SuffixCache(1000, vocab="v1")
    good.add([1, 2, 3, 4])
    path = tmp_path / "cache.npz"
    good.save(path)
    data = path.read_bytes()
    files = {"garbage": b"not a cache at all", "truncated": data[: len(data) // 2], "empty": b""}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    np.savez(tmp_path / "future.npz", version=np.int32(FORMAT_VERSION + 1), vocab=np.str_("v1"),
             tokens=np.array([1, 2, -1], np.int32))
    np.savez(tmp_path / "cut.npz", version=np.int32(FORMAT_VERSION), vocab=np.str_("v1"),
             tokens=np.array([1, 2, -1, 3, 4], np.int32))
    np.savez(tmp_path / "nokey.npz", version=np.int32(FORMAT_VERSION))
    cache = SuffixCache(1000, vocab="v1")
    cache.add([7, 8, 9])
    for name in [*files, "future.npz", "cut.npz", "nokey.npz"]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sidecar.engine"):
            assert cache.load(tmp_path / name) is False
        assert "ignored" in caplog.text, name
        assert cache.lookup([7, 8], 1).tokens == [9]  # the cache is left as it was
    assert SuffixCache(1000, vocab="v2").load(path) is False  # another vocabulary's ids
    caplog.clear()
    assert cache.load(tmp_path / "missing.npz") is False  # a first start: nothing to say
    assert caplog.text == ""


# -- threads ------------------------------------------------------------------------------------


def test_threads_adding_and_looking_up() -> None:
    """Six threads add and look up at once. In a cache with room for everything (`roomy`) a thread
    always finds the sequence it just added. In one that evicts (`tight`) another thread may evict
    it before the lookup (how many sequences others add meanwhile is up to the scheduler), so
    there a lookup only has to find a real continuation: every sequence holds ANSWER, so at least
    its 50, 51, 52 match, and what follows is ANSWER's."""
    roomy, tight = SuffixCache(20_000), SuffixCache(5_000)  # 6 x 150 sequences of 20 slots: 18,000
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for i in range(150):
                seq = [*rng.integers(0, 20, 5).tolist(), *ANSWER, seed, i]
                roomy.add(seq)
                c = roomy.lookup(seq[:8], 8)
                assert c.match >= 8 and c.tokens[:4] == ANSWER[3:7]
                tight.add(seq)
                c = tight.lookup(seq[:8], 8)
                assert c.match >= 3 and c.tokens and c.tokens == ANSWER[3 : 3 + len(c.tokens)]
                assert tight.size <= 5_000
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert roomy.sequences == 6 * 150 and roomy.size == roomy.sequences * (len(ANSWER) + 8)
    assert tight.size <= 5_000 and tight.size == tight.sequences * (len(ANSWER) + 8)


# -- the drafter ------------------------------------------------------------------------------------


def test_support_classes_are_the_match_and_the_vote_and_ordered() -> None:
    """Classes are the suffix source's own (the planner keys them by source): 10 c + f."""
    seen: dict[int, tuple[int, int]] = {}
    for match in range(2, 100):
        for occurrences, agreeing in ((1, 1), (2, 2), (3, 2), (5, 5), (10, 3), (40, 39)):
            s = SuffixDrafter.classify(match, occurrences, agreeing)
            assert s.prior is not None and 0 < s.prior < 1
            c, f = divmod(s.cls, 10)
            assert c == min(match, 64).bit_length() - 1 and f in (0, 1, 2)
            assert seen.setdefault(s.cls, (c, f)) == (c, f)
    assert set(seen) == {10 * c + f for c in range(1, 7) for f in range(3)}
    for c in range(1, 7):  # more agreement, more acceptance expected; and a longer match, too
        row = [SuffixDrafter.classify(1 << c, o, a) for o, a in ((10, 3), (1, 1), (5, 5))]
        assert [s.cls % 10 for s in row] == [0, 1, 2]
        assert [s.prior for s in row] == sorted(s.prior for s in row if s.prior is not None)
        if c > 1:
            assert row[1].prior > SuffixDrafter.classify(1 << (c - 1), 1, 1).prior  # type: ignore[operator]
    # A lone earlier output, matched verbatim: the n-gram drafter's prior for the same match.
    assert SuffixDrafter.classify(16, 1, 1).prior == pytest.approx(NgramDrafter().propose(
        [*range(16), 99, *range(16)], 0).support.prior)
    # Under each class, the ones it is no worse than: one match class shorter, one vote level lower
    # (a repeated answer's classes climb a level per request; their evidence is not lost).
    assert [u.cls for u in SuffixDrafter.classify(64, 3, 3).under] == [52, 61]
    assert [u.cls for u in SuffixDrafter.classify(2, 10, 3).under] == [0]


def test_finish_teaches_the_prompt_end_and_skips_cancelled_requests() -> None:
    prompt = [1, 2, 3, 4, 5, 6, *TEMPLATE]
    for lead, learned in ((None, 9), (64, 9), (3, 3), (0, 0)):
        cache = SuffixCache(1000)
        SuffixDrafter(cache, lead=lead).finish(prompt, ANSWER, "stop")
        assert cache.size == learned + len(ANSWER) + 1
    cache = SuffixCache(1000)
    drafter = SuffixDrafter(cache)
    drafter.finish(prompt, ANSWER, "cancel")
    drafter.finish(prompt, [], "stop")
    assert cache.size == 0
    drafter.finish(prompt, ANSWER[:6], "length")  # cut by num_predict: still what the model said
    assert drafter.propose(prompt, 8).tokens == ANSWER[:6]


def test_support_and_propose_share_a_lookup_until_the_context_grows() -> None:
    cache = SuffixCache(1000)
    drafter = SuffixDrafter(cache)
    cache.add([*TEMPLATE, *ANSWER])
    ctx = [0, *TEMPLATE]
    assert drafter.propose(ctx, 0).support.ready
    cache.add([*TEMPLATE, 99, 98, 97])  # another request finishes between support() and propose()
    assert drafter.propose(ctx, 4).tokens == ANSWER[:3]  # capped by the 3-token match
    ctx.append(ANSWER[0])
    assert drafter.propose(ctx, 2).tokens == ANSWER[1:3]
    drafter.begin(None)
    assert drafter.propose([0, *TEMPLATE], 4).tokens == [99, 98, 97]  # newest of two equals


# -- on real llama.cpp --------------------------------------------------------------------------


def test_a_repeated_request_is_drafted_from_the_cache_and_stays_lossless(tiny_endless: Path) -> None:
    weights = Weights(tiny_endless, n_gpu_layers=0)
    ctx = Context(weights, ContextParams(n_ctx=512, n_threads=1))
    greedy = SamplingParams(temperature=0.0)
    config = SpeculativeConfig(n_max=6, p_min=0.0, min_predict=0, adaptive=False)  # draft whatever is there

    def run(prompt: list[int], drafter: SuffixDrafter | None) -> Result:
        ctx.clear()
        events = list(Decoder(ctx, drafter, config, CostModel(config.n_max + 1)).generate(
            Request(prompt, greedy, num_predict=48, speculate=drafter is not None)))
        result = events[-1]
        assert isinstance(result, Result)  # the decoder has taught the cache by now (Decoder.generate)
        return result

    try:
        drafter = SuffixDrafter(SuffixCache(10_000))
        ask = weights.tokenize("<|im_start|>user\nsay it again<|im_end|>\n<|im_start|>assistant\n",
                               add_special=False, parse_special=True)
        other = weights.tokenize("<|im_start|>user\nsomething else<|im_end|>\n<|im_start|>assistant\n",
                                 add_special=False, parse_special=True)
        plain, plain_other = run(ask, None), run(other, None)
        first = run(ask, drafter)
        assert first.tokens == plain.tokens and first.draft_tokens == 0  # nothing learned yet
        second = run(ask, drafter)
        assert second.tokens == plain.tokens
        assert second.draft_tokens > 0 and second.draft_accepted_tokens > 0
        assert second.drafter == "suffix"
        # Another question gets the cache's drafts too (they share the template); output unchanged.
        assert run(other, drafter).tokens == plain_other.tokens
    finally:
        ctx.close()
        weights.close()


def test_a_draft_is_priced_to_hold_through_a_shared_skeleton_not_into_a_value() -> None:
    """Two earlier outputs share the keys and differ in the value after one: the draft's tokens
    up to the split are of an agreeing class, the value's is a split one, and past the
    continuation's end nothing is expected."""
    cache = SuffixCache(10_000)
    drafter = SuffixDrafter(cache, lead=0)
    key, rest = [50, 51, 52, 53], [60, 61]
    drafter.finish([], [*key, 70, *rest], "stop")
    drafter.finish([], [*key, 80, *rest], "stop")
    support = drafter.propose([9, 50, 51], 0).support
    assert support.along is not None
    first, at_value = support.along(0), support.along(2)
    assert first.prior is not None and at_value.prior is not None
    assert at_value.prior < first.prior  # the outputs split on the value
    n = len(drafter.propose([9, 50, 51], 16).tokens)
    assert support.along(n).prior == 0.0
