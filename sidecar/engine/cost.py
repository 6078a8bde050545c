"""What a step costs: one linear model of the device's seconds, fitted to the decodes themselves.

A step's price is a function of its layout. Its features (`Layout.features`):
- `passes`: the passes llama.cpp's split makes of it (engine.layout): each has a fixed cost (the
  weights are read once a pass; on a GPU, a kernel launch and a graph);
- `rows`: rows whose logits are computed (the output head runs on each: 49k columns on SmolLM2,
  262k on Gemma-3);
- `prefill`: prompt rows, which compute no logits;
- `attention`: rows times the KV blocks the deepest stream's pass attends over (llama.cpp sizes a
  pass by its deepest stream, padded to KV_BLOCK: `llama_kv_cache::get_n_kv`);
- `changed`: 1 when the layout differs from the last decode's (a GPU rebuilds or cannot replay its
  CUDA graph; a CPU has none, and the fit finds ~0 there).

The weights start from the load-time calibration (engine.timing: the one-stream verify curve
t_step(n) gives a line of fixed + per-row cost, t_switch the graph's price) and are refitted by
least squares over the RECENT decodes, pulled towards that start, at the scale the decodes show,
where they do not tell features apart (a ridge: a plain decoding stretch says nothing about wide
rows, so their share of a step stays what the calibration said). A draft model's steps are a
second fit of the same kind: a fixed cost per draft step, a cost per row it carries (sequences
drafting together share its passes) and per token its catch-up prefills.

This one model replaces what used to be separate learnt factors and their repairs: the curve's
moving averages per size, the shared-stream and beside-others factors, the fade that unstuck one
of them, the depth slope, the chunk price, the anchoring to the load's prices. The host's own
seconds are fitted beside it (engine.hosttime); the schedule (engine.schedule) prices a step as
device plus host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sidecar.engine.timing import Calibration

KV_BLOCK = 256
"""llama.cpp sizes the cache a pass attends over by its deepest stream's cells, padded to this."""

RECENT = 256  # decodes a fit looks back over: a few seconds of decoding on a GPU
FIT_EVERY = 8  # observations between two solves (a 5x5 solve is ~15 us)
RIDGE = 1e-5  # how strongly a feature the recent decodes barely vary is held at its start

DEVICE = ("passes", "rows", "prefill", "attention", "changed")
DRAFT = ("steps", "rows", "catchup")


