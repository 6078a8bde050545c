"""Workloads whose requests repeat each other, side by side: target-only, n-gram only, the suffix cache.

Apps and agents send many requests whose outputs repeat: the same answer in a fresh chat, the
same JSON skeleton filled from different inputs, the same tool-call boilerplate. Three workloads,
each a sequence of fresh requests (greedy, through the daemon's runtime as a client's would go):

- repeat:  the same question in 4 fresh chats, no shared context;
- extract: one JSON schema of 10 fields, filled by `format` from 6 different passages;
- agent:   a 6-step tool-calling loop, each step a fresh request carrying the conversation so far
           (SmolLM2's template has no tools, so the tools are described in the system message and
           called as JSON in the content, as small-model agents do).

Pair a (SmolLM2 + n-gram) runs each request target-only, with `speculative.cache: "off"` (the
n-gram drafter alone) and with the default per-pair cache, rotating the order per request. Each
repetition starts from an empty cache. Per request the table gives tokens/s, ratios against
target-only, acceptance per source, the oracle bound of the cache pair's sources (the best any
choice of draft lengths could do with what the n-gram drafter and the cache would propose,
bench_spec.oracle_bound) and the all-accepted bound of the machine: max_n n / v(n).

The hybrid section runs the four bench prompts on the padded pair (the x120 target, SmolLM2 as
draft) with `draft: ngram`, `draft: MODEL` and `draft: [ngram, MODEL]`.

`--llama-server` runs llama.cpp's own server (bench/llama_server.py builds it) on the same
prompt tokens: the workloads with `ngram-cache` and `ngram-mod`, the hybrid prompts with
`draft-simple` and `draft-simple,ngram-mod`, each against its own `--spec-type none` server.

    .venv/bin/python bench/bench_workloads.py [--only repeat,extract,agent,hybrid] [--reps 2]
        [--llama-server]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_spec import OUT, all_accepted_bound, ensure_models, oracle_bound  # noqa: E402
from derive_models import smollm2_path  # noqa: E402
from prompts import PROMPTS, chat  # noqa: E402

from sidecar.config.entries import PairEntry, build_entry  # noqa: E402
from sidecar.config.loader import parse  # noqa: E402
from sidecar.engine.drafters import NgramDrafter, common_prefix  # noqa: E402
from sidecar.engine.suffix import SuffixCache, SuffixDrafter  # noqa: E402
from sidecar.runtime.contract import Job, Outcome, Prompt  # noqa: E402
from sidecar.runtime.llamacpp import LlamaEngine  # noqa: E402
from sidecar.runtime.manager import Runtime  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
        "country": {"type": "string"}, "occupation": {"type": "string"}, "employer": {"type": "string"},
        "email": {"type": "string"}, "phone": {"type": "string"}, "start_year": {"type": "integer"},
        "remote": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "country", "occupation", "employer", "email", "phone", "start_year",
                 "remote"],
}  # fmt: skip

PASSAGES = [
    "Maria Lopez, 34, lives in Valencia, Spain. She has worked as a data engineer at Nubera since 2019, "
    "mostly from home. Reach her at maria.lopez@nubera.es or +34 611 204 887.",
    "Tom Becker is a 51-year-old machinist from Leipzig, Germany. He joined Kranwerk GmbH in 1998 and works "
    "on site every day. Email tom.becker@kranwerk.de, phone +49 341 778 0192.",
    "Aiko Tanaka (28) is a UX designer at Hoshi Labs in Osaka, Japan, where she started in 2021. She works "
    "remotely three days a week; contact aiko@hoshilabs.jp, +81 6 5512 3340.",
    "Samuel Okafor, a 42-year-old civil engineer, lives in Lagos, Nigeria and has been with Delta Build Ltd "
    "since 2010. He is always on site. samuel.okafor@deltabuild.ng, +234 803 555 0147.",
    "Chloe Martin, 23, a junior accountant from Lyon, France, joined Comptex in 2024 and works from the "
    "office. Her email is c.martin@comptex.fr and her phone +33 4 72 10 55 89.",
    "Ravi Iyer is 37 and a product manager at Tessel Cloud in Bengaluru, India, since 2016, working fully "
    "remote. Write to ravi.iyer@tessel.io or call +91 80 4123 9987.",
]

AGENT_SYSTEM = (
    "You are an assistant that completes tasks by calling tools. Tools:\n"
    '- search_flights(origin: str, destination: str, date: str)\n'
    '- book_flight(flight_id: str, passenger: str)\n'
    '- get_weather(city: str, date: str)\n'
    '- send_email(to: str, subject: str, body: str)\n'
    'To call a tool, reply with one JSON object only: {"tool": NAME, "arguments": {...}}. '
    "When the task is done, reply with a short summary."
)
AGENT_TASK = ("Book me the cheapest flight from Amsterdam to Lisbon on 2026-12-18 for Jan de Vries, check the "
              "weather in Lisbon that day, and email the booking to jan@devries.nl.")
AGENT_RESULTS = [
    '{"flights": [{"id": "TP661", "price": 189}, {"id": "KL1693", "price": 214}, {"id": "HV5951", "price": 97}]}',
    '{"booking": "confirmed", "flight_id": "HV5951", "passenger": "Jan de Vries", "reference": "X7K2QP"}',
    '{"city": "Lisbon", "date": "2026-12-18", "forecast": "sunny", "high_c": 17, "low_c": 10}',
    '{"status": "sent", "to": "jan@devries.nl"}',
    '{"error": "no such tool"}',
    '{"status": "ok"}',
]
REPEAT_QUESTION = "Explain how a hash map works and when you would use one instead of a sorted list."


@dataclass
class Turn:
    """One request of a workload: what the client sends."""

    prompt: Prompt
    format: dict[str, Any] | None = None


def repeat_turns() -> Iterator[Turn]:
    for _ in range(4):
        yield Turn(Prompt.of_chat([{"role": "user", "content": REPEAT_QUESTION}]))


def extract_turns() -> Iterator[Turn]:
    for passage in PASSAGES:
        messages = [{"role": "system", "content": "Extract the person's details from the text as JSON."},
                    {"role": "user", "content": passage}]
        yield Turn(Prompt.of_chat(messages), SCHEMA)


def agent_turns(reply: Callable[[], str]) -> Iterator[Turn]:
    """Six steps; each step's history holds the model's own earlier replies (`reply()`: the last one)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": AGENT_SYSTEM},
                                      {"role": "user", "content": AGENT_TASK}]
    for step in range(6):
        yield Turn(Prompt.of_chat(list(messages)))
        messages += [{"role": "assistant", "content": reply()}, {"role": "tool", "content": AGENT_RESULTS[step]}]


