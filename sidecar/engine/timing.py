"""Timing decodes at load, on a machine other processes may share: CostModel's calibration.

A curve measured while another process held the cores is steep and slow, and the planner would
price every draft out; these tell a busy machine apart before timing, order the sizes so a budget
cut short still leaves the curve's shape, fill the sizes not timed, and spot repetitions that
disagree.
"""

from __future__ import annotations

import os
import time

from sidecar.engine.llama import Context
from sidecar.engine.seqview import SeqView


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


CONTENDED = 1.5
"""One-token steps that differ by more than this factor say other processes hold the cores (on a
quiet machine five in a row agree within ~10%)."""


def prior_curve(n: int) -> float:
    """What verifying n rows costs in one-token steps before anything is measured: the CPU's shape
    (SmolLM2 on 2 cores: about 0.6 n + 0.4). Pessimistic on a GPU, where rounds correct it."""
    return 1.0 if n <= 1 else 0.6 * n + 0.4


PRIOR_CATCHUP = 0.3
"""A prefilled token's cost in one-token steps, before it is measured (SmolLM2 on 2 cores: ~0.25)."""

class Calibration:
    """CostModel's measurement at load: its verify curve (`calibrate`) and its draft's prices
    (`calibrate_draft`), timed on real decodes. The prices themselves, and how rounds correct
    them, are CostModel's (engine.cost)."""

    t_step: list[float]
    t_draft: float
    t_catchup: float
    t_switch: float
    provisional: bool
    calibration_seconds: float

    def set_provisional(self, provisional: bool) -> None:
        raise NotImplementedError

    def calibrate(self, ctx: Context | SeqView, reps: int = 3, budget: float | None = None) -> None:
        """Time decodes of 1..n rows on a scratch sequence, then give the cache back empty.

        Each size is timed `reps` times and the minimum kept. Sizes are taken widest-spread first
        (1, n, then halves), so a `budget` (seconds) that runs out mid-way still leaves the curve's
        shape: sizes not timed are interpolated from their neighbours. A curve with fewer than five
        sizes timed, or whose repetitions disagree, is `provisional`: the online estimates replace
        it quickly, and it is not worth keeping (runtime.llamacpp.curves does not cache it).

        A decode cannot be cut short, and on a machine whose cores other processes keep busy one
        batch can take seconds (llama.cpp's threads wait for each other at every op). So a few
        one-token steps come first: when they disagree, the machine is contended, and the curve
        is the prior shape (prior_curve) scaled to the fastest step, provisional, at once."""
        t_start = time.perf_counter()
        deadline = float("inf") if budget is None else t_start + budget
        n_rows = len(self.t_step) - 1
        probe, t1 = self._probe_steps(ctx, t_start, deadline, budget)
        base = len(ctx)
        if t1 is None:
            ctx.truncate(base)
            # Warm-up of the widest batch; far slower than the prior shape says is contention too.
            if self._time_decode(ctx, n_rows) > 3 * min(probe) * prior_curve(n_rows) + 0.05 and budget is not None:
                t1 = min(probe)
        if t1 is not None:
            self._prior(t1, n_rows)
            ctx.clear()
            self.calibration_seconds = time.perf_counter() - t_start
            return
        ctx.truncate(base)
        samples: dict[int, list[float]] = {n: [] for n in range(1, n_rows + 1)}
        samples[1] += probe
        # Two sizes at a time, widest-spread first, each `reps` times before the next two: a budget
        # that runs out leaves fewer sizes, each measured as well as the rest (the minimum of its
        # samples), and the sizes between are interpolated; one sample of every size would be
        # noise. The two alternate, so no decode follows one of its own shape (which a GPU replays
        # cheaper).
        order = spread(n_rows)
        for i in range(0, len(order), 2):
            if time.perf_counter() > deadline and i >= 2:
                break
            for rep in range(reps):
                if rep and i >= 2 and time.perf_counter() > deadline:
                    break
                for n in order[i : i + 2]:
                    if len(samples[n]) < reps:
                        ctx.truncate(base)
                        samples[n].append(self._time_decode(ctx, n))
        # Plain decoding is one-token steps in a row, which a GPU runs faster than a step right
        # after a batch (see t_switch): time both (once at least, whatever the budget).
        steady, switch = float("inf"), float("inf")
        for rep in range(reps):
            if rep and time.perf_counter() > deadline:
                break
            ctx.truncate(base)
            ctx.decode([0] * n_rows)
            after = [self._time_decode(ctx, 1) for _ in range(3)]
            run = [self._time_decode(ctx, 1) for _ in range(4)]
            steady = min(steady, *run)
            switch = min(switch, sum(after) - 3 * min(run))
        best = interpolated({n: min(v) for n, v in samples.items() if v}, n_rows)
        best[1] = min(best[1], steady)
        # Rebuilding a graph costs at least one step run without it; less is cache effects and
        # timing noise (a CPU measures 0.1-0.2 steps here, and has no graphs to rebuild).
        self.t_switch = switch if 0.5 * best[1] < switch < float("inf") else 0.0
        measured = sum(1 for v in samples.values() if v)
        disturbed = (steady == float("inf") or measured < min(n_rows, 5)
                     or noisy(samples) or any(best[n] < 0.9 * best[n - 1] for n in range(2, n_rows + 1)))
        # Verifying more rows never costs less; flatten noise that says otherwise.
        for n in range(2, n_rows + 1):
            best[n] = max(best[n], best[n - 1])
        self.t_step = [0.0, *best[1:]]
        ctx.clear()
        self.set_provisional(disturbed)
        self.calibration_seconds = time.perf_counter() - t_start

    def _prior(self, t1: float, n_rows: int) -> None:
        """The prior curve scaled to a one-token step of t1 seconds, provisional."""
        self.t_step = [0.0, *(t1 * prior_curve(n) for n in range(1, n_rows + 1))]
        self.t_switch = 0.0
        self.set_provisional(True)

    @classmethod
    def _probe_steps(cls, ctx: Context | SeqView, t_start: float, deadline: float,
                     budget: float | None) -> tuple[list[float], float | None]:
        """A warm-up, then up to five one-token steps from a cleared cache, in a quarter of the
        budget (one at least; see calibrate): the steps, and where a budget is set and the machine
        looks contended, the one-token time to scale a prior by (None: measure for real).

        Contended: the cores are taken before anything runs (then one lone step is all that is
        timed), or the steps disagree, or five do not fit in the quarter."""
        ctx.clear()
        if budget is not None and cores_taken(ctx.n_threads):
            return [], cls._lone_step(ctx)
        # The warm-up builds the one-token graph and the output buffer, and on a first load it
        # pages the weights in (SmolLM2 + 120 layers, 348 MiB: 0.56 s against a 40 ms step), so
        # it is neither timed nor charged to the steps' quarter of the budget.
        ctx.decode([0])
        base, start = len(ctx), time.perf_counter()
        steps: list[float] = []
        while len(steps) < 5 and (not steps or time.perf_counter() < start + 0.25 * (deadline - t_start)):
            ctx.truncate(base)
            steps.append(cls._time_decode(ctx, 1))
        if budget is not None and (len(steps) < 5 or max(steps) > CONTENDED * min(steps)):
            return steps, min(steps)
        ctx.truncate(base)
        return steps, None

    @classmethod
    def _lone_step(cls, ctx: Context | SeqView) -> float:
        """A one-token step on one thread, then the cache cleared: on a machine whose cores are
        all taken, where threads that wait for each other stall, the one scale worth having."""
        ctx.set_threads(1)
        try:
            return cls._time_decode(ctx, 1)
        finally:
            ctx.set_threads(0)
            ctx.clear()

    @staticmethod
    def _time_decode(ctx: Context | SeqView, n: int) -> float:
        t0 = time.perf_counter()
        ctx.decode([0] * n)
        return time.perf_counter() - t0

    def calibrate_draft(self, draft: Context | SeqView, reps: int = 3, budget: float | None = None) -> bool:
        """Time the draft's one-token step and its catch-up prefill (per token), fastest of `reps`
        (of as many as `budget` seconds allow, one at least). False: the machine was contended,
        and the times are a prior guess (provisional, not worth keeping)."""
        t_start = time.perf_counter()
        deadline = float("inf") if budget is None else t_start + budget
        step = prefill = float("inf")
        m = max(1, min(64, draft.n_ctx - 4))  # prefilled tokens, then four steps
        _, t1 = self._probe_steps(draft, t_start, deadline, budget)
        draft.clear()
        if t1 is not None:
            self.t_draft, self.t_catchup = t1, t1 * PRIOR_CATCHUP
            self.set_provisional(True)
            self.calibration_seconds += time.perf_counter() - t_start
            return False
        draft.prefill([0] * m)  # warm-up, and the graphs for both shapes
        draft.decode([0])
        for rep in range(reps):
            if rep and time.perf_counter() > deadline:
                break
            draft.clear()
            t0 = time.perf_counter()
            draft.prefill([0] * m)
            draft.synchronize()
            prefill = min(prefill, (time.perf_counter() - t0) / m)
            # A draft's steps come in a row, like plain decoding (see calibrate).
            step = min(step, *(self._time_decode(draft, 1) for _ in range(4)))
        draft.clear()
        self.t_draft, self.t_catchup = step, prefill
        self.calibration_seconds += time.perf_counter() - t_start
        return True
