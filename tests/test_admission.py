"""The order waiting requests take a free slot in (runtime.admission): interactive first, FIFO
within each class, a bounded number of passes, and barriers that nothing passes."""

from __future__ import annotations

import pytest

from sidecar.runtime.admission import PASSES, AdmissionQueue

pytestmark = pytest.mark.pure


def drain(q: AdmissionQueue[str]) -> list[str]:
    out = []
    while len(q):
        out.append(q.pop())
    return out


def queue(*entries: str) -> AdmissionQueue[str]:
    """Entries by name: "s..." streamed (interactive), "b..." not, "call..." a barrier."""
    q: AdmissionQueue[str] = AdmissionQueue()
    for e in entries:
        q.append(e, None if e.startswith("call") else e.startswith("s"))
    return q


def test_empty() -> None:
    q: AdmissionQueue[str] = AdmissionQueue()
    assert q.peek() is None and len(q) == 0


def test_interactive_goes_first_fifo_within_each_class() -> None:
    # Open WebUI's shape: each user's title request arrives just before the user's chat.
    assert drain(queue("b1", "s1", "b2", "s2", "b3", "s3")) == ["s1", "s2", "s3", "b1", "b2", "b3"]


def test_peek_is_what_pop_takes() -> None:
    q = queue("b1", "s1", "b2")
    while len(q):
        head = q.peek()
        assert q.pop() == head


def test_a_non_interactive_request_is_passed_at_most_passes_times() -> None:
    assert PASSES == 4
    streams = [f"s{i}" for i in range(10)]
    order = drain(queue("b1", *streams))
    assert order.index("b1") == PASSES
    assert order == [*streams[:PASSES], "b1", *streams[PASSES:]]


def test_passes_are_counted_over_time() -> None:
    """Interactive requests that come while a non-interactive one waits count too: after four it goes."""
    q = queue("b1", "b2")
    taken = []
    for i in range(6):
        q.append(f"s{i}", True)
        taken.append(q.pop())
    # Both were passed by s0..s3: both go before the interactive requests that came after.
    assert taken == ["s0", "s1", "s2", "s3", "b1", "b2"]
    assert drain(q) == ["s4", "s5"]


def test_nothing_moves_ahead_of_a_barrier() -> None:
    assert drain(queue("b1", "call", "s1")) == ["b1", "call", "s1"]
    assert drain(queue("b1", "s1", "call", "s2", "b2")) == ["s1", "b1", "call", "s2", "b2"]


def test_a_barrier_at_the_head_goes_first() -> None:
    assert drain(queue("call", "b1", "s1")) == ["call", "s1", "b1"]


def test_only_non_interactive_or_only_interactive_is_fifo() -> None:
    assert drain(queue("b1", "b2", "b3")) == ["b1", "b2", "b3"]
    assert drain(queue("s1", "s2", "s3")) == ["s1", "s2", "s3"]
