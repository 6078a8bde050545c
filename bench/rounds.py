"""What a speculative round costs, against llama.cpp's own server: one stream, the same prompt repeated.

Issue #19, point 6: with the base speeds equal, a gap in speculative speed is in the rounds: how
long a draft may run where its support is total, and what a round costs beyond its decode. Five
servers run at once, each a real subprocess on a free loopback port, and every repetition sends
the same raw (ChatML-rendered) prompt to each of them in turn, rotating the order:

- ``llama-server none`` / ``llama-server ngram-mod``: llama.cpp's server at our binding's revision
  (bench/llama_server.py builds it), one slot, ``--spec-type none`` / ``ngram-mod`` (its defaults:
  a 24-token n-gram hash shared across requests, drafts of 48 to 64 tokens);
- ``daemon none``: ``sidecar serve``, ``draft: none``;
- ``daemon ngram``: ``draft: ngram`` with ``speculative: {cache: off}`` (the request's own text);
- ``daemon ngram+cache``: ``draft: ngram`` with the default per-pair suffix cache.

Prompts: ``edit`` (bench/prompts.py: add type hints to a module, reply with all of it) and
``explain`` (a free-text answer, which only a cross-request cache can draft once it has been
asked before). Each server first answers one warm-up request per prompt, so whatever learns
across requests (ngram-mod's hash, the suffix cache, the planner's evidence) has seen it once,
as it would have in a repeated workload. Rates are the servers' own decode rates
(``timings.predicted_per_second``; the daemon's ``eval_count / eval_duration``), greedy,
``--tokens`` each; the table gives the median over ``--reps`` and the ratio of each to its
plain server, plus the daemon's speculative rate over ngram-mod's.

    .venv/bin/python bench/rounds.py [--tokens 256] [--reps 3] [--threads 2] [--prompts edit,explain]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import concurrency as cc  # noqa: E402
import llama_server as ls  # noqa: E402
from prompts import PROMPTS, chat  # noqa: E402

TEXTS = {
    "edit": PROMPTS["edit"],
    "explain": "Explain in detail how a CPU executes instructions, from fetch to write-back.",
}
CONFIGS = ("llama-server none", "llama-server ngram-mod", "daemon none", "daemon ngram", "daemon ngram+cache")


def configs() -> list[cc.Config]:
    smol = str(ls.smollm2_path())
    return [
        cc.Config("llama-server none", "llama-server", smol, extra=("--spec-type", "none")),
        cc.Config("llama-server ngram-mod", "llama-server", smol, extra=("--spec-type", "ngram-mod")),
        cc.Config("daemon none", "daemon", cc.SMOLLM2_REF),
        cc.Config("daemon ngram", "daemon", cc.SMOLLM2_REF, draft="ngram", speculative="{cache: 'off'}"),
        cc.Config("daemon ngram+cache", "daemon", cc.SMOLLM2_REF, draft="ngram"),
    ]


def run_one(srv: cc.Server, text: str, n: int) -> dict[str, Any]:
    """One greedy request of n tokens: the server's own decode rate, drafted/accepted, the text."""
    with httpx.Client(base_url=srv.url, timeout=cc.REQUEST_TIMEOUT_S, trust_env=False) as client:
        if srv.config.kind == "llama-server":
            got = ls.complete(client, text, n)
            return {"tps": got["tps"], "n": got["n"], "drafted": got["draft_n"] or 0,
                    "accepted": got["accepted"] or 0, "text": got["text"]}  # fmt: skip
        body = {"model": cc.MODEL, "prompt": text, "raw": True, "stream": False,
                "options": {"temperature": 0, "num_predict": n}}  # fmt: skip
        r = client.post("/api/generate", json=body)
        r.raise_for_status()
        d = r.json()
        return {"tps": d["eval_count"] / (d["eval_duration"] / 1e9), "n": d["eval_count"],
                "drafted": d.get("draft_tokens", 0), "accepted": d.get("draft_accepted_tokens", 0),
                "text": d["response"]}  # fmt: skip


def markdown(results: dict[str, dict[str, list[dict[str, Any]]]], tokens: int, reps: int) -> str:
    def med(runs: list[dict[str, Any]]) -> float:
        return statistics.median(r["tps"] for r in runs)

    head = "| prompt | " + " | ".join(CONFIGS) + " | ngram+cache / ngram-mod | ngram / ngram-mod |"
    lines = [f"Decode tok/s, median of {reps} (after a warm-up), {tokens} greedy tokens, one stream:", "",
             head, "|" + "---|" * (len(CONFIGS) + 3)]  # fmt: skip
    for prompt, by in results.items():
        rates = {c: med(by[c]) for c in CONFIGS}
        cells = [f"{rates[c]:.1f}" for c in CONFIGS]
        mod = rates["llama-server ngram-mod"]
        lines.append(f"| {prompt} | " + " | ".join(cells)
                     + f" | {rates['daemon ngram+cache'] / mod:.2f} | {rates['daemon ngram'] / mod:.2f} |")
    lines += ["", "Speed-up over each server's own plain rate, and acceptance (accepted / drafted):", "",
              "| prompt | config | speed-up | drafted per request | accepted |", "|---|---|---|---|---|"]
    for prompt, by in results.items():
        for c in CONFIGS[1:]:
            if c.endswith("none"):
                continue
            base = med(by["llama-server none" if c.startswith("llama") else "daemon none"])
            drafted = statistics.median(r["drafted"] for r in by[c])
            acc = sum(r["accepted"] for r in by[c]) / max(1, sum(r["drafted"] for r in by[c]))
            lines.append(f"| {prompt} | {c} | {med(by[c]) / base:.2f} | {drafted:.0f} | {acc:.2f} |")
    same = []
    for prompt, by in results.items():
        ref = by["daemon none"][0]["text"]
        same.append(f"{prompt}: " + ", ".join(
            f"{c} {'=' if all(r['text'] == ref for r in by[c]) else '!='}" for c in CONFIGS if c != "daemon none"))
    lines += ["", "Texts against `daemon none`: " + "; ".join(same)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default="edit,explain")
    ap.add_argument("--json", type=Path, default=ls.OUT / "rounds.json")
    args = ap.parse_args(argv)
    binary = ls.build()
    prompts = {p: chat(TEXTS[p]) for p in args.prompts.split(",")}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {p: {c: [] for c in CONFIGS} for p in prompts}
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(cc.start(cfg, binary, 1, args.threads, "rounds")) for cfg in configs()]
        for prompt, text in prompts.items():
            for srv in servers:
                run_one(srv, text, args.tokens)  # the warm-up: what learns across requests has seen it once
            for rep in range(args.reps):
                order = servers[rep % len(servers):] + servers[: rep % len(servers)]
                for srv in order:
                    got = run_one(srv, text, args.tokens)
                    results[prompt][srv.config.name].append(got)
                    cc._log(f"{prompt} rep {rep}: {srv.config.name} {got['tps']:.1f} tok/s "
                            f"({got['accepted']}/{got['drafted']} accepted)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args) | {"json": str(args.json)}}
    args.json.write_text(json.dumps({**meta, "results": results}, indent=1))
    print(markdown(results, args.tokens, args.reps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
