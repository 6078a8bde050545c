"""NgramDrafter (prompt lookup) and common_prefix."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.engine.drafters import NgramDrafter, common_prefix
from sidecar.engine.hybrid import HybridDrafter

pytestmark = pytest.mark.model


def propose(context: Sequence[int], max_tokens: int = 8, min_n: int = 2, max_n: int = 4) -> list[int]:
    return NgramDrafter(min_n, max_n).propose(context, max_tokens).tokens


def naive_lookup(context: Sequence[int], max_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Reference: longest trailing n-gram first, its latest earlier occurrence, what followed it,
    copied on past the context's end from what the copy itself wrote (as LZ77 copies overlap)."""
    size = len(context)
    for n in range(min(max_n, size), min_n - 1, -1):
        tail = list(context[size - n :])
        for end in range(size - 1, n - 1, -1):
            if list(context[end - n : end]) == tail:
                text = list(context)
                for i in range(max_tokens):
                    text.append(text[end + i])
                return text[size:]
    return []


def test_continues_an_earlier_occurrence() -> None:
    #          0  1  2  3  4  5  6  7  8
    context = [1, 2, 3, 4, 5, 6, 9, 2, 3]
    assert propose(context, max_tokens=6) == [4, 5, 6, 9, 2, 3]


def test_a_continuation_that_reaches_the_end_repeats() -> None:
    """The latest earlier occurrence of a loop's n-gram is one period back, so what followed it runs
    into the context's end after a period; the draft goes on as the loop would, a period at a time.
    (A model stuck in "record_record_record_..." drafted 2 tokens a round.)"""
    loop = [5, 1, 6, 1, 6, 1, 6]
    assert propose(loop, max_tokens=7) == [1, 6, 1, 6, 1, 6, 1]
    assert propose([1, 2, 3, 4, 5, 6, 9, 2, 3]) == [4, 5, 6, 9, 2, 3, 4, 5]


def test_proposal_has_no_probabilities_and_no_device_cost() -> None:
    proposal = NgramDrafter().propose([1, 2, 3, 1, 2], 3)
    assert proposal.tokens == [3, 1, 2]
    assert proposal.q is None
    assert NgramDrafter.has_cost is False


def test_the_most_recent_occurrence_wins() -> None:
    context = [7, 8, 1, 7, 8, 2, 7, 8]
    assert propose(context, max_tokens=1) == [2]


def test_the_longest_trailing_ngram_wins_over_a_more_recent_shorter_one() -> None:
    # (5, 7, 8) occurs once, early; (7, 8) more recently. The 3-gram decides.
    context = [5, 7, 8, 1, 2, 7, 8, 3, 5, 7, 8]
    assert propose(context, max_tokens=2) == [1, 2]
    assert propose(context, max_tokens=2, max_n=2) == [3, 5]


def test_max_tokens_is_respected() -> None:
    context = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    for m in range(0, 7):
        assert propose(context, max_tokens=m) == [3, 4, 5, 6, 7, 1][:m]


def test_no_match_proposes_nothing() -> None:
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([]) == []
    assert propose([1]) == []


def test_min_n_is_honoured() -> None:
    context = [1, 9, 2, 3, 9]  # only the 1-gram (9,) recurs
    assert propose(context, min_n=2) == []
    assert propose(context, max_tokens=3, min_n=1) == [2, 3, 9]


def test_max_n_is_honoured() -> None:
    # The 3-gram (1, 2, 3) points at [4]; with max_n = 2 the recent 2-gram (2, 3) points at [6].
    context = [1, 2, 3, 4, 0, 2, 3, 6, 1, 2, 3]
    assert propose(context, max_tokens=1, max_n=3) == [4]
    assert propose(context, max_tokens=1, max_n=2) == [6]


def test_support_measures_the_whole_match_beyond_max_n() -> None:
    """The 4-gram finds the occurrence; the match behind it is 7 tokens long: class 2 (4..7)."""
    d = NgramDrafter(2, 4)
    context = [9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 7]
    s = d.propose(context, 0).support
    assert (s.ready, s.cls, s.prior) == (True, 2, pytest.approx(4 / 6))
    assert d.propose(context, 3).tokens == [8, 0, 1]


def test_support_classes_grow_with_the_match_up_to_its_cap() -> None:
    d = NgramDrafter(2, 4)
    assert d.propose([1, 2, 7, 1, 2], 0).support.cls == 1  # 2..3 tokens
    long = list(range(100, 300))  # a 200-token repeat: class 7 (128..255) if it were not capped
    d.begin(None)
    s = d.propose([*long, 0, *long], 0).support
    assert s.cls == 6  # capped at 64 tokens
    assert s.prior == pytest.approx(64 / 66)


