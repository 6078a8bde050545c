"""The agent session's policy, offline: the real drafters, evidence and schedule at prices you set.

bench/agent_replay.py measures a session on the daemon, where the machine's noise, the fitted cost
model and the host all act at once. This script replays the same session's token streams (the
answers an agent_replay JSON holds, greedy and so the target's own) through the engine's n-gram
drafter, the suffix cache, the evidence and the schedule, with a step of r rows costing
1 + ROW x (r - 1) plain steps, and prints the modelled ratio to plain decoding per turn. It answers
"is this loss the policy's, or the prices'?" in seconds: `--priced` sets the row price the
schedule believes apart from the true one (`--row`). A request's drafts are capped by its slow
start (evidence.Belief.cap) as Sequence.menu caps them. Measured with it (bench/results/
2026-12-07-fit.md; the session of 2026-12-07): priced at 0.05 against 0.42 true, the free-text
turns run at 0.85-1.38x (0.67-0.78x before the slow start), priced right at 1.00-1.40x. The last
column is the bound on these drafters at the true price: every round drafting exactly what holds.

The prompt is the conversation's texts joined, not the pair's rendered template: the drafts look
up the whole history (engine.hybrid), so the template's few tokens change little.

    PYTHONPATH=. .venv/bin/python bench/policy_replay.py bench/out/agent_replay.json [--row 0.42] [--priced 0.05]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import agent_replay as ar  # noqa: E402

from sidecar.engine.cost import CostModel  # noqa: E402
from sidecar.engine.drafters import Drafter, NgramDrafter, common_prefix  # noqa: E402
from sidecar.engine.evidence import Evidence  # noqa: E402
from sidecar.engine.hosttime import HostPrice  # noqa: E402
from sidecar.engine.hybrid import HybridDrafter  # noqa: E402
from sidecar.engine.llama import Weights  # noqa: E402
from sidecar.engine.schedule import Menu, Option, schedule  # noqa: E402
from sidecar.engine.suffix import SuffixCache, SuffixDrafter  # noqa: E402
from sidecar.models.resolve import resolve  # noqa: E402

N_MAX = 64


def prices(row: float) -> CostModel:
    model = CostModel(N_MAX + 1)
    model.t_step = [0.0] + [1.0 + row * i for i in range(N_MAX + 1)]
    model.seed()
    model.fixed = True
    return model


def text_of(message: dict[str, Any]) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content
    parts = {"text": lambda b: b["text"], "tool_use": lambda b: json.dumps(b["input"]),
             "tool_result": lambda b: b["content"]}
    return "\n".join(parts[b["type"]](b) for b in content)


def turns(answers: list[str], tokenize: Any) -> Iterator[tuple[str, list[int], list[int]]]:
    """Each turn's (kind, prompt tokens, answer tokens), the conversation built as agent_replay builds it."""
    head = ar.SYSTEM + json.dumps(ar.TOOLS)
    history: list[dict[str, Any]] = [{"role": "user", "content": "Open utils.py, I want to work on it."},
                                     ar.tool_call("toolu_read", "read_file", {"path": "utils.py"})]
    for i, (kind, ask, _) in enumerate(ar.TURNS[: len(answers)]):
        if i == 0:
            history.append(ar.tool_result("toolu_read", ar.SOURCE, ask))
        elif kind == "tests":
            history += [ar.tool_call("toolu_tests", "run_tests", {}),
                        ar.tool_result("toolu_tests", ar.TEST_OUTPUT, ask)]
        else:
            history.append({"role": "user", "content": ask})
        opening = ar.prefill(1) if kind == "edit" and answers[i].startswith(ar.prefill(1)) else ""
        prompt = head + "\n".join(map(text_of, history)) + "\n" + opening
        yield kind, tokenize(prompt), tokenize(answers[i][len(opening) :])
        history.append({"role": "assistant", "content": answers[i]})


