"""The host's share of a step: what the step loop does that is not llama_decode, timed and priced.

A step is the device's work (llama_decode and waiting for its logits: device_seconds) and the
host's: the schedule pricing menus, the drafters proposing, verifying, emitting
text. On 2 CPU cores a SmolLM2 step costs ~15 ms and the host a few percent of it; on a GPU (or on
SmolLM2 cut to 2 layers, a step of ~2.7 ms) the host's part is as large as the device's, and a
draft whose rows cost the device little can cost the host more than the tokens it saves
(issue #54: the n-gram daemon at N = 8 ran at 0.28x its own plain daemon, every draft accepted).

`HostTime` keeps, per step loop:
- the two histograms /metrics exports (`sidecar_step_seconds`, `sidecar_step_host_seconds`) and
  the host's share of the recent steps' wall time (/api/ps, /sidecar/status);
- a price of the host's work, fitted by least squares over the recent steps against what each
  step held: a fixed part, each decoding sequence, each token emitted, each sequence that
  drafted and each drafted row (`HostPrice`). The schedule adds what a draft adds to the host
  to a step's seconds (engine.schedule), so a draft is taken only where the
  tokens it saves are worth the device's and the host's time together.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
_device = threading.local()  # per thread: seconds in llama_decode and waiting for its results


def device_seconds() -> float:
    """Seconds this thread has spent in llama_decode and waiting for what it computes (reading
    logits, synchronize), over every context it drove. The step loop's host time is its wall time
    less this: on a GPU llama_decode may return early and reading the logits waits, so both count
    as the device's."""
    return float(getattr(_device, "seconds", 0.0))


def on_device(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), its seconds booked as the device's (engine.llama wraps its decode calls in it)."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        _device.seconds = getattr(_device, "seconds", 0.0) + time.perf_counter() - t0

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)
"""Upper bounds of `sidecar_step_seconds`: a GPU step of a small model (~1 ms) to a CPU's long prefill."""
HOST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128)
"""Upper bounds of `sidecar_step_host_seconds`: the issue's goals are 0.25-1 ms a step."""

RECENT = 256
"""Steps the share and the fit look back over: a few seconds of decoding on a GPU, a few on a CPU."""
FIT_EVERY = 64  # steps between two fits (a fit of RECENT x 5 costs ~0.1 ms: ~2 us a step)
MIN_DRAFTING = 8  # steps with drafts a window needs before it prices drafts (else the price stays)
FADE = 0.98
"""Where the window holds too few drafting steps to fit, a fit brings the draft's price this much
toward 0: a price learnt during a burst of other work must not keep every draft out for good, and
with drafts back in, the next fit measures it again."""


@dataclass
class Histogram:
    """A Prometheus histogram kept by the step loop's thread and read at scrape time: per bucket
    counts (not cumulative; the last is +Inf), their sum. Reads from another thread may see one
    step half-booked, which a scrape tolerates."""

    bounds: tuple[float, ...]

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value, else +Inf
        self.total += value

    def cumulative(self) -> tuple[tuple[float, ...], tuple[int, ...], float]:
        """(bounds, cumulative counts with +Inf last, sum): what a HistogramMetricFamily takes."""
        counts, run, out = list(self.counts), 0, []
        for c in counts:
            run += c
            out.append(run)
        return self.bounds, tuple(out), self.total


@dataclass
class HostPrice:
    """Host seconds a step costs, as fitted: a fixed part, per decoding sequence, per token emitted,
    per sequence that drafts and per drafted row. Zero until fitted: speculation is judged on the
    device's price alone until the host's is known."""

    fixed: float = 0.0
    seq: float = 0.0
    token: float = 0.0
    drafting: float = 0.0
    row: float = 0.0


