"""Token bytes to streamed text: never a broken character, never part of a stop string.

A token's piece may end in the middle of a multi-byte UTF-8 character, so bytes go through an
incremental decoder. Text that could still grow into a stop string is held back until it either
completes the stop (generation ends, the stop is not emitted) or stops matching (it is released).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

from sidecar.holdback import partial_suffix


class TextStream:
    def __init__(self, stops: list[str] | None = None) -> None:
        self.stops = [s for s in (stops or []) if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self._stopped = False

    def feed(self, piece: bytes) -> tuple[str, bool]:
        """Add a token's bytes; returns (text safe to emit now, whether a stop string was hit)."""
        text = self._held + self._decoder.decode(piece)
        if not self.stops:
            self._held = ""
            return text, False
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self._stopped = True
            return text[:cut], True
        hold = partial_suffix(text, self.stops)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """At the end of generation: whatever was held back (and any dangling bytes) is real output."""
        if self._stopped:  # bytes after a stop string are not output, not even as U+FFFD
            return ""
        rest = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return rest


class Trigger:
    """Watches the output's text for a string: where a deferred grammar starts (`</think>`).

    It sees every emitted token's text, held-back stop prefixes included, so when a grammar starts
    depends on the tokens alone. `copy` gives an independent watcher to walk along a draft."""

    def __init__(self, needle: str) -> None:
        self.needle = needle
        self.fired = not needle
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._tail = ""  # the end of the text so far that could be the start of the needle

    def feed(self, piece: bytes) -> bool:
        """Add a token's bytes; whether the needle has appeared (by this token or earlier)."""
        if self.fired:
            return True
        text = self._tail + self._decoder.decode(piece)
        if self.needle in text:
            self.fired = True
            self._tail = ""
        else:
            self._tail = text[-(len(self.needle) - 1) :] if len(self.needle) > 1 else ""
        return self.fired

    def copy(self) -> Trigger:
        twin = Trigger(self.needle)
        twin.fired = self.fired
        twin._decoder.setstate(self._decoder.getstate())
        twin._tail = self._tail
        return twin


def renderer(piece: Callable[[int], bytes], special: Callable[[int], bytes],
             preserve: frozenset[int]) -> Callable[[int], bytes]:
    """A token's output bytes: its special rendering for the `preserve` ids, its plain piece otherwise."""
    if not preserve:
        return piece
    return lambda tok: special(tok) if tok in preserve else piece(tok)