@dataclass
class Run:
    prompt: list[int]
    tokens: list[int]
    text: str
    tok_s: float
    sources: dict[str, tuple[int, int]] = field(default_factory=dict)
    fallback: str | None = None
    steps: int = 0  # target decodes: one per token, less the accepted draft tokens


async def generate(rt: Runtime, entry: PairEntry, turn: Turn, tokens: int, speculate: bool) -> Run:
    opts: dict[str, Any] = {"temperature": 0, "num_predict": tokens}
    if not speculate:
        opts["draft_num_predict"] = 0
    out: Outcome | None = None
    parts = []
    async for ev in rt.generate(entry, Job(turn.prompt, opts, format=turn.format, keep_alive=-1)):
        if isinstance(ev, Outcome):
            out = ev
        else:
            parts.append(ev.content)
    assert out is not None
    r = out
    prompt = out.context[: len(out.context) - len(r.tokens)]
    return Run(prompt, r.tokens, "".join(parts), len(r.tokens) / max(r.eval_seconds, 1e-9),
               dict(r.drafts_by_source), r.fallback, len(r.tokens) - r.draft_accepted_tokens)


def pair_entry(name: str, target: str, draft: str, cache: str = "off") -> PairEntry:
    yaml = (f"pairs:\n  {name}:\n    from: {target}\n    draft: {draft}\n"
            "    runtime:\n      num_thread: 2\n      num_gpu: 0\n"
            f"    parameters:\n      num_ctx: 4096\n    speculative:\n      cache: \"{cache}\"\n")
    return build_entry(name, parse(yaml).pairs[name])


