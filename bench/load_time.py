"""What a load costs: cold (nothing cached), cached (a restart), and cold on a machine whose cores
other processes keep busy, side by side for an n-gram pair and a model-draft pair.

Each load is a fresh Runtime (a restart) on a cache directory of its own (cold) or the one a cold
load filled (cached). `load` is what a request's load_duration reports; `measuring` the part spent
timing the verify curve and the draft; `weights` the rest (mapping the GGUF, creating contexts).

    .venv/bin/python bench/load_time.py [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_spec import OUT, ensure_models  # noqa: E402
from derive_models import smollm2_path  # noqa: E402

from sidecar.config.entries import build_entry  # noqa: E402
from sidecar.config.loader import parse  # noqa: E402
from sidecar.runtime.llamacpp import LlamaEngine  # noqa: E402
from sidecar.runtime.llamacpp.curves import CurveCache  # noqa: E402
from sidecar.runtime.manager import Runtime  # noqa: E402


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


@contextmanager
def busy() -> Iterator[None]:
    """Two spinning processes per core for the block's duration."""
    stop = multiprocessing.Event()
    procs = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(2 * (os.cpu_count() or 1))]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(5)


async def load_once(name: str, target: str, draft: str, cache: Path) -> tuple[float, float, str]:
    yaml = (f"pairs:\n  {name}:\n    from: {target}\n    draft: {draft}\n"
            "    runtime:\n      num_thread: 2\n      num_gpu: 0\n    parameters:\n      num_ctx: 2048\n")
    entry = build_entry(name, parse(yaml).pairs[name])
    rt = Runtime(LlamaEngine(CurveCache(cache)), keep_alive=-1)
    rt.set_entries({entry.name: entry})
    t0 = time.perf_counter()
    lm, seconds = await rt.load(entry)
    assert abs(seconds - (time.perf_counter() - t0)) < 0.05
    target = lm.calibrated.calibration_seconds if lm.curve != "cached" and lm.calibrated else 0.0
    measuring = target + lm.pairs[name].cost.calibration_seconds  # the draft's
    await rt.unload_all()
    return seconds, measuring, lm.curve or "-"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ensure_models(OUT)
    smol = str(smollm2_path())
    pairs = {"a (SmolLM2 + n-gram)": (smol, "ngram"),
             "c (SmolLM2 + 8-layer draft)": (smol, str(OUT / "smollm2-trunc8.gguf"))}
    print(f"# load_time: median of {args.reps}, 2 threads, num_ctx 2048\n")
    print("| pair | case | load (load_duration) s | measuring s | weights and contexts s | curve |")
    print("|---|---|---|---|---|---|")
    for label, (target, draft) in pairs.items():
        rows: dict[str, list[tuple[float, float, str]]] = {"cold": [], "cached": [], "cold, every core busy": []}
        for rep in range(args.reps):
            with tempfile.TemporaryDirectory() as d:
                cache = Path(d)
                rows["cold"].append(await load_once(f"l:{rep}", target, draft, cache))
                rows["cached"].append(await load_once(f"l:{rep}", target, draft, cache))
            with tempfile.TemporaryDirectory() as d, busy():
                rows["cold, every core busy"].append(await load_once(f"l:{rep}", target, draft, Path(d)))
        for case, runs in rows.items():
            load = statistics.median(r[0] for r in runs)
            meas = statistics.median(r[1] for r in runs)
            curves = "/".join(sorted({r[2] for r in runs}))
            print(f"| {label} | {case} | {load:.2f} | {meas:.2f} | {load - meas:.2f} | {curves} |")


if __name__ == "__main__":
    asyncio.run(main())
