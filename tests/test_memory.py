"""The memory plan (runtime.memory) on the shapes of published models, as sparse GGUF files.

Each file has the real header and tensor infos (tests/sparse.py, llama.cpp's Q4_K_M type mix) and
its data is a hole, so a 70B target costs a few megabytes of disk. Devices are injected: the GPU
paths run here without a GPU."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sidecar.config.entries import build_entry
from sidecar.config.schema import Pair
from sidecar.runtime.memory import (
    FIT_MARGIN,
    GIB,
    Device,
    Settings,
    Shape,
    gpu_overhead,
    human,
    parse_size,
    place,
    ram_available,
)
from sidecar.runtime.room import max_loaded, pinned, plan_entry
from tests.sparse import GEMMA3_1B, GEMMA3_27B, LLAMA_8B, LLAMA_70B, QWEN_3B, QWEN_72B, Arch, write_model

pytestmark = pytest.mark.pure


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Shape]:
    d = tmp_path_factory.mktemp("sparse")
    models: dict[str, Arch] = {"llama70b": LLAMA_70B, "llama8b": LLAMA_8B, "qwen72b": QWEN_72B, "qwen3b": QWEN_3B,
                               "gemma27b": GEMMA3_27B, "gemma1b": GEMMA3_1B}
    return {name: Shape.from_gguf(write_model(d / f"{name}.gguf", a, name)) for name, a in models.items()}


def gpu(gib: float, name: str = "GPU0") -> Device:
    return Device(name, int(gib * GIB), int(gib * GIB))


# Published Q4_K_M file sizes (bytes, as the model pages list them), which the tensor infos must add up to.
@pytest.mark.parametrize(("name", "published"), [
    ("llama70b", 42.5e9), ("llama8b", 4.92e9), ("qwen3b", 1.93e9), ("gemma27b", 16.5e9),
])
def test_weights_add_up_to_the_published_files(shapes: dict[str, Shape], name: str, published: float) -> None:
    assert shapes[name].weights == pytest.approx(published, rel=0.02)


def test_the_files_are_holes(tmp_path: Path) -> None:
    p = write_model(tmp_path / "70b.gguf", LLAMA_70B, "70b")
    assert p.stat().st_size > 42e9
    assert p.stat().st_blocks * 512 < 64 << 20  # a few MiB on disk


def test_kv_per_token_per_layer(shapes: dict[str, Shape]) -> None:
    """(key + value length) x KV heads x bytes, per cell: Llama-3.1-70B holds 320 KiB a token in f16."""
    t = shapes["llama70b"]
    one = place(t, Settings(4096), None, None, [], 1 << 50).target
    assert one.kv == 80 * 4096 * (128 + 128) * 8 * 2 == int(1.25 * GIB)
    two = place(t, Settings(4096, num_parallel=2), None, None, [], 1 << 50).target
    assert two.kv == 2 * one.kv
    q8 = place(t, Settings(4096, kv_cache_type="q8_0"), None, None, [], 1 << 50).target
    assert q8.kv == pytest.approx(one.kv * 34 / 64)
    # llama.cpp pads each stream to 256 cells: a window of 300 holds 512
    assert place(t, Settings(300), None, None, [], 1 << 50).target.kv == 2 * place(t, Settings(256), None, None,
                                                                                     [], 1 << 50).target.kv


def test_sliding_window_layers_hold_the_whole_window(shapes: dict[str, Shape]) -> None:
    """Gemma-3's sliding-window layers get full-size caches too (llama.cpp's swa_full default)."""
    g = shapes["gemma27b"]
    assert g.kv_layer(0, 32768, 1, "f16") == g.kv_layer(5, 32768, 1, "f16") == 32768 * 256 * 16 * 2


def test_70b_and_8b_on_a_24_gib_card(shapes: dict[str, Shape]) -> None:
    """The seed's pair: the draft wholly on the GPU, then the target's layers that fit, 1 GiB kept."""
    t, d = shapes["llama70b"], shapes["llama8b"]
    plan = place(t, Settings(4096, 2), d, Settings(4096, 2), [gpu(24)], 64 * GIB)
    assert plan.fits and plan.reason == ""
    assert plan.draft is not None and plan.draft.gpu_layers == 33 == plan.draft.layers
    assert 0 < plan.target.gpu_layers < 81
    assert plan.vram <= 24 * GIB - FIT_MARGIN
    # one layer more would not have fit beside the margin
    more = place(t, Settings(4096, 2, num_gpu=plan.target.gpu_layers + 1), d, Settings(4096, 2), [gpu(24)], 64 * GIB)
    assert more.vram > 24 * GIB - FIT_MARGIN
    # Ollama's /api/ps: size the whole load, size_vram its GPU part (a partial offload shows a part)
    assert plan.target.total == plan.target.vram + plan.target.ram
    assert 0 < plan.target.vram < plan.target.total


def test_the_gpu_overhead_is_kept_free_too(shapes: dict[str, Shape]) -> None:
    t, d = shapes["llama70b"], shapes["llama8b"]
    plain = place(t, Settings(4096), d, Settings(4096), [gpu(24)], 64 * GIB)
    less = place(t, Settings(4096), d, Settings(4096), [gpu(24)], 64 * GIB, overhead=4 * GIB)
    assert less.target.gpu_layers < plain.target.gpu_layers
    assert less.vram <= 24 * GIB - FIT_MARGIN - 4 * GIB
    assert gpu_overhead({"OLLAMA_GPU_OVERHEAD": "1073741824"}) == GIB
    assert gpu_overhead({"OLLAMA_GPU_OVERHEAD": "lots"}) == 0


def test_a_draft_that_does_not_fit_leaves_the_target_alone(shapes: dict[str, Shape]) -> None:
    t, d = shapes["qwen72b"], shapes["qwen3b"]
    alone = place(t, Settings(4096), None, None, [gpu(3)], 64 * GIB)
    plan = place(t, Settings(4096), d, Settings(4096), [gpu(3)], 64 * GIB)
    assert plan.draft is not None and plan.draft.gpu_layers == 0
    assert "the target is planned alone" in plan.draft.note
    assert plan.target.gpu_layers == alone.target.gpu_layers > 0


def test_several_gpus_split_the_layers_by_free_memory(shapes: dict[str, Shape]) -> None:
    t = shapes["llama70b"]
    plan = place(t, Settings(4096), None, None, [gpu(48, "GPU0"), gpu(24, "GPU1")], 64 * GIB)
    a, b = plan.target.split
    assert a + b == plan.target.gpu_layers == 81  # 72 GiB hold the whole 70B
    assert a == pytest.approx(2 * b, abs=3)
    half = place(t, Settings(4096), None, None, [gpu(24, "GPU0"), gpu(12, "GPU1")], 64 * GIB)
    a, b = half.target.split
    assert 0 < b < a and a + b == half.target.gpu_layers < 81


def test_an_explicit_num_gpu_wins(shapes: dict[str, Shape]) -> None:
    t, d = shapes["llama70b"], shapes["llama8b"]
    few = place(t, Settings(4096, num_gpu=10), d, Settings(4096, num_gpu=0), [gpu(80)], 64 * GIB)
    assert few.target.gpu_layers == 10
    assert few.draft is not None and few.draft.gpu_layers == 0
    assert few.target.split == (10,)



def test_a_requests_num_gpu_wins_over_the_pairs(tmp_path: Path) -> None:
    """A request's num_gpu (runtime.manager passes Ollama's option) is the target's count in the
    plan, over the pair's `runtime:` one and over the plan's own; -1 leaves it to the pair. The
    draft is placed as before."""
    target = write_model(tmp_path / "70b.gguf", LLAMA_70B, "70b")
    draft = write_model(tmp_path / "8b.gguf", LLAMA_8B, "8b")

    def plan(runtime: dict[str, int], num_gpu: int) -> tuple[int, int]:
        entry = build_entry("p:test", Pair.model_validate({"from": str(target), "draft": str(draft),
                                                           "runtime": runtime}))
        p = plan_entry(entry, 4096, 2, [gpu(24)], 64 * GIB, overhead=0, num_gpu=num_gpu)
        assert p is not None and p.draft is not None
        return p.target.gpu_layers, p.draft.gpu_layers

    fitted, whole = plan({}, -1)
    assert 0 < fitted < 81 and whole == 33
    assert plan({}, 5) == (5, 33)  # fewer than fit
    assert plan({}, 81)[0] == 81  # more than fit: the user's number wins (llama.cpp then says if it cannot)
    assert plan({}, 0) == (0, 33)
    assert plan({"num_gpu": 10}, -1) == (10, 33)  # the pair's
    assert plan({"num_gpu": 10}, 20) == (20, 33)  # the request's, over the pair's
    assert plan({}, 10**9)[0] == 81  # past the model's layers: all of them


def test_cpu_only_refuses_in_ollamas_words(shapes: dict[str, Shape]) -> None:
    t, d = shapes["llama70b"], shapes["llama8b"]
    plan = place(t, Settings(4096), d, Settings(4096), [], 22 * GIB)
    assert not plan.fits
    assert plan.vram == 0 and plan.ram > 42e9
    assert plan.reason == (f"model requires more system memory ({human(plan.ram)}) than is available (22.0 GiB)")
    assert place(d, Settings(4096), None, None, [], 22 * GIB).fits


def test_gemma_pair_fits_a_small_card(shapes: dict[str, Shape]) -> None:
    t, d = shapes["gemma27b"], shapes["gemma1b"]
    plan = place(t, Settings(8192), d, Settings(8192), [gpu(24)], 32 * GIB)
    assert plan.fits and plan.draft is not None and plan.draft.gpu_layers == 27
    assert plan.target.gpu_layers == 63  # 16.5 GB of weights and a windowed cache fit in 23 GiB


def test_sizes_and_env() -> None:
    assert parse_size("24GiB") == parse_size("24 GB") == 24 * GIB
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError):
        parse_size("a lot")
    assert human(int(37.6 * GIB)) == "37.6 GiB" and human(5 << 20) == "5.0 MiB" and human(12) == "12 B"
    assert max_loaded(0, {}) == 3 and max_loaded(2, {}) == 6 and max_loaded(1, {"OLLAMA_MAX_LOADED_MODELS": "1"}) == 1
    assert ram_available() > 0
    assert ram_available("/nonexistent") == 0


def test_pinned_models_are_those_kept_forever() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert pinned("2318-08-27T00:00:00.000000+00:00", now)
    assert not pinned((now + timedelta(minutes=5)).isoformat(), now)
    assert not pinned("not a time", now)