def replay(session: list[tuple[str, list[int], list[int]]], row: float, priced: float, seed: int) -> list[float]:
    """Each turn's modelled speed over plain decoding, one pair's evidence and suffix cache across turns."""
    evidence, cost, cache = Evidence(seed=seed), prices(priced), SuffixCache()
    ratios = []
    for _, prompt, out in session:
        sources: list[Drafter] = [NgramDrafter(), SuffixDrafter(cache)]
        drafter = HybridDrafter(sources)
        drafter.begin(None, None)  # type: ignore[arg-type]
        belief = evidence.request()  # the request's view of the pair's evidence, as Sequence holds it
        pos, seconds, drafted_last = 0, 0.0, False
        while pos < len(out):
            context, k_cap = prompt + out[:pos], min(N_MAX, len(out) - pos - 1)
            options = []
            for i, src in enumerate(sources):
                support = drafter.propose(i, context, 0, None).support
                k = min(k_cap, belief.cap(src.name))  # slow start, as Sequence.menu caps it
                if support.ready and k >= 1:
                    acc = [belief.draw(src.name, support if support.along is None else support.along(j))
                           for j in range(k)]
                    options.append(Option(i, np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(acc))))))
            plan = schedule([Menu(0, tuple(options), k_cap)], cost, HostPrice(), len(context), 0.03,
                            1.0 if drafted_last else 1.05, N_MAX) if options else None
            choice = plan.choices.get(0) if plan else None
            if choice is None:
                pos, seconds, drafted_last = pos + 1, seconds + 1.0, False
                continue
            proposal = drafter.propose(choice.source, context, choice.k, None)
            draft = proposal.tokens[: choice.k]
            m = common_prefix(draft, out[pos : pos + len(draft)])
            belief.observe(sources[choice.source].name, proposal.support, len(draft), m)
            pos, seconds, drafted_last = pos + m + 1, seconds + 1.0 + row * len(draft), True
        drafter.finish(prompt, out, "stop")
        ratios.append(len(out) / seconds)
    return ratios


def bound(session: list[tuple[str, list[int], list[int]]], row: float) -> list[float]:
    """Each turn's speed over plain decoding were every round to draft exactly what will hold: from
    the source whose draft holds longest, all of it (never a rejected row). No policy on these
    drafters and prices beats it; the gap to it is what the evidence and the schedule leave."""
    cache, ratios = SuffixCache(), []
    for _, prompt, out in session:
        sources: list[Drafter] = [NgramDrafter(), SuffixDrafter(cache)]
        drafter = HybridDrafter(sources)
        drafter.begin(None, None)  # type: ignore[arg-type]
        pos, seconds = 0, 0.0
        while pos < len(out):
            context, k = prompt + out[:pos], min(N_MAX, len(out) - pos - 1)
            m = max(common_prefix(drafter.propose(i, context, k, None).tokens, out[pos : pos + k])
                    for i in range(len(sources))) if k > 0 else 0
            pos, seconds = pos + m + 1, seconds + 1.0 + row * m
        drafter.finish(prompt, out, "stop")
        ratios.append(len(out) / seconds)
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("answers", type=Path, help="an agent_replay JSON (its first repetition's answers)")
    ap.add_argument("--row", type=float, default=0.42, help="a drafted row's true price, in plain steps")
    ap.add_argument("--priced", type=float, nargs="*", default=None,
                    help="the row prices the schedule believes (default: the true one)")
    ap.add_argument("--seeds", type=int, default=7, help="evidence draw seeds to take the median over")
    args = ap.parse_args()
    rows = json.loads(args.answers.read_text())
    answers = [r["answer"] for r in rows if r.get("rep", 0) == 0]
    weights = Weights(resolve(ar.SMOLLM2_REF).path, vocab_only=True)
    session = list(turns(answers, lambda s: weights.tokenize(s, add_special=False, parse_special=False)))
    priced = args.priced or [args.row]
    print("| turn | kind | tokens | " + " | ".join(f"priced {p} (median, min)" for p in priced) + " | bound |")
    print("|---|---|---|" + "---|" * len(priced) + "---|")
    results = {p: [replay(session, args.row, p, s) for s in range(args.seeds)] for p in priced}
    best = bound(session, args.row)
    for t, (kind, _, out) in enumerate(session):
        cells = [f"{statistics.median(r[t] for r in runs):.2f}, {min(r[t] for r in runs):.2f}"
                 for runs in results.values()]
        print(f"| {t + 1} | {kind} | {len(out)} | " + " | ".join(cells) + f" | {best[t]:.2f} |")


if __name__ == "__main__":
    main()