def blocks(cells: int) -> int:
    """The KV_BLOCKs a pass over `cells` attends over (one at least)."""
    return -(-max(cells, 1) // KV_BLOCK)


class Fit:
    """y ~ w . x by least squares over a ring of recent (x, y), held towards a starting `prior`
    (ridge), with non-negative weights (a cost never pays back)."""

    def __init__(self, names: Sequence[str], prior: Sequence[float]) -> None:
        self.names = tuple(names)
        self.prior = np.asarray(prior, dtype=float)
        self.w = self.prior.copy()
        n = len(self.names)
        self._x = np.zeros((RECENT, n))
        self._y = np.zeros(RECENT)
        self._count = 0  # observations ever made (the ring holds the last RECENT)

    def reset(self, prior: Sequence[float]) -> None:
        """Start again from `prior` (a new calibration), forgetting what was observed."""
        self.__init__(self.names, prior)  # type: ignore[misc]

    def price(self, x: Sequence[float]) -> float:
        return float(np.dot(self.w, x))

    def observe(self, x: Sequence[float], y: float) -> None:
        if not np.isfinite(y) or y <= 0:
            return
        i = self._count % RECENT
        self._x[i], self._y[i] = x, y
        self._count += 1
        if self._count % FIT_EVERY == 0 or self._count <= FIT_EVERY:
            self._solve()

    def _solve(self) -> None:
        m = min(self._count, RECENT)
        # Relative errors: each decode weighs by its own price, so a prompt chunk's seconds (and
        # their noise, 100 decodes' worth) do not outweigh the decodes the schedule prices.
        x, y = self._x[:m] / self._y[:m, None], np.ones(m)
        a = x.T @ x
        # Ridge towards the prior's shape at the scale the decodes show: the least-squares factor
        # between the prior's prices and the observed ones. Features the data cannot tell apart
        # (a plain stretch moves passes, rows and depth together) then keep the calibration's
        # split of a step that runs faster or slower than it did; a ridge towards the prior itself
        # took the whole difference off each alike and priced a row at ~0 after a fast stretch.
        # The ridge is scaled to each feature's own size in the data (so it binds only where the
        # data hardly moves that feature), plus a floor that keeps an unseen feature at its start.
        # Where the fit would make a weight negative, that weight is held at 0.
        seeded = x @ self.prior
        scale = float(seeded @ y / (seeded @ seeded)) if seeded.any() else 1.0
        ridge = RIDGE * np.diag(a) + 1e-12
        b = x.T @ y + ridge * self.prior * scale
        a = a + np.diag(ridge)
        free = np.ones(len(self.names), dtype=bool)
        w = np.zeros(len(self.names))
        for _ in range(len(self.names)):
            sub = np.linalg.solve(a[np.ix_(free, free)], b[free])
            w[:] = 0.0
            w[free] = sub
            if (sub >= 0).all():
                break
            free[np.flatnonzero(free)[sub < 0]] = False
        self.w = np.maximum(w, 0.0)

    def beliefs(self) -> dict[str, float]:
        """The weights, by feature name (what /sidecar/status shows)."""
        return {name: round(float(v), 7) for name, v in zip(self.names, self.w, strict=True)}


@dataclass(frozen=True)
class Layout:
    """A decode as the cost model sees it: the passes of its split, its logit and prompt rows,
    and the KV blocks its deepest stream attends over."""

    passes: int
    rows: int
    prefill: int = 0
    cells: int = 0
    changed: bool = False

    def features(self) -> tuple[float, ...]:
        return (float(self.passes), float(self.rows), float(self.prefill),
                float((self.rows + self.prefill) * blocks(self.cells)), float(self.changed))


class CostModel(Calibration):
    """The device's price of a target step and of a draft model's steps, shared by a pair's
    requests: seeded by the calibration, refitted by every decode (module docstring)."""

    def __init__(self, n_rows: int) -> None:
        self.t_step = [0.0] * (n_rows + 1)  # the calibration's verify curve: index = rows
        self.t_draft = 0.0  # ... a lone draft step
        self.t_catchup = 0.0  # ... a token a draft model prefills to catch up
        self.t_switch = 0.0  # ... what a batch costs the one-row steps after it (a GPU's graph)
        self.set_provisional(False)
        self.calibration_seconds = 0.0
        self.device = Fit(DEVICE, [0.0] * len(DEVICE))
        self.draft = Fit(DRAFT, [0.0] * len(DRAFT))
        self.fixed = False  # True: the prices stay as seeded (tests and benches that assert decisions)
        self.seeded = False  # whether the fits start from the calibration yet (`seed`)

    def set_provisional(self, provisional: bool) -> None:
        self.provisional = provisional

    def seed(self) -> None:
        """Start both fits from the calibration's prices: the verify curve's line through its
        one-row step (a pass's fixed cost and a row's), a prompt row at a logit row's price, no
        depth cost until one is seen, the graph's price from t_switch; a lone draft step half
        fixed, half its row."""
        t = self.t_step
        if len(t) > 2 and t[1] > 0:  # the line through the one-row step (plain decoding's price, exact)
            n, rise = np.arange(1, len(t) - 1), np.asarray(t[2:]) - t[1]
            slope = max(float(n @ rise / (n @ n)), 0.0)
            fixed = max(t[1] - slope, 0.0)
        else:
            slope, fixed = (t[1] if len(t) > 1 else 0.0), 0.0
        self.device.reset([fixed, slope, slope, 0.0, self.t_switch])
        self.draft.reset([0.5 * self.t_draft, 0.5 * self.t_draft, self.t_catchup])
        self.seeded = True

    @property
    def ready(self) -> bool:
        """Whether anything is priced yet (a plain decoder without a calibration is not)."""
        w = self.device.w
        return bool(w[0] or w[1])  # not w[:2].any(): a slice and a reduction cost ~5 us a step

    def step(self, layout: Layout) -> float:
        """The device's seconds for a decode of this layout."""
        return self.device.price(layout.features())

    def observe_step(self, layout: Layout, seconds: float) -> None:
        if not self.fixed:
            self.device.observe(layout.features(), seconds)

    def draft_seconds(self, steps: int, rows: int, catchup: int = 0) -> float:
        """A draft model's seconds for `steps` draft steps carrying `rows` rows in all, after
        prefilling `catchup` tokens it missed."""
        return self.draft.price((steps, rows, catchup))

    def observe_draft(self, steps: int, rows: int, catchup: int, seconds: float) -> None:
        if not self.fixed and steps > 0:
            self.draft.observe((steps, rows, catchup), seconds)

    def beliefs(self) -> dict[str, object]:
        """What the model believes, for /sidecar/status: each fit's weights in seconds."""
        return {"device": self.device.beliefs(), "draft": self.draft.beliefs(),
                "provisional": self.provisional}

    def verify_curve(self) -> list[float]:
        """t_step(n) / t_step(1) for n = 1.., the calibration's relative cost of verifying n rows."""
        one = self.t_step[1] or 1.0
        return [t / one for t in self.t_step[1:]]