def _paired(runs: dict[str, list[Run]]) -> str:
    """Median (min-max) over repetitions of the hybrid's rate over the better of n-gram's and the
    model's in that repetition: a repetition runs all four in turn, so the machine's drift from one
    minute to the next largely cancels within it."""
    got = sorted(h.tok_s / max(n.tok_s, m.tok_s) for h, n, m in zip(runs["hybrid"], runs["ngram"], runs["model"],
                                                                    strict=True))
    return f"{statistics.median(got):.2f} ({got[0]:.2f}-{got[-1]:.2f})"


def _steps(runs: list[Run]) -> str:
    """A configuration's target decodes per request, in repetition order: where two drafters'
    timed rates part but their steps match, the difference is in what a step cost, not in what
    was drafted."""
    return ",".join(str(r.steps) for r in runs)


def _sources(runs: list[Run]) -> str:
    total: dict[str, list[int]] = {}
    for r in runs:
        for name, (d, a) in r.sources.items():
            t = total.setdefault(name, [0, 0])
            t[0] += d
            t[1] += a
    return ", ".join(f"{n} {a}/{d}" for n, (d, a) in sorted(total.items()) if d) or "-"


WORKLOADS: dict[str, tuple[Callable[..., Iterator[Turn]], int]] = {
    "repeat": (lambda reply: repeat_turns(), 256),
    "extract": (lambda reply: extract_turns(), 160),
    "agent": (agent_turns, 96),
}


