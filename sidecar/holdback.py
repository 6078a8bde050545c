"""How much of a streamed text to hold back: the part that may still grow into a string to catch.

Both the engine's output stream (a stop string must never be shown) and a template's tool-call
parser (a tag must not leak into the content) stream text this way, so it sits below both layers.
"""

from __future__ import annotations

from collections.abc import Iterable


def partial_suffix(text: str, needles: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `needles`.

    That much of a stream must be held back: the next piece may complete a stop string (or a
    tag), and then it must not have been shown."""
    best = 0
    for s in needles:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
