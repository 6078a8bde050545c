"""How llama.cpp decodes a batch of several sequences' rows: the passes it splits it into.

Each sequence has a KV stream of its own (engine.llama.Context), so a batch over several
sequences is not one pass: llama.cpp splits it (llama_batch_allocr::split_equal, sequential),
and what a step costs depends on that split (engine.cost prices it, engine.step pads rows
to make runs of one width where that is cheaper).
"""

from __future__ import annotations

from collections.abc import Sequence


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
    # Index arithmetic and map rather than a list built per run and a generator: the step loop
    # prices every decode's layout, right after llama_decode where each of those costs microseconds.
    while left:
        ids = sorted(left)
        width = 1
        while width < len(ids) and ids[width] == ids[0] + width:
            width += 1
        run = ids[:width]
        m = min(map(left.__getitem__, run))
        out.append((m * width, width))
        for s in run:
            left[s] -= m
            if not left[s]:
                del left[s]
    return out


def runs(rows: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """(sequence id, rows) grouped into runs of consecutive ids, in id order."""
    out: list[list[tuple[int, int]]] = []
    for s, n in sorted(r for r in rows if r[1] > 0):
        if out and s == out[-1][-1][0] + 1:
            out[-1].append((s, n))
        else:
            out.append([(s, n)])
    return out