async def bench_workload(rt: Runtime, name: str, reps: int, results: dict[str, Any]) -> None:
    """Every request target-only, n-gram only and with the pair's cache; one fresh cache per repetition."""
    make, tokens = WORKLOADS[name]
    smol = str(smollm2_path())
    per: dict[int, dict[str, list[Run]]] = {}
    curve: list[float] = []
    last = [""]  # the agent's history holds the model's own replies (target-only's, all identical)
    for rep in range(reps):
        off = pair_entry(f"w-{name}:off", smol, "ngram")
        cached = pair_entry(f"w-{name}:cache{rep}", smol, "ngram", cache="pair")
        rt.set_entries({off.name: off, cached.name: cached})
        lm, _ = await rt.load(cached)
        await rt.load(off)
        curve = lm.pairs[cached.name].cost.verify_curve()
        for i, turn in enumerate(make(lambda: last[0])):
            runs = per.setdefault(i, {"plain": [], "off": [], "cache": []})
            order = [("plain", off, False), ("off", off, True), ("cache", cached, True)]
            order = order[i % 3 :] + order[: i % 3]
            for who, entry, speculate in order:
                runs[who].append(await generate(rt, entry, turn, tokens, speculate))
            last[0] = runs["plain"][-1].text
        await rt.unload_all()
    # The cache pair's sources, replayed over the recorded outputs: the n-gram drafter on the request's
    # own context, and a cache that learnt every earlier request as SuffixDrafter.finish teaches it.
    mirror = SuffixCache()
    teacher = SuffixDrafter(mirror)
    d = cached.config.ngram
    assert d is not None
    ngram = NgramDrafter(d.min_n, d.max_n)
    best_all, n_all = all_accepted_bound(curve)
    print(f"\n### {name}: pair a (SmolLM2 + n-gram), {tokens} tokens, median of {reps}\n")
    print(f"verify cost v(n), n = 1..{len(curve)}: {', '.join(f'{v:.2f}' for v in curve)}; "
          f"all-accepted bound max_n n/v(n) = {best_all:.2f} (n={n_all})\n")
    print("| request | target-only tok/s | n-gram only | cache | ratio n-gram | ratio cache "
          "| sources (accepted/drafted) | oracle bound | cache/oracle | cache/all-accepted | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for i, runs in per.items():
        ref = runs["plain"][0]
        p = statistics.median(r.tok_s for r in runs["plain"])
        o = statistics.median(r.tok_s for r in runs["off"])
        c = statistics.median(r.tok_s for r in runs["cache"])
        proposers = [lambda ctx, k: ngram.propose(ctx, k).tokens,
                     lambda ctx, k: mirror.lookup(ctx, min(k, teacher.max_draft)).tokens]
        bound = oracle_bound(ref.prompt, ref.tokens, curve, proposers)
        teacher.finish(ref.prompt, ref.tokens, "stop")
        same = all(r.tokens == ref.tokens for rs in runs.values() for r in rs)
        if not same:
            parted = min(common_prefix(r.tokens, ref.tokens) for rs in runs.values() for r in rs)
        print(f"| {i + 1} | {p:.1f} | {o:.1f} | {c:.1f} | {o / p:.2f} | {c / p:.2f} | {_sources(runs['cache'])} "
              f"| {bound:.2f} | {c / p / bound:.2f} | {c / p / best_all:.2f} | "
              f"{'yes' if same else f'NO (from token {parted})'} |")
        rows.append({"request": i + 1, "plain": p, "ngram": o, "cache": c, "bound": bound, "all_accepted": best_all,
                     "tokens": len(ref.tokens), "identical": same, "sources": _sources(runs["cache"]),
                     "prompt_tokens": ref.prompt, "format": name == "extract"})
    results[name] = rows


async def bench_hybrid(rt: Runtime, models: Path, reps: int, tokens: int, results: dict[str, Any],
                       prompts: Sequence[str] = tuple(PROMPTS)) -> None:
    """The padded pair's four prompts (or those named): n-gram only, model only, and both."""
    ensure_models(models)
    target, smol = str(models / "smollm2-x120-eps0.gguf"), str(smollm2_path())
    entries = {"ngram": pair_entry("h:ngram", target, "ngram"), "model": pair_entry("h:model", target, smol),
               "hybrid": pair_entry("h:hybrid", target, f"[ngram, {smol}]")}
    rt.set_entries({e.name: e for e in entries.values()})
    for e in entries.values():
        await rt.load(e)
    print(f"\n### hybrid: SmolLM2+120 layers (eps 0) target, SmolLM2 draft; {tokens} tokens, median of {reps}\n")
    print("| prompt | target-only tok/s | n-gram | model | hybrid | ratio n-gram | ratio model | ratio hybrid "
          "| hybrid / better | paired per repetition | target steps (n-gram / model / hybrid) "
          "| hybrid sources (accepted/drafted) | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for pname, q in ((p, PROMPTS[p]) for p in prompts):
        turn = Turn(Prompt.of_completion(chat(q), raw=True))
        runs: dict[str, list[Run]] = {"plain": [], "ngram": [], "model": [], "hybrid": []}
        for rep in range(reps):
            order = ["plain", "ngram", "model", "hybrid"]
            order = order[rep % 4 :] + order[: rep % 4]
            for who in order:
                entry = entries["ngram" if who == "plain" else who]
                runs[who].append(await generate(rt, entry, turn, tokens, who != "plain"))
        tps = {k: statistics.median(r.tok_s for r in v) for k, v in runs.items()}
        ref = runs["plain"][0]
        same = all(r.tokens == ref.tokens for rs in runs.values() for r in rs)
        rn, rm, rh = (tps[k] / tps["plain"] for k in ("ngram", "model", "hybrid"))
        print(f"| {pname} | {tps['plain']:.1f} | {tps['ngram']:.1f} | {tps['model']:.1f} | {tps['hybrid']:.1f} "
              f"| {rn:.2f} | {rm:.2f} | {rh:.2f} | {rh / max(rn, rm):.2f} | {_paired(runs)} "
              f"| {' / '.join(_steps(runs[k]) for k in ('ngram', 'model', 'hybrid'))} "
              f"| {_sources(runs['hybrid'])} "
              f"| {'yes' if same else 'NO'} |")
        rows.append({"prompt": pname, **tps, "reps": {k: [r.tok_s for r in v] for k, v in runs.items()},
                     "steps": {k: [r.steps for r in v] for k, v in runs.items()},
                     "identical": same, "prompt_tokens": ref.prompt})
    results["hybrid"] = rows
    await rt.unload_all()


def llama_server_runs(results: dict[str, Any], models: Path, reps: int, hybrid_tokens: int) -> None:
    """llama-server on the same prompt tokens: each variant beside its own target-only server."""
    import llama_server as ls

    binary = ls.build()
    smol = smollm2_path()
    jobs = []
    for name in ("repeat", "extract", "agent"):
        if name in results:
            variants = {"ngram-cache": ("--spec-type", "ngram-cache"), "ngram-mod": ("--spec-type", "ngram-mod")}
            jobs.append((name, smol, variants, WORKLOADS[name][1]))
    if "hybrid" in results:
        base = ("-md", str(smol), "-ngld", "0", "--spec-draft-n-max", "8", "--spec-draft-p-min", "0.5")
        variants = {"draft-simple": ("--spec-type", "draft-simple", *base),
                    "draft-simple,ngram-mod": ("--spec-type", "draft-simple,ngram-mod", *base)}
        jobs.append(("hybrid", models / "smollm2-x120-eps0.gguf", variants, hybrid_tokens))
    logs = OUT / "llama_server_logs"
    for name, target, variants, tokens in jobs:
        rows = results[name]
        print(f"\n### llama-server, {name}: {Path(target).name}, {tokens} tokens, median of {reps}\n")
        print("| request | " + " | ".join(f"{v} ratio | {v} accepted/drafted" for v in variants) + " | ours |")
        print("|---|" + "---|---|" * len(variants) + "---|")
        ratios: dict[int, dict[str, list[float]]] = {}
        counts: dict[int, dict[str, list[int]]] = {}
        for _ in range(reps):  # fresh servers per repetition: what they learn starts empty, as ours
            with ExitStack() as stack:
                servers = {v: stack.enter_context(ls.server(binary, Path(target), extra, logs / f"w-{name}-{v}.log", 2))
                           for v, extra in {"base": ("--spec-type", "none"), **variants}.items()}
                for i, row in enumerate(rows):
                    body: dict[str, Any] = {"prompt": row["prompt_tokens"], "n_predict": tokens, "temperature": 0,
                                            "cache_prompt": False}
                    if row.get("format"):
                        body["json_schema"] = SCHEMA
                    got = {v: s.post("/completion", json=body).json()["timings"] for v, s in servers.items()}
                    for v in variants:
                        t = got[v]
                        ratios.setdefault(i, {}).setdefault(v, []).append(
                            t["predicted_per_second"] / got["base"]["predicted_per_second"])
                        c = counts.setdefault(i, {}).setdefault(v, [0, 0])
                        c[0] += int(t.get("draft_n_accepted") or 0)
                        c[1] += int(t.get("draft_n") or 0)
        for i, row in enumerate(rows):
            ours = (row["cache"] / row["plain"]) if "cache" in row else (row["hybrid"] / row["plain"])
            label = row.get("request", row.get("prompt"))
            cells = " | ".join(f"{statistics.median(ratios[i][v]):.2f} | {counts[i][v][0]}/{counts[i][v][1]}"
                               for v in variants)
            print(f"| {label} | {cells} | {ours:.2f} |")
            row["llama_server"] = {v: statistics.median(ratios[i][v]) for v in variants}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="repeat,extract,agent,hybrid")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hybrid-tokens", type=int, default=192)
    ap.add_argument("--hybrid-prompts", default=",".join(PROMPTS), help="the hybrid section's prompts")
    ap.add_argument("--models", type=Path, default=OUT)
    ap.add_argument("--llama-server", action="store_true", help="also run llama-server on the same prompts")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "out" / "workloads.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    only = args.only.split(",")
    rt = Runtime(LlamaEngine(), keep_alive=-1)
    results: dict[str, Any] = {}
    print(f"# bench_workloads: greedy, 2 threads, {time.strftime('%Y-%m-%d %H:%M')}")
    for name in ("repeat", "extract", "agent"):
        if name in only:
            await bench_workload(rt, name, args.reps, results)
    if "hybrid" in only:
        await bench_hybrid(rt, args.models, args.reps, args.hybrid_tokens, results, args.hybrid_prompts.split(","))
    if args.llama_server:
        llama_server_runs(results, args.models, args.reps, args.hybrid_tokens)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