def test_support_without_a_match_is_not_ready() -> None:
    assert NgramDrafter().propose([1, 2, 3, 4], 0).support.ready is False


@pytest.mark.parametrize(("min_n", "max_n"), [(0, 3), (3, 2), (-1, 1)])
def test_bad_sizes_are_rejected(min_n: int, max_n: int) -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(min_n, max_n)


def test_incremental_index_follows_a_growing_context() -> None:
    """Calls with a growing context (as in a decode loop) see n-grams that span old and new tokens."""
    d = NgramDrafter(2, 3)
    context = [10, 11, 12, 13]
    assert d.propose(context, 4).tokens == []
    context += [10, 11]
    assert d.propose(context, 4).tokens == [12, 13, 10, 11]
    context += [14, 12]  # (11, 14) new, (14, 12) new
    assert d.propose(context, 4).tokens == []
    context += [13]  # (12, 13) last seen at positions 2..3, then (14, 12, 13) is new
    assert d.propose(context, 4).tokens == [10, 11, 14, 12]
    context += [10, 11, 14]  # (10, 11, 14) occurred at 4..6
    assert d.propose(context, 4).tokens == [12, 13, 10, 11]


def test_begin_resets_the_index() -> None:
    d = NgramDrafter()
    assert d.propose([1, 2, 3, 1, 2], 2).tokens == [3, 1]
    d.begin(None)  # type: ignore[arg-type]
    assert d.propose([4, 5, 6, 4, 5], 2).tokens == [6, 4]
    # Without begin() a new, longer request would still see the old request's n-grams ...
    d.begin(None)  # type: ignore[arg-type]
    assert d.propose([7, 1, 2, 9, 9, 1, 2], 3).tokens == [9, 9, 1]


def test_a_shorter_context_starts_over() -> None:
    """A context shorter than what was indexed is a new request: the old index must not leak."""
    d = NgramDrafter()
    assert d.propose([1, 2, 3, 4, 5, 6, 1, 2], 2).tokens == [3, 4]
    assert d.propose([8, 1, 2], 2).tokens == []


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    context=st.lists(st.integers(0, 3), max_size=60),
    chunks=st.lists(st.integers(1, 8), min_size=1, max_size=20),
    max_tokens=st.integers(0, 6),
    sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)),
)
def test_incremental_lookup_matches_a_naive_search(
    context: list[int], chunks: list[int], max_tokens: int, sizes: tuple[int, int]
) -> None:
    """Growing the context in random steps, every proposal equals a from-scratch search."""
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    d = NgramDrafter(min_n, max_n)
    end = 0
    for step in [*chunks, len(context)]:
        end = min(len(context), end + step)
        got = d.propose(context[:end], max_tokens).tokens
        assert got == naive_lookup(context[:end], max_tokens, min_n, max_n)


# -- common_prefix ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [([], [], 0), ([1], [], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2),
     ([1, 2, 3], [1, 5, 3], 1), ([9], [1], 0), ((1, 2, 4), [1, 2, 3, 4], 2)],
)
def test_common_prefix_examples(a: Sequence[int], b: Sequence[int], n: int) -> None:
    assert common_prefix(a, b) == n
    assert common_prefix(b, a) == n


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    prefix=st.lists(st.integers(0, 2), max_size=40),
    a=st.lists(st.integers(0, 2), max_size=10),
    b=st.lists(st.integers(0, 2), max_size=10),
)
def test_common_prefix_matches_a_naive_loop(prefix: list[int], a: list[int], b: list[int]) -> None:
    x, y = prefix + a, prefix + b
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    assert common_prefix(x, y) == n


def test_a_long_conversation_is_indexed_when_its_request_begins() -> None:
    """The n-gram index of a conversation is built at admission (HybridDrafter.begin), not in the
    request's first step: that step's host time teaches the host's fit (engine.hosttime), which
    took a 6k-token index (~15 ms) for the price of the step's draft. The first menu then indexes
    only the token that came since, and drafts as it would have."""
    seen = [7 + i % 997 for i in range(6000)]
    ngram, alone = NgramDrafter(), NgramDrafter()
    hybrid = HybridDrafter([ngram])
    hybrid.begin(None, seen)  # type: ignore[arg-type]
    assert ngram._indexed == len(seen)  # the whole conversation, before any step
    seen.append(seen[-997])
    got = hybrid.propose(0, seen, 8, None)
    assert got.tokens == alone.propose(seen, 8).tokens == seen[-997 : -997 + 8]
