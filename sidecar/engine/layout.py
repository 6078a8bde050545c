"""How llama.cpp decodes a batch of several sequences' rows: the passes it splits it into.

Each sequence has a KV stream of its own (engine.llama.Context), so a batch over several
sequences is not one pass: llama.cpp splits it (llama_batch_allocr::split_equal, sequential),
and what a step costs depends on that split (engine.adaptive prices it, engine.step pads rows
to make runs of one width where that is cheaper).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

# split passes, padded passes, several sequences' rows, the widest pass of either
Layout = tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...], bool, int]


def several(rows: Sequence[tuple[int, int]]) -> bool:
    """Whether the rows hold more than one sequence's."""
    return sum(1 for _, n in rows if n > 0) > 1


def passes(rows: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The passes llama.cpp decodes a batch of several sequences' rows in, `rows` as (sequence id,
    rows), each as (rows, KV streams it spans). Each sequence has a KV stream of its own
    (engine.llama.Context), and llama.cpp splits such a batch (llama_batch_allocr::split_equal,
    sequential): a pass takes a run of consecutive sequence ids from the lowest one left and the
    same number of rows from each (the fewest any of them has left). So four plain rows on
    sequences 0-3 are one pass of 4, rows 9 and 1 are a pass of 2 and one of 8, and sequences 0
    and 2 are two passes of 1."""
    left = {s: n for s, n in rows if n > 0}
    out: list[tuple[int, int]] = []
    while left:
        ids = sorted(left)
        run = [ids[0]]
        for s in ids[1:]:
            if s != run[-1] + 1:
                break
            run.append(s)
        m = min(left[s] for s in run)
        out.append((m * len(run), len(run)))
        for s in run:
            left[s] -= m
            if not left[s]:
                del left[s]
    return out


def padded_passes(rows: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The passes once every run of consecutive ids is padded to its widest member (engine.step,
    pad_widths): one pass per run, as (rows, KV streams it spans)."""
    return [(max(n for _, n in run) * len(run), len(run)) for run in runs(rows)]


def runs(rows: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """(sequence id, rows) grouped into runs of consecutive ids, in id order."""
    out: list[list[tuple[int, int]]] = []
    for s, n in sorted(r for r in rows if r[1] > 0):
        if out and s == out[-1][-1][0] + 1:
            out[-1].append((s, n))
        else:
            out.append([(s, n)])
    return out


def shapes(rows: Sequence[tuple[int, int]]) -> Layout:
    """A decode's passes both ways, split (`passes`) and padded (`padded_passes`), whether it holds
    several sequences' rows, and its widest pass: what CostModel.batch prices. Remembered by the
    rows: a planner prices a dozen candidate drafts for every sequence of every step, the same few
    shapes over and over (n-gram at N = 4 on SmolLM2: 51 layouts a step; remembering them took the
    step loop's time outside llama_decode from 1.18 to 1.0 ms a step, against 0.46 ms for plain
    steps)."""
    return _shapes(tuple(sorted(rows)))


@lru_cache(maxsize=4096)
def _shapes(rows: tuple[tuple[int, int], ...]) -> Layout:
    split, padded = tuple(passes(rows)), tuple(padded_passes(rows))
    return split, padded, several(rows), max((m for m, _ in split + padded), default=0)
