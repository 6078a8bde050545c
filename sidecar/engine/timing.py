"""Timing decodes on a machine other processes may share: the helpers CostModel.calibrate uses.

A curve measured while another process held the cores is steep and slow, and the planner would
price every draft out; these tell a busy machine apart before timing, order the sizes so a budget
cut short still leaves the curve's shape, fill the sizes not timed, and spot repetitions that
disagree.
"""

from __future__ import annotations

import os
import time


def cores_taken(n_threads: int, interval: float = 0.05) -> bool:
    """Whether other processes leave fewer than half of `n_threads` cores idle (Linux /proc/stat,
    sampled over `interval`; elsewhere False, and the one-token probes tell instead).

    Checked before any timing: with every core taken, llama.cpp's threads wait for each other at
    every op, and a single one-token decode stalls for seconds now and then (SmolLM2, 2 threads,
    four spinning processes on 2 cores: 0.04 to 3.7 s)."""

    def idle() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    try:
        idle0, total0 = idle()
        time.sleep(interval)
        idle1, total1 = idle()
    except (OSError, ValueError, IndexError):
        return False
    cores = os.cpu_count() or 1
    if total1 <= total0:
        return False
    return (idle1 - idle0) / (total1 - total0) * cores < 0.5 * min(n_threads, cores)


def spread(n: int) -> list[int]:
    """1..n, widest-spread first: 1, n, then the midpoints of the gaps left (1, 13, 7, 4, 10, ...)."""
    order, gaps = [1, n] if n > 1 else [1], [(1, n)]
    while gaps:
        lo, hi = gaps.pop(0)
        if hi - lo > 1:
            mid = (lo + hi) // 2
            order.append(mid)
            gaps += [(lo, mid), (mid, hi)]
    return order


def interpolated(known: dict[int, float], n: int) -> list[float]:
    """[inf, t(1) .. t(n)] with the sizes not in `known` drawn on the line between their neighbours."""
    xs = sorted(known)
    out = [float("inf")] * (n + 1)
    for i in range(1, n + 1):
        lo = max((x for x in xs if x <= i), default=xs[0])
        hi = min((x for x in xs if x >= i), default=xs[-1])
        out[i] = known[lo] if lo == hi else known[lo] + (known[hi] - known[lo]) * (i - lo) / (hi - lo)
    return out


def noisy(samples: dict[int, list[float]], spread: float = 1.3) -> bool:
    """Whether repetitions of one size disagree by more than `spread` (a machine busy meanwhile)."""
    return any(len(v) >= 2 and max(v) > spread * min(v) for v in samples.values())
