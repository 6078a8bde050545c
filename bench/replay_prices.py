"""How well the cost model priced the shared decodes that held a draft, replayed from step logs.

    .venv/bin/python bench/concurrency.py --n 8 --reps 3 --configs padded,padded+draft --steplog
    .venv/bin/python bench/replay_prices.py bench/out/concurrency_logs/<run>/steps [more dirs]

A shared decode is timed as one sum over its passes (engine.layout), so the engine learns the
factors of its price apart (CostModel.observe_shared): `shared` from decodes whose passes all
span several streams, `beside` (a draft's own pass) from those that also hold a pass of one
stream. Whether a draft pays turns on that price, so this replays every logged decode through
the engine's own CostModel, at the curve and depth the daemon had then (bench/steplog.py logs
them), and prints the error of each decode that held such a pass, priced before it is learnt
from: log(priced / decoded seconds), its median size and its mean (the bias).

Beside the engine's rule it replays one alternative, `beside` as a share of `shared` (a lone
pass priced at curve x shared x share, fading toward TARGET as `beside` fades toward 1): if the
machine's drift moved the lone pass with the shared ones, that rule would price drafted decodes
better. Steps with a prompt chunk are left out, as the engine learns nothing from them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sidecar.engine.adaptive import BESIDE_FADE, CostModel, _bounded
from sidecar.engine.layout import passes

TARGETS = (1.0, 0.75)


def _curve(rec: dict[str, Any]) -> list[float] | None:
    """The curve a `fac` line carries, if any (written only where it moved)."""
    fac = rec["fac"]
    if "curve" in rec or "curve" in fac:  # the first form of steplog.py wrote it in every `fac`
        return list(rec.get("curve") or fac["curve"])
    if "t1" in fac:  # an older log: one row and nine, linear between
        t1, t9 = fac["t1"], fac["t9"]
        return [0.0, *(t1 + (m - 1) * (t9 - t1) / 8.0 for m in range(1, 10))]
    return None


def replay(path: Path) -> list[tuple[float, ...]]:
    """The errors of each decode in one daemon's log that held a lone pass: the engine's, then the
    alternative's at each of TARGETS."""
    cost = CostModel(9)
    shares = list(TARGETS)
    out: list[tuple[float, ...]] = []
    for line in path.open():
        rec = json.loads(line)
        if "fac" in rec:
            cost.t_step = _curve(rec) or cost.t_step
            cost.depth = rec["fac"].get("depth") or 0.0
            continue
        made, rows = rec.get("made"), rec.get("w")
        if not made or not rows or cost.t_step[1] <= 0 or any(m[0] == 0 for m in made.values()):
            continue
        rows = [tuple(r) for r in rows]
        cells = max(c - n for c, (_, n) in zip(rec["cells"], rows, strict=True))  # before the rows
        layout = passes(rows)
        spanning = sum(cost._at(m, cells) for m, streams in layout if streams > 1)
        alone = sum(cost._at(m, cells) for m, streams in layout if streams == 1)
        seconds = rec["d"]
        if alone > 0 and spanning > 0:
            engine = spanning * cost.shared + alone * cost.beside  # as CostModel prices a shared decode
            out.append((math.log(engine / seconds),
                        *(math.log((spanning + alone * share) * cost.shared / seconds) for share in shares)))
            seen = _bounded((seconds - spanning * cost.shared) / (alone * cost.shared))
            shares = [share + cost._smooth * (seen - share) for share in shares]
        elif alone <= 0 < spanning:
            shares = [share + BESIDE_FADE * (target - share) for share, target in zip(shares, TARGETS, strict=True)]
        cost.observe_shared(rows, seconds, cells)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="folders searched for steps.*.jsonl (and fair.*.jsonl)")
    args = ap.parse_args()
    logs = sorted({p for d in args.dirs for pat in ("steps.*.jsonl", "fair.*.jsonl") for p in d.rglob(pat)})
    print(f"{len(logs)} daemon logs")
    errs = [e for p in logs for e in replay(p)]
    if not errs:
        print("no decode held a draft's own pass")
        return
    names = ["engine (`beside` on the curve, fading to 1)",
             *(f"`beside` as a share of `shared`, fading to {t}" for t in TARGETS)]  # fmt: skip
    print("| rule | decodes | median abs error | mean error (bias) |\n|---|---|---|---|")
    for i, name in enumerate(names):
        es = [e[i] for e in errs]
        print(f"| {name} | {len(es)} | {statistics.median(abs(e) for e in es):.3f} | {statistics.mean(es):+.3f} |")


if __name__ == "__main__":
    main()
