"""The planner's choices on a clock that does not drift: `draft: auto` against its sources, counted.

bench_workloads.py times the padded pair's hybrid (`draft: [ngram, MODEL]`) against n-gram and the
model alone, and on this 2-core machine two identical configurations differ by about ten percent
between repetitions (bench/concurrency.py's `-again` control): a hybrid within a few percent of the
better source cannot be told from it by timing. This bench asks the question the timing cannot
answer: given the same prices, does the hybrid choose rounds as good as the better source's?

Every configuration decodes for real (llama.cpp, greedy, the planner and drafters of the daemon),
but its cost model is held at one set of prices, measured once at the start and never updated:
the padded target's verify curve (SmolLM2 + 120 zero layers) and SmolLM2's draft step and catch-up.
Each round is charged at those prices (the target's rows, the draft tokens and the catch-up a
model round pays), and so is what the planner learns from a round's time (its fallback verdicts).
The tokens are SmolLM2's: the padded target computes the same logits (its added layers add zero),
so SmolLM2 decodes in its place, four times faster.

Each configuration is a fresh pair that answers the prompts in order, `--reps` requests each, as
bench_workloads.py's hybrid section does, so evidence carries from one prompt to the next. The
table gives the predicted speed-up over target-only (its tokens at one plain step each) per
request, median (min-max), the hybrid over the better source per repetition, and the rounds.
Nothing here is a measured speed: it prices the decisions, and bench_workloads.py times them.

    .venv/bin/python bench/replay.py [--reps 3] [--tokens 192] [--prompts code,edit,summarise,story]
                                     [--shape measured|prior] [--prices prices.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_spec import OUT, ensure_models  # noqa: E402
from derive_models import smollm2_path  # noqa: E402
from prompts import PROMPTS, chat  # noqa: E402

from sidecar.engine import planner  # noqa: E402
from sidecar.engine.adaptive import ALONE, NGRAM_N_MAX, SpeculativeConfig, Step  # noqa: E402
from sidecar.engine.decoder import Decoder, Request, Result  # noqa: E402
from sidecar.engine.drafters import Drafter, ModelDrafter, NgramDrafter  # noqa: E402
from sidecar.engine.hybrid import HybridDrafter  # noqa: E402
from sidecar.engine.llama import Context, ContextParams, Weights  # noqa: E402
from sidecar.engine.rounds import Round  # noqa: E402
from sidecar.engine.sampling import SamplingParams  # noqa: E402
from sidecar.engine.timing import prior_curve  # noqa: E402
from tests.prices import Fixed  # noqa: E402


@dataclass
class Clock:
    """Seconds charged to the request under way, at the fixed prices."""

    seconds: float = 0.0


CLOCK = Clock()
_record = planner.Plan.record


def charged_record(self: planner.Plan, rnd: Round, drafted: int, accepted: int, draft_seconds: float,
                   verify_seconds: float, produced: int, step_seconds: float | None = None, caught_up: int = 0,
                   rows: int = 0, observe: bool = True, plain_seconds: float | None = None, step: Step = ALONE,
                   company: float = 1.0) -> None:
    """Plan.record with the round's times replaced by its price: the rows at the curve, and for a
    model round its draft tokens and catch-up at the draft's step and per-token prefill."""
    cost = self.cost
    verify = cost.added(rows or drafted + 1)  # the curve, and past it along its last slope
    steps = draft = 0.0
    if (drafted or caught_up) and self.sources[rnd.source].has_cost:  # a probe may catch up and draft nothing
        steps = drafted * cost.t_draft
        draft = steps + caught_up * cost.t_catchup
    CLOCK.seconds += verify + draft
    _record(self, rnd, drafted, accepted, draft, verify, produced, None if step_seconds is None else steps,
            caught_up, rows, observe, plain_seconds, step, company)


PRICES = ("t_step", "t_same", "t_switch", "t_draft", "t_catchup")  # every price the planner reads


@dataclass
class Run:
    tokens: list[int]
    speedup: float
    steps: int
    sources: dict[str, tuple[int, int]]


def prices(target: Path, draft: Context, rows: int, shape: str) -> Fixed:
    """The padded target's verify curve and the draft's times, measured once here (the curve in a
    minute, as the daemon measures a wide one at load: the sizes between those timed interpolated).

    `shape` prior: the rows are priced on the CPU's prior curve instead (timing.prior_curve,
    SmolLM2's shape on 2 cores, 0.6 n + 0.4 steps) at the measured step. There a short draft pays
    (2 rows cost 1.6 steps; the padded target measures about 2), so the free source's
    short-match classes come into play; and the curve is the same in every run."""
    w = Weights(target, n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=512, n_threads=2))
    try:
        fixed = Fixed(rows)
        fixed.calibrate(ctx, budget=60.0)
        fixed.calibrate_draft(draft)
    finally:
        ctx.close()
        w.close()
    if shape == "prior":
        fixed.t_step = [0.0, *(prior_curve(n) * fixed.t_step[1] for n in range(1, len(fixed.t_step)))]
    return fixed


