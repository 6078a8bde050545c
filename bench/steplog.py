"""Run `sidecar serve` with every shared step logged, for reading offline (bench/replay_prices.py).

    .venv/bin/python bench/steplog.py DIR serve --config pairs.yaml ...   (what `concurrency.py
    --steplog DIR` starts each daemon with)

Wraps the step loop before serving. Each step that decoded several streams' rows becomes a JSON
line in DIR/steps.<pid>.jsonl: `t` (time), `s` (the whole step's seconds: `s - d` is the step
loop's own Python, the planner's pricing and the check included), `d` (the decode's seconds), `w`
(stream, rows) as decoded, `cells` (each stream's cells after it), `bid` (each stream's bid once the check ran:
tokens, extra seconds), `held` (drafts the check took back) and `made` (each stream's tokens,
extra, plain step, row, as booked). A line with `fac` marks a change of the cost model's factors
(`shared`, `beside`, `depth`) after a step, with `curve` (t_step) where that moved too. It costs a
few perf_counter calls and a JSON line or two a step; the daemon is otherwise the one under test.
Streams' accounts and prices are the engine's own (engine.fair, engine.adaptive), so a revision
that renames them logs less, not wrongly.

    .venv/bin/python bench/steplog.py --summary DIR...   (e.g. bench/out/concurrency_logs/<run>/steps)

prints, per daemon log and number of streams, the median time a shared step spends outside
`llama_decode` (`s - d`), in ms and as a share of the step, for steps of plain rows and steps that
verified a draft (a step that carried a prompt's chunk is left out). The machine's drift and a
process's own pace move that share far less than the times themselves; still, two daemons resolve
only large differences in it (bench/step_python.py compares revisions on identical work).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def install(out: Path) -> None:
    """Wrap the step loop's decode, check and booking so every shared step is written to `out`."""
    from sidecar.engine import llama, step

    f = (out / f"steps.{os.getpid()}.jsonl").open("w", buffering=1)
    cur: dict[str, Any] = {}
    curve: list[float] = []  # the cost model's curve as last written
    decode_many, withdrawals, settle, run_step = (llama.Context.decode_many, step.withdrawals, step.settle,
                                                  step.StepLoop.step)  # fmt: skip

    def logged_decode(self: Any, parts: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return decode_many(self, parts, *a, **k)
        finally:
            cur.update(d=round(time.perf_counter() - t, 4), w=[(s, len(tk)) for s, tk, _ in parts],
                       cells=[len(self.held(s)) for s, _, _ in parts])  # fmt: skip

    def logged_withdrawals(bids: Any, accounts: Any, slack: float) -> Any:
        held, out_bids = withdrawals(bids, accounts, slack)
        cur.update(bid={s: (round(b.tokens, 2), round(b.extra, 4)) for s, b in bids.items()}, held=held)
        return held, out_bids

    def logged_settle(made: Any, accounts: Any) -> None:
        settle(made, accounts)
        cur["line"] = {"t": round(time.time(), 3), "d": cur.get("d"), "w": cur.get("w"), "cells": cur.get("cells"),
                       "bid": cur.get("bid"), "held": cur.get("held"),
                       "made": {s: (b.tokens, round(b.extra, 4), round(b.tau, 4), round(b.row, 4))
                                for s, b in made.items()}}  # fmt: skip

    def logged_step(self: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        got = run_step(self, *a, **k)
        if (line := cur.pop("line", None)) is not None:  # a shared step: written once its whole time is known
            f.write(json.dumps({**line, "s": round(time.perf_counter() - t, 5)}) + "\n")
        last = cur.get("fac")
        cur.clear()
        cur["fac"] = last
        if self.running:
            c = next(iter(self.running.values())).cost
            fac = {"shared": round(c.shared, 3), "beside": round(c.beside, 3), "depth": round(c.depth, 3)}
            if fac != cur.get("fac") or c.t_step != curve:
                line = {"t": round(time.time(), 3), "fac": fac, "n": len(self.running)}
                if c.t_step != curve:  # the curve (a long list) only where it moved
                    curve[:] = c.t_step
                    line["curve"] = [round(x, 5) for x in curve]
                f.write(json.dumps(line) + "\n")
                cur["fac"] = fac
        return got

    llama.Context.decode_many = logged_decode  # type: ignore[method-assign]
    step.withdrawals = logged_withdrawals  # type: ignore[assignment]
    step.settle = logged_settle  # type: ignore[assignment]
    step.StepLoop.step = logged_step  # type: ignore[method-assign]


def summary(dirs: list[Path]) -> None:
    """Median seconds outside the decode per shared step, by streams and kind (module docstring)."""
    import statistics

    for path in sorted(p for d in dirs for p in d.rglob("steps.*.jsonl")):
        kinds: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for raw in path.open():
            line = json.loads(raw)
            if "s" not in line or not line.get("w") or line.get("d") is None:
                continue
            rows = dict(line["w"])  # stream -> rows
            bids = {int(s): b for s, b in (line.get("bid") or {}).items()}
            wide = [s for s, n in rows.items() if n > 1]
            if len(rows) < 2 or any(bids.get(s, (0, 0.0))[1] <= 0 for s in wide):
                continue  # a lone step, or a prompt's chunk rode along (it bids no draft: engine.step._fair)
            kind = "drafted" if wide else "plain"
            kinds.setdefault((len(rows), kind), []).append((line["s"] - line["d"], line["s"]))
        print(path.relative_to(path.parents[1]))
        for (n, kind), got in sorted(kinds.items()):
            outside = statistics.median(o for o, _ in got)
            share = statistics.median(o / s for o, s in got if s > 0)
            print(f"  {n} streams, {kind:7s}: {len(got):4d} steps, outside the decode {1e3 * outside:6.2f} ms "
                  f"({100 * share:.1f}% of the step)")


if __name__ == "__main__":
    if sys.argv[1] == "--summary":
        summary([Path(a) for a in sys.argv[2:]])
        sys.exit(0)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    install(out)
    from sidecar.cli import main

    sys.exit(main(sys.argv[2:]))
