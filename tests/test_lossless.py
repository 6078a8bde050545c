"""Speculative decoding changes speed, never output: proven on real llama.cpp inference.

Greedy: token-for-token identical to target-only decoding, for tiny generated pairs and for the
real SmolLM2 with the n-gram drafter and with a model drafter. Sampling: the first tokens have the
same distribution. The equality is exact (no similarity threshold); it holds because the CPU build
has llamafile's sgemm and AMX off and flash attention off (see README, "Losslessness"). The models stay on
the CPU even in a GPU build: CUDA's kernels give a token different logits alone and inside a batch
(bench/batch_invariance.py), so there the outputs can part at a near-tie.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.backend import system_info
from sidecar.engine.cost import CostModel
from sidecar.engine.decoder import Decoder, Request, Result
from sidecar.engine.drafters import Drafter, ModelDrafter, NgramDrafter
from sidecar.engine.kernels import build_warnings, file_type, repack_is_exact
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.sampling import SamplingParams
from tests.stats import chi_square_same_distribution

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from derive_models import extend

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0)

TOPICS = [
    "Write a short poem about the sea.", "Explain what a hash map is.", "List five fruits and their colours.",
    "Write a Python function that reverses a string.", "What is the capital of France? Explain its history.",
    "Describe how a bicycle works.", "Give me three tips for learning to cook.", "Summarise the plot of Hamlet.",
    "Write a haiku about autumn leaves.", "How do vaccines work?", "Explain recursion to a child.",
    "Write a SQL query that counts users per country.", "What causes rain?", "Describe a sunset over mountains.",
    "Write a limerick about a cat.", "Why is the sky blue?", "Explain the difference between TCP and UDP.",
    "Write a JavaScript function that sums an array.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "Copy this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes.",
]


def chat_prompt(weights: Weights, text: str) -> list[int]:
    return weights.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                            add_special=False, parse_special=True)


def always_speculate(n_max: int) -> tuple[SpeculativeConfig, CostModel]:
    """Fixed draft length, no fallback: every round drafts n_max, whatever it costs here."""
    return SpeculativeConfig(n_max=n_max, p_min=0.0, min_predict=0, adaptive=False), CostModel(n_max + 1)


def run(ctx: Context, drafter: Drafter | None, prompt: list[int], n: int, params: SamplingParams = GREEDY,
        n_max: int = 6) -> Result:
    ctx.clear()
    config, cost = always_speculate(n_max)
    out = list(Decoder(ctx, drafter, config, cost).generate(Request(prompt, params, num_predict=n)))
    result = out[-1]
    assert isinstance(result, Result)
    return result


@pytest.fixture(scope="module")
def smol(smollm2: Path) -> Iterator[tuple[Weights, Context]]:
    w = Weights(smollm2, n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=1024))
    yield w, ctx
    ctx.close()
    w.close()


@pytest.fixture(scope="module")
def smol_draft(smollm2: Path, model_dir: Path) -> Iterator[Context]:
    """SmolLM2 plus two added layers, one of them perturbing its output: agrees with SmolLM2 most of
    the time (~87%), not always, so acceptance and rollback both get exercised."""
    path = model_dir / "smollm2-perturbed.gguf"
    if not path.exists():
        extend(smollm2, path, extra_layers=2, eps=0.0, eps_layers={1: 0.75})
    w = Weights(path, n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=1024))
    yield ctx
    ctx.close()
    w.close()


def assert_same(plain: Result, spec: Result, label: str) -> None:
    assert spec.draft_rounds > 0, f"{label}: speculation never ran"
    if spec.tokens != plain.tokens:
        pairs = zip(plain.tokens, spec.tokens, strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(plain.tokens), len(spec.tokens)))
        raise AssertionError(f"{label}: speculative output diverged from target-only at token {first}")


@pytest.fixture(scope="module")
def smol_plain(smol: tuple[Weights, Context]) -> dict[str, Result]:
    """Target-only greedy outputs, computed once for both drafters."""
    w, ctx = smol
    return {text: run(ctx, None, chat_prompt(w, text), 128) for text in TOPICS}


def test_build_warnings_name_the_batch_only_kernels() -> None:
    info = "CPU : SSE3 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | LLAMAFILE = 0 | OPENMP = 1 | REPACK = 1 |"
    [amx] = build_warnings(info)
    assert "AMX-INT8 (AMX_INT8 = 1)" in amx and "make rebuild-llama" in amx
    assert len(build_warnings("CUDA : ARCHS = 900 | CPU : LLAMAFILE = 1 | AMX_INT8 = 1 |")) == 2
    assert build_warnings("CPU : SSE3 = 1 | AVX2 = 1 | OPENMP = 1 |") == []


def test_repack_is_kept_off_k_quants_and_iq_types_only() -> None:
    assert repack_is_exact("Q4_0") and repack_is_exact("Q4_1") and repack_is_exact("Q8_0") and repack_is_exact(None)
    assert not any(repack_is_exact(t) for t in ("Q4_K_M", "Q6_K", "Q2_K_S", "IQ4_XS", "IQ4_NL"))


def test_a_k_quant_scores_a_token_alone_as_inside_a_batch(smollm2: Path, tmp_path: Path) -> None:
    """SmolLM2 requantized to Q4_K_M (Ollama's usual type) on the CPU: ggml's repacked Q4_K kernel
    (from 4 rows) and its tiled K-quant kernel (from 8) scored a batch differently, by up to 1.01 with
    another argmax, until engine.kernels kept them off. Nine tokens one at a time, then in one batch."""
    import ctypes

    import llama_cpp

    out = tmp_path / "smollm2-q4_k_m.gguf"
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, True, 2
    assert llama_cpp.llama_model_quantize(str(smollm2).encode(), str(out).encode(), ctypes.byref(p)) == 0
    assert file_type(out) == "Q4_K_M" and file_type(smollm2) == "Q4_1"  # as every Weights reads it
    assert file_type(tmp_path / "absent.gguf") is None  # the load itself then says why
    w = Weights(out, n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=256, n_batch=64))
    try:
        prefix = w.tokenize("The history of the bicycle", add_special=False, parse_special=False)
        batch = list(range(300, 309))
        for kv in (prefix, prefix * 8):
            ctx.clear()
            ctx.prefill(kv)
            alone = np.stack([ctx.decode([t])[0] for t in batch])
            ctx.truncate(len(kv))
            assert np.array_equal(alone, ctx.decode(batch))
    finally:
        ctx.close()
        w.close()


def test_the_suite_runs_on_a_build_without_batch_only_kernels() -> None:
    """What the equality tests below need of the build (the Makefile's CMAKE_ARGS, scripts/backend.sh):
    on a CPU with AMX, a native build without -mno-amx-int8 scores batches with AMX."""
    assert build_warnings(system_info()) == []


def test_smollm2_ngram_greedy_identical(smol: tuple[Weights, Context], smol_plain: dict[str, Result]) -> None:
    w, ctx = smol
    accepted = 0
    for text in TOPICS:
        prompt = chat_prompt(w, text)
        plain = smol_plain[text]
        spec = run(ctx, NgramDrafter(2, 4), prompt, 128, n_max=4)
        assert_same(plain, spec, text)
        accepted += spec.draft_accepted_tokens
    assert accepted > 100, "the n-gram drafter should have been right sometimes"


def test_smollm2_model_draft_greedy_identical(smol: tuple[Weights, Context], smol_draft: Context,
                                              smol_plain: dict[str, Result]) -> None:
    w, ctx = smol
    drafted = accepted = 0
    for text in TOPICS:
        prompt = chat_prompt(w, text)
        plain = smol_plain[text]
        spec = run(ctx, ModelDrafter(smol_draft), prompt, 128, n_max=3)
        assert_same(plain, spec, text)
        drafted += spec.draft_tokens
        accepted += spec.draft_accepted_tokens
    assert 0 < accepted < drafted, "the draft should be accepted sometimes and rejected sometimes"


def test_tiny_pair_greedy_identical(tiny_engines: tuple[Weights, Context, Context]) -> None:
    w, ctx, dctx = tiny_engines
    rng = np.random.default_rng(0)
    for i in range(24):
        prompt = w.tokenize(f"prompt {i}: " + "".join(chr(c) for c in rng.integers(97, 123, 20)),
                            add_special=True, parse_special=False)
        plain = run(ctx, None, prompt, 128)
        for drafter in (ModelDrafter(dctx), NgramDrafter(1, 3)):
            spec = run(ctx, drafter, prompt, 128)
            assert spec.tokens == plain.tokens, f"prompt {i} with {drafter.name}"


def test_kv_cache_consistent_after_speculation(smol: tuple[Weights, Context], smol_draft: Context) -> None:
    """After many accept/reject rounds the target's cache equals a fresh evaluation of the same tokens."""
    w, ctx = smol
    prompt = chat_prompt(w, TOPICS[0])
    spec = run(ctx, ModelDrafter(smol_draft), prompt, 200, n_max=4)
    assert spec.draft_accepted_tokens < spec.draft_tokens  # rejections happened and were rolled back
    seq = prompt + spec.tokens
    assert ctx.tokens[: len(seq) - 1] == seq[:-1]
    ctx.truncate(len(seq) - 1)
    after_spec = ctx.decode([seq[-1]])[0]
    # Fresh: the same tokens, scored one by one as plain decoding would.
    ctx.clear()
    ctx.prefill(prompt[:-1])
    for tok in seq[len(prompt) - 1 :]:
        fresh = ctx.decode([tok])[0]
    assert np.array_equal(after_spec, fresh)


def first_tokens(ctx: Context, drafter: Drafter | None, prompt: list[int], n: int, seeds: range) -> Counter:
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0)
    counts: Counter = Counter()
    for seed in seeds:
        r = run(ctx, drafter, prompt, n, SamplingParams(**{**params.__dict__, "seed": seed}), n_max=3)
        counts[tuple(r.tokens[:n])] += 1
    return counts


def test_sampled_distribution_matches_target(tiny_engines: tuple[Weights, Context, Context]) -> None:
    """At temperature 0.8 the first two tokens are distributed as without speculation."""
    w, ctx, dctx = tiny_engines
    prompt = w.tokenize("the distribution test", add_special=True, parse_special=False)
    plain = first_tokens(ctx, None, prompt, 2, range(0, 1500))
    spec = first_tokens(ctx, ModelDrafter(dctx), prompt, 2, range(10_000, 11_500))
    ngram = first_tokens(ctx, NgramDrafter(1, 2), prompt, 2, range(20_000, 21_500))
    assert chi_square_same_distribution(plain, spec) > 1e-3
    assert chi_square_same_distribution(plain, ngram) > 1e-3