def run(decoder: Decoder, prompt: list[int], tokens: int) -> Run:
    CLOCK.seconds = 0.0
    decoder.target.clear()
    result = list(decoder.generate(Request(prompt, SamplingParams(temperature=0), num_predict=tokens)))[-1]
    assert isinstance(result, Result)
    plain = len(result.tokens) * decoder.cost.t_step[1]
    return Run(result.tokens, plain / CLOCK.seconds, len(result.tokens) - result.draft_accepted_tokens,
               dict(result.drafts_by_source))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    ap.add_argument("--models", type=Path, default=OUT)
    ap.add_argument("--shape", choices=("measured", "prior"), default="measured",
                    help="the target's rows priced on its measured curve or the CPU prior's shape")
    ap.add_argument("--prices", type=Path, help="JSON: written once measured, read if it exists, so that two "
                    "checkouts (this script copied into the older) are compared on the same prices")
    args = ap.parse_args()
    ensure_models(args.models)
    planner.Plan.record = charged_record  # type: ignore[method-assign]
    w = Weights(smollm2_path(), n_gpu_layers=0)
    params = ContextParams(n_ctx=2048, n_threads=2)
    target = Context(w, params)
    drafts = [Context(w, params) for _ in range(2)]  # each pair's own, kept across its requests
    if args.prices and args.prices.exists():
        base = Fixed(NGRAM_N_MAX + 1)
        for name, value in json.loads(args.prices.read_text()).items():
            setattr(base, name, value)
    else:
        base = prices(args.models / "smollm2-x120-eps0.gguf", drafts[0], NGRAM_N_MAX + 1, args.shape)
        if args.prices:
            args.prices.write_text(json.dumps({name: getattr(base, name) for name in PRICES}))
    t1 = base.t_step[1]
    print(f"prices: target step {t1 * 1e3:.1f} ms, verify curve (x step) "
          + ", ".join(f"{n}: {base.t_step[n] / t1:.2f}" for n in (2, 4, 8, 16, 32, 65))
          + f"; draft step {base.t_draft / t1:.2f}, catch-up {base.t_catchup / t1:.3f} a token\n")

    def pair(sources: list[Drafter], n_max: int) -> Decoder:
        cost = Fixed(n_max + 1)
        for name in PRICES:  # the curves cut to this pair's rows
            value = getattr(base, name)
            setattr(cost, name, value[: n_max + 2] if isinstance(value, list) else value)
        return Decoder(target, HybridDrafter(sources), SpeculativeConfig(n_max=n_max), cost)

    p_min = SpeculativeConfig().p_min
    pairs = {"ngram": pair([NgramDrafter()], NGRAM_N_MAX),
             "model": pair([ModelDrafter(drafts[0], p_min)], SpeculativeConfig().n_max),
             "hybrid": pair([NgramDrafter(), ModelDrafter(drafts[1], p_min)], NGRAM_N_MAX)}
    print("| prompt | n-gram | model | hybrid | hybrid / better (per repetition) | rounds n-gram / model / hybrid "
          "| identical |")
    print("|---|---|---|---|---|---|---|")
    for name in args.prompts.split(","):
        prompt = w.tokenize(chat(PROMPTS[name]), add_special=False, parse_special=True)
        runs: dict[str, list[Run]] = {k: [] for k in pairs}
        for _ in range(args.reps):
            for who, decoder in pairs.items():
                runs[who].append(run(decoder, prompt, args.tokens))
        ratio = sorted(h.speedup / max(n.speedup, m.speedup)
                       for h, n, m in zip(runs["hybrid"], runs["ngram"], runs["model"], strict=True))
        same = all(r.tokens == runs["ngram"][0].tokens for rs in runs.values() for r in rs)

        def cell(rs: list[Run]) -> str:
            xs = sorted(r.speedup for r in rs)
            return f"{statistics.median(xs):.2f} ({xs[0]:.2f}-{xs[-1]:.2f})"

        rounds = " / ".join(",".join(str(r.steps) for r in runs[k]) for k in pairs)
        print(f"| {name} | {cell(runs['ngram'])} | {cell(runs['model'])} | {cell(runs['hybrid'])} "
              f"| {statistics.median(ratio):.2f} ({ratio[0]:.2f}-{ratio[-1]:.2f}) | {rounds} "
              f"| {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