class HostTime:
    """Per step loop: the histograms, the recent share and the fitted host price (module docstring)."""

    def __init__(self) -> None:
        self.step = Histogram(STEP_BUCKETS)
        self.host = Histogram(HOST_BUCKETS)
        self.price = HostPrice()
        # The recent steps, a ring of (wall, host, features); the features are (1, sequences,
        # tokens, drafting, rows). The fit's sums over the ring (x x^T, x host) move with it.
        self._recent: list[tuple[float, float, tuple[float, ...]]] = []
        self._at = 0
        self._wall = self._host = 0.0
        self._xx = [[0.0] * FEATURES for _ in range(FEATURES)]
        self._xy = [0.0] * FEATURES
        self._drafting = 0  # steps with drafts in the ring
        self._since_fit = 0

    def observe(self, wall: float, host: float, seqs: int, tokens: int, drafting: int, rows: int) -> None:
        """A step that decoded: its wall seconds, the host's part of them, the sequences that decoded
        in it, the tokens they emitted, those that verified a draft and the drafted rows."""
        host = min(max(host, 0.0), wall)
        self.step.observe(wall)
        self.host.observe(host)
        x = (1.0, float(seqs), float(tokens), float(drafting), float(rows))
        recent = self._recent
        square = True
        if len(recent) < RECENT:
            recent.append((wall, host, x))
        else:
            old = recent[self._at]
            recent[self._at] = (wall, host, x)
            self._at = (self._at + 1) % RECENT
            # x x^T's sums are of whole numbers, so exact: where the step that leaves the ring held
            # what this one holds (a steady stretch), its products would come off and go on unchanged.
            square = old[2] != x
            self._book(old[0], old[1], old[2], -1.0, square)
        self._book(wall, host, x, 1.0, square)
        self._since_fit += 1
        if self._since_fit >= FIT_EVERY:
            self._since_fit = 0
            self._fit()

    def _book(self, wall: float, host: float, x: tuple[float, ...], sign: float, square: bool) -> None:
        """Add (sign 1) or take off (-1) a step's terms of the fit's sums; x x^T's only where `square`."""
        self._wall += sign * wall
        self._host += sign * host
        self._drafting += int(sign) if x[3] > 0 else 0
        xx, xy = self._xx, self._xy
        # Only the nonzero features: a zero term adds nothing (the sums never hold -0.0).
        for i, xi in enumerate(x):
            if xi:
                xy[i] += sign * xi * host
                if square:
                    row = xx[i]
                    for j, xj in enumerate(x):
                        if xj:
                            row[j] += sign * xi * xj

    @property
    def share(self) -> float:
        """The host's share of the recent steps' wall time (0 before any step)."""
        return self._host / self._wall if self._wall > 0 else 0.0

    def _fit(self) -> None:
        """Least squares of the recent steps' host seconds on what they held, by the normal
        equations over the ring's sums (five features: plain Python, no BLAS, whose threads would
        spin beside llama.cpp's on the cores it decodes on); coefficients held at 0 or above (a
        negative price would buy drafts for their own sake)."""
        enough = self._drafting >= MIN_DRAFTING
        keep = list(range(FEATURES if enough else 3))
        coef = [0.0] * FEATURES
        # Non-negative least squares the simple way: drop a feature whose coefficient comes out
        # negative and fit again (five features at most, so a few rounds at most).
        while keep:
            got = _solve([[self._xx[i][j] for j in keep] for i in keep], [self._xy[i] for i in keep])
            if all(g >= 0 for g in got):
                for i, g in zip(keep, got, strict=True):
                    coef[i] = g
                break
            keep = [i for i, g in zip(keep, got, strict=True) if g > 0]
        p = self.price
        p.fixed, p.seq, p.token = coef[0], coef[1], coef[2]
        if enough:
            p.drafting, p.row = coef[3], coef[4]
        else:
            p.drafting *= FADE
            p.row *= FADE


FEATURES = 5


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b for a small symmetric positive semi-definite a (normal equations), by
    Gaussian elimination with a ridge of 1e-9 of the diagonal: features that always move together
    (the fixed part and the sequences, at one N) share their price instead of failing the fit."""
    n = len(b)
    ridge = 1e-9 * max((a[i][i] for i in range(n)), default=0.0) + 1e-18
    m = [[*(a[i][j] + (ridge if i == j else 0.0) for j in range(n)), b[i]] for i in range(n)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[pivot] = m[pivot], m[c]
        if abs(m[c][c]) < 1e-30:
            continue
        for r in range(n):
            if r != c and m[r][c]:
                f = m[r][c] / m[c][c]
                m[r] = [v - f * w for v, w in zip(m[r], m[c], strict=True)]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-30 else 0.0 for i in range(n)]
