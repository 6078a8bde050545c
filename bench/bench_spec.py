"""Speculative vs target-only decoding, side by side, through the daemon's own runtime.

For each pair, every prompt runs target-only (`draft_num_predict: 0`) and speculative, alternating,
on the same loaded model; the table gives tokens/s of each, their ratio, the acceptance rate
(accepted / drafted), the mean accepted length (1 + accepted / rounds), whether the greedy outputs
were identical, and any fallback. It also prints the measured verify-cost curve of each target and,
for model drafts, the speed-up bound that curve, the draft's cost and its agreement allow:

    bound = max(1, max_k E(a, k) / ((k + a^k) * c + v(k + 1)))   E(a, k) = (1 - a^(k+1)) / (1 - a)

with a = the draft's greedy agreement with the target (teacher-forced over the target's output),
c = draft step / target step, v(n) = verify n rows / target step. A round of k drafts takes k draft
steps, plus one when all k are accepted (probability a^k): the draft never decoded its own last
guess, and must before it can draft on. For the n-gram drafter the bound
is exact for the recorded output: the best any choice of draft lengths could do (ngram_bound), at
the pair's n_max and for drafts of up to 32 tokens.

    .venv/bin/python bench/bench_spec.py [--pairs a,b1,b2,c] [--tokens 256] [--reps 2] [--warmup 1]

Each pair first serves --warmup speculative requests per prompt, as a running daemon would have:
what a pair learns (its acceptance evidence, per support class) lasts across requests. --warmup 0
measures a freshly loaded pair.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from derive_models import STANDARD_SET, extend, smollm2_path, truncate  # noqa: E402, F401
from prompts import PROMPTS, chat  # noqa: E402

from sidecar.config.entries import build_entry  # noqa: E402
from sidecar.config.loader import parse  # noqa: E402
from sidecar.config.schema import NgramDraft  # noqa: E402
from sidecar.engine.cost import CostModel  # noqa: E402
from sidecar.engine.drafters import NgramDrafter, common_prefix  # noqa: E402
from sidecar.engine.llama import Context  # noqa: E402
from sidecar.engine.seqview import SeqView  # noqa: E402
from sidecar.pairing.probe import predict_speedup  # noqa: E402
from sidecar.runtime.contract import Job, Outcome, Prompt  # noqa: E402
from sidecar.runtime.llamacpp import LlamaEngine  # noqa: E402
from sidecar.runtime.manager import Runtime  # noqa: E402

OUT = REPO / "bench" / "out" / "models"
LONG_ROWS = 33  # the n-gram bound is also given for drafts of up to 32 tokens


def pairs(models: Path) -> dict[str, tuple[str, str, str]]:
    smol = str(smollm2_path())
    return {
        "a": ("SmolLM2 + n-gram", smol, "ngram"),
        "b1": ("SmolLM2+120 layers (eps 0) + SmolLM2 draft", str(models / "smollm2-x120-eps0.gguf"), smol),
        "b2": ("SmolLM2+120 layers (one eps 1) + SmolLM2 draft", str(models / "smollm2-x120-one1.gguf"), smol),
        "c": ("SmolLM2 + first-8-layers draft", smol, str(models / "smollm2-trunc8.gguf")),
    }


def ensure_models(models: Path) -> None:
    missing = [n for n in STANDARD_SET if not (models / n).exists()]
    if missing:
        import subprocess

        subprocess.run([sys.executable, str(REPO / "bench" / "derive_models.py"), "--out", str(models)], check=True)


@dataclass
class Run:
    prompt: list[int]  # the prompt tokens the runtime decoded (its BOS rule applied)
    tokens: list[int]
    tok_s: float
    drafted: int
    accepted: int
    rounds: int
    fallback: str | None


async def generate(rt: Runtime, entry, text: str, n: int, speculate: bool) -> Run:  # type: ignore[no-untyped-def]
    opts = {"temperature": 0, "num_predict": n}
    if not speculate:
        opts["draft_num_predict"] = 0
    out: Outcome | None = None
    async for ev in rt.generate(entry, Job(Prompt.of_completion(text, raw=True), opts, keep_alive=-1)):
        if isinstance(ev, Outcome):
            out = ev
    assert out is not None
    r = out
    prompt = out.context[: len(out.context) - len(r.tokens)]
    return Run(prompt, r.tokens, len(r.tokens) / r.eval_seconds, r.draft_tokens, r.draft_accepted_tokens,
               r.draft_rounds, r.fallback)


def agreement(target_tokens: list[int], prompt: list[int], draft_ctx: Context) -> float:
    """Greedy agreement: how often the draft's argmax equals the target's next token."""
    seq = prompt + target_tokens
    draft_ctx.clear()
    draft_ctx.prefill(seq[: len(prompt) - 1])
    hits = total = 0
    pos = len(prompt) - 1
    while pos < len(seq) - 1:
        chunk = seq[pos : min(len(seq) - 1, pos + draft_ctx.n_batch)]
        logits = draft_ctx.decode(chunk)
        for i, row in enumerate(logits):
            hits += int(np.argmax(row)) == seq[pos + i + 1]
            total += 1
        pos += len(chunk)
    draft_ctx.clear()
    return hits / max(1, total)


def bound(a: float, curve: list[float], c: float) -> tuple[float, int]:
    """The module docstring's bound (pairing.probe's prediction, in target steps), at least 1 (k = 0)."""
    best, k = predict_speedup(a, [0.0, *curve], c)
    return (best, k) if best > 1.0 else (1.0, 0)


def ngram_bound(prompt: list[int], out: list[int], curve: list[float], draft: NgramDraft,
                switch: float = 0.0) -> float:
    """The best speed-up any choice of draft lengths could get from this n-gram drafter on this output."""
    drafter = NgramDrafter(draft.min_n, draft.max_n)
    return oracle_bound(prompt, out, curve, [lambda ctx, k: drafter.propose(ctx, k).tokens], switch)


def oracle_bound(prompt: list[int], out: list[int], curve: list[float],
                 proposers: Sequence[Callable[[list[int], int], list[int]]], switch: float = 0.0) -> float:
    """The best speed-up any choice of draft lengths and sources could get on this output.

    Greedy output is fixed and each source's proposal is a function of the context (and of what a
    cache learnt before the request), so how many of its tokens the target would accept at each
    position (m_i, the best source's) is known. A round at position i that drafts k <= m_i tokens
    emits k + 1 and costs v(k + 1) = curve[k]; dynamic programming over positions finds the
    cheapest way through, against len(out) plain steps. A stretch of batches that begins after plain
    steps also costs `switch` (CostModel.t_switch, in steps). Python overhead is left out."""
    context = list(prompt)
    reach = []
    for i in range(len(out)):
        reach.append(max(common_prefix(p(context, len(curve) - 1), out[i : i + len(curve) - 1])
                         for p in proposers))
        context.append(out[i])
    n = len(out)
    # after[i] / plain[i]: the cheapest way from position i when the last decode was a batch / a plain step
    after, plain = [0.0] * (n + 1), [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        step = 1.0 + plain[i + 1]
        batch = min((curve[k] + after[i + k + 1] for k in range(1, min(reach[i], n - 1 - i) + 1)),
                    default=float("inf"))
        after[i], plain[i] = min(step, batch), min(step, batch + switch)
    return n / after[0] if after[0] else 1.0  # the prompt's prefill was a batch


def all_accepted_bound(curve: list[float]) -> tuple[float, int]:
    """What the machine allows at best: every draft accepted, max_n n / v(n) (and that n)."""
    return max((n / v, n) for n, v in enumerate(curve, start=1))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def bench_pair(key: str, label: str, target: str, draft: str, args: argparse.Namespace) -> None:
    yaml = f"pairs:\n  bench:{key}:\n    from: {target}\n    draft: {draft}\n    parameters:\n      num_ctx: 2048\n"
    if draft == "ngram":
        # The bound is the n-gram drafter's; and the cross-request cache beside it would draft each
        # repeated prompt from the run before (target-only runs teach it too).
        yaml += "    speculative:\n      cache: \"off\"\n"
    config = parse(yaml)
    entry = build_entry(f"bench:{key}", config.pairs[f"bench:{key}"])
    rt = Runtime(LlamaEngine(), keep_alive=-1)
    rt.set_entries({entry.name: entry})
    t0 = time.perf_counter()
    lm, _ = await rt.load(entry)
    load_s = time.perf_counter() - t0
    pe = lm.pairs[entry.name]
    cost = pe.cost
    curve = cost.verify_curve()
    c = cost.t_draft / cost.t_step[1] if pe.draft_ctx else 0.0
    print(f"\n### {key}: {label}\n")
    print(f"load {load_s:.1f}s; target step {cost.t_step[1] * 1e3:.1f} ms; draft step / target step c = {c:.3f}; "
          f"plain steps after a batch cost {cost.t_switch / cost.t_step[1]:.2f} steps more")
    shown = ", ".join(f"{v:.2f}" for v in curve)
    print(f"verify cost v(n) = t(n rows) / t(1 row), n = 1..{len(curve)}: {shown}")
    ngram = entry.config.draft if isinstance(entry.config.draft, NgramDraft) else None
    if ngram is not None:  # the bound for the longest drafts too: does a longer n_max leave much behind?
        wide = CostModel(LONG_ROWS)
        await asyncio.wrap_future(lm.batcher.call(lambda: wide.calibrate(SeqView(lm.ctx, 0))))
        wide_curve = wide.verify_curve()
        print(f"verify cost up to {LONG_ROWS} rows: "
              + ", ".join(f"v({n})={wide_curve[n - 1]:.2f}" for n in (8, 12, 16, 24, LONG_ROWS)))
    for _ in range(args.warmup):
        for q in PROMPTS.values():
            await generate(rt, entry, chat(q), args.tokens, speculate=True)
    print(f"warm-up: {args.warmup} speculative request(s) per prompt, on the same prompts, before measuring "
          "(a running daemon's pair keeps its acceptance evidence across requests)")
    print()
    print("| prompt | target-only tok/s | speculative tok/s | ratio | acceptance | mean accepted length "
          "| agreement | bound | ratio/bound | identical | fallback |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ratios, shorts = [], []
    for name, q in PROMPTS.items():
        text = chat(q)
        plain_runs, spec_runs = [], []
        for _ in range(args.reps):
            plain_runs.append(await generate(rt, entry, text, args.tokens, speculate=False))
            spec_runs.append(await generate(rt, entry, text, args.tokens, speculate=True))
        p = statistics.median(r.tok_s for r in plain_runs)
        s = statistics.median(r.tok_s for r in spec_runs)
        drafted = sum(r.drafted for r in spec_runs)
        acc = sum(r.accepted for r in spec_runs)
        rounds = sum(r.rounds for r in spec_runs)
        prompt, ref = plain_runs[0].prompt, plain_runs[0].tokens
        parted = [common_prefix(r.tokens, ref) for r in plain_runs + spec_runs if r.tokens != ref]
        agree = bnd = ""
        ratio_bound = ""
        if pe.draft_ctx is not None:
            draft = SeqView(pe.draft_ctx, 0)
            a = await asyncio.wrap_future(lm.batcher.call(
                lambda prompt=prompt, ref=ref, draft=draft: agreement(ref, prompt, draft)))
            b, k = bound(a, curve, c)
            agree, bnd, ratio_bound = f"{a:.3f}", f"{b:.2f} (k={k})", f"{(s / p) / b:.2f}"
        if ngram is not None:
            b = ngram_bound(prompt, ref, curve, ngram, cost.t_switch / cost.t_step[1])
            b_wide = ngram_bound(prompt, ref, wide_curve, ngram, wide.t_switch / wide.t_step[1])
            bnd = f"{b:.2f} (k<={len(curve) - 1}); {b_wide:.2f} (k<={LONG_ROWS - 1})"
            ratio_bound = f"{(s / p) / b:.2f}"
        fb = next((r.fallback for r in spec_runs if r.fallback), None)
        print(f"| {name} | {p:.1f} | {s:.1f} | {s / p:.2f} | "
              f"{acc / drafted if drafted else 0:.2f} ({acc}/{drafted}) | "
              f"{1 + acc / rounds if rounds else 1:.2f} | {agree} | {bnd} | {ratio_bound} | "
              f"{f'NO (from token {min(parted)})' if parted else 'yes'} | {fb or ''} |")
        ratios.append(s / p)
        sp, ss = [], []
        for _ in range(5 * args.reps):  # 8 tokens take ~60 ms and time noisily: more runs, alternating
            sp.append(await generate(rt, entry, text, 8, speculate=False))
            ss.append(await generate(rt, entry, text, 8, speculate=True))
        shorts.append(statistics.median(r.tok_s for r in ss) / statistics.median(r.tok_s for r in sp))
    print(f"\nshort outputs (num_predict 8), ratio per prompt: {', '.join(f'{x:.2f}' for x in shorts)}; "
          f"geo-mean ratio 256 tokens {statistics.geometric_mean(ratios):.2f}; peak RSS {peak_rss_mb():.0f} MB")
    await rt.unload_all()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", default="a,b1,b2,c")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="speculative requests per prompt before measuring")
    ap.add_argument("--models", type=Path, default=OUT)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    keys = args.pairs.split(",")
    if keys != ["a"]:  # pair a needs only SmolLM2 itself
        ensure_models(args.models)
    table = pairs(args.models)
    print(f"# bench_spec: greedy, {args.tokens} tokens, median of {args.reps}, alternating target-only/speculative")
    for key in keys:
        label, target, draft = table[key]
        await bench_pair(key, label, target, draft, args)


if __name__ == "__main__":
    asyncio.run(main())
