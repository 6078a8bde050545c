"""TextStream: token bytes become streamed text that never shows a broken character or a stop string."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sidecar.engine.text import TextStream

pytestmark = pytest.mark.pure


def stream(pieces: Iterable[bytes], stops: list[str] | None = None) -> tuple[list[str], bool]:
    """Feed pieces until a stop hits; returns every emitted chunk (flush included) and whether it hit."""
    ts = TextStream(stops)
    out: list[str] = []
    for piece in pieces:
        text, hit = ts.feed(piece)
        out.append(text)
        if hit:
            return out, True
    out.append(ts.flush())
    return out, False


def bytewise(text: str) -> list[bytes]:
    data = text.encode("utf-8")
    return [data[i : i + 1] for i in range(len(data))]


def test_multibyte_characters_fed_byte_by_byte_are_never_broken() -> None:
    text = "héllo ✓ 日本 🎉!"
    chunks, hit = stream(bytewise(text))
    assert not hit
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    for c in chunks:  # every chunk is whole characters: it round-trips through UTF-8 on its own
        assert c.encode("utf-8").decode("utf-8") == c
    assert chunks.count("") >= len(text.encode()) - len(text)  # continuation bytes emit nothing


def test_pieces_are_passed_through_without_stops() -> None:
    ts = TextStream()
    assert ts.feed(b"Hello") == ("Hello", False)
    assert ts.feed(b", world") == (", world", False)
    assert ts.flush() == ""


def test_empty_stop_strings_are_ignored() -> None:
    ts = TextStream(["", ""])
    assert ts.stops == []
    assert ts.feed(b"abc") == ("abc", False)


def test_stop_inside_a_piece_cuts_before_it() -> None:
    ts = TextStream(["</s>"])
    assert ts.feed(b"answer</s>trailing") == ("answer", True)


def test_stop_spanning_pieces_is_never_emitted_even_partially() -> None:
    ts = TextStream(["<|end|>"])
    assert ts.feed(b"Done<|") == ("Done", False)
    assert ts.feed(b"en") == ("", False)
    assert ts.feed(b"d|>more") == ("", True)


def test_stop_made_of_multibyte_characters_split_inside_a_character() -> None:
    chunks, hit = stream(bytewise("ok 終了 never"), stops=["終了"])
    assert hit
    assert "".join(chunks) == "ok "


def test_text_that_diverges_from_a_stop_prefix_is_released() -> None:
    ts = TextStream(["STOP"])
    assert ts.feed(b"ab ST") == ("ab ", False)
    assert ts.feed(b"O") == ("", False)
    assert ts.feed(b"P!") == ("", True)
    ts = TextStream(["STOP"])
    assert ts.feed(b"ab ST") == ("ab ", False)
    assert ts.feed(b"OCK") == ("STOCK", False)


def test_diverging_text_that_starts_a_new_stop_prefix_keeps_that_part_held() -> None:
    """"aab" with stop "abc": the first "a" is released, "ab" is still held."""
    ts = TextStream(["abc"])
    assert ts.feed(b"a") == ("", False)
    assert ts.feed(b"a") == ("a", False)
    assert ts.feed(b"b") == ("", False)
    assert ts.feed(b"c") == ("", True)


def test_flush_returns_held_text() -> None:
    ts = TextStream(["\n\nUser:"])
    assert ts.feed(b"bye\n\nUs") == ("bye", False)
    assert ts.flush() == "\n\nUs"
    assert ts.flush() == ""


def test_flush_releases_dangling_bytes_as_a_replacement_character() -> None:
    ts = TextStream()
    assert ts.feed("é".encode()[:1]) == ("", False)
    assert ts.flush() == "\ufffd"


def test_flush_after_a_stop_emits_nothing() -> None:
    """The decoder calls flush() after every generation, stops included (engine/decoder.py). What
    followed the stop is dropped, including an incomplete UTF-8 sequence at the end of the piece
    that hit it: byte-level BPE tokens such as b" \\xe6" carry a character's first byte."""
    ts = TextStream(["</s>"])
    assert ts.feed(b"ok</s>\xe6") == ("ok", True)
    assert ts.flush() == ""


def test_multiple_stops_the_earliest_wins() -> None:
    ts = TextStream(["END", "\n"])
    assert ts.feed(b"one\ntwo END") == ("one", True)
    ts = TextStream(["END", "\n"])
    assert ts.feed(b"one END\n") == ("one ", True)


def test_multiple_stops_hold_the_longest_possible_prefix() -> None:
    """"<" could start "<stop>" and "x<" could start "x<y": the longest partial match is held."""
    ts = TextStream(["<stop>", "x<y"])
    assert ts.feed(b"ax<") == ("a", False)
    assert ts.feed(b"st") == ("x", False)
    assert ts.feed(b"op>") == ("", True)


# -- property ---------------------------------------------------------------------------------------

ALPHABET = "ab<>é✓\n"


def _no_stop_inside_another(stops: list[str]) -> bool:
    """A stop strictly inside another (not as prefix or suffix) completes first in a stream but starts
    later in the whole text, so "the first occurrence" would depend on how the text is split."""
    for s in stops:
        for t in stops:
            if s != t and len(s) < len(t):
                for i in range(1, len(t) - len(s)):
                    if t[i : i + len(s)] == s:
                        return False
    return True


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 200), max_size=20),
)
def test_emitted_text_is_the_text_up_to_the_first_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    """For any text split anywhere (even inside characters), what is emitted is exactly the text up
    to the first stop occurrence, and nothing past it; without a stop, all of it after flush."""
    assume(_no_stop_inside_another(stops))
    data = text.encode("utf-8")
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    pieces = [data[a:b] for a, b in itertools.pairwise(points)]
    chunks, hit = stream(pieces, stops)
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    assert hit == bool(found)
    assert "".join(chunks) == (text[: min(found)] if found else text)
    assert "\ufffd" not in "".join(chunks)
