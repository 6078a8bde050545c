"""The context window: prompt truncation (Ollama's) and context shifts (llama-server's), lossless under speculation.

Real llama.cpp on tiny generated models that never end their output, with a 256-token window (the
smallest llama.cpp makes), so a few hundred tokens go through several shifts; SmolLM2 once, on the
CPU, for a real model's kernels. Speculative output must equal target-only output token for token
through the shifts, with every drafter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llama_cpp as C
import numpy as np
import pytest

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.cost import CostModel
from sidecar.engine.decoder import Decoder, PromptTooLong, Request, Result
from sidecar.engine.drafters import Drafter, ModelDrafter, NgramDrafter
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.sampling import SamplingParams
from sidecar.engine.suffix import SuffixCache, SuffixDrafter
from sidecar.engine.window import prompt_limit, shift_span, truncate_prompt
from tests.models import write_tiny_llama, write_tiny_pair

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0)
WINDOW = ContextParams(n_ctx=256, n_threads=1)
F32_CACHE = ContextParams(n_ctx=256, n_threads=1, type_k=0, type_v=0)  # ggml type 0 = F32


def run(ctx: Context, drafter: Drafter | None, prompt: list[int], n: int, params: SamplingParams = GREEDY,
        **kw: object) -> Result:
    """A request on a cleared context, drafting 6 tokens every round (no cost model in the way)."""
    ctx.clear()
    config = SpeculativeConfig(n_max=6, p_min=0.0, min_predict=0, adaptive=False)
    out = list(Decoder(ctx, drafter, config, CostModel(7)).generate(Request(prompt, params, num_predict=n, **kw)))
    result = out[-1]
    assert isinstance(result, Result)
    return result


@pytest.fixture(scope="module")
def endless(tiny_endless: Path) -> Iterator[tuple[Weights, Context]]:
    w = Weights(tiny_endless, n_gpu_layers=0)
    ctx = Context(w, WINDOW)
    yield w, ctx
    ctx.close()
    w.close()


@pytest.fixture(scope="module")
def endless_pair(model_dir: Path) -> Iterator[tuple[Weights, Context, Context]]:
    """The tiny pair with end-of-generation unreachable: target weights, target context, draft context."""
    target, draft = write_tiny_pair(model_dir / "endless-pair", seed=2, end_bias=0.0)
    tw, dw = Weights(target, n_gpu_layers=0), Weights(draft, n_gpu_layers=0)
    ctx, dctx = Context(tw, WINDOW), Context(dw, WINDOW)
    yield tw, ctx, dctx
    for x in (dctx, ctx, dw, tw):
        x.close()


def text_prompt(w: Weights, text: str) -> list[int]:
    return w.tokenize(text, add_special=True, parse_special=False)


# -- the arithmetic -------------------------------------------------------------------------------


def test_prompt_limit_is_ollamas() -> None:
    # llm/llama_server_test.go TestContextShiftPromptLimit
    for n_ctx, n_keep, want in ((8, 3, 6), (4096, 4, 2050), (4096, 5, 2051), (8, 99, 7), (8, -1, 4), (1, 0, 0)):
        assert prompt_limit(n_ctx, n_keep) == want, (n_ctx, n_keep)


def test_truncate_prompt_keeps_the_head_and_the_tail() -> None:
    tokens = list(range(10))
    # Ollama's own example: num_ctx 8, num_keep 3, no BOS -> [0 1 2 7 8 9].
    assert truncate_prompt(tokens, 8, 3, add_bos=False) == [0, 1, 2, 7, 8, 9]
    # A BOS adds one kept token: limit 8 - (8 - 4) // 2 = 6.
    assert truncate_prompt(tokens, 8, 3, add_bos=True) == [0, 1, 2, 3, 8, 9]
    # -1 keeps the whole prompt, capped at n_ctx - 1: the head alone.
    assert truncate_prompt(tokens, 8, -1, add_bos=True) == list(range(7))
    assert truncate_prompt(tokens[:7], 8, 3, add_bos=True) == list(range(7))  # fits: unchanged


def test_shift_span_is_llama_servers() -> None:
    # n_keep = num_keep + 1 (BOS), discard = (n_past - n_keep) // 2
    assert shift_span(256, 256, 4, 30, add_bos=True) == (5, 125)
    assert shift_span(256, 256, 4, 30, add_bos=False) == (4, 126)
    # -1 keeps the prompt (+1 for the BOS, as llama-server counts it), at most n_ctx - 4.
    assert shift_span(256, 256, -1, 30, add_bos=True) == (31, 112)
    assert shift_span(256, 256, -1, 300, add_bos=True) == (252, 2)


# -- Context.shift ---------------------------------------------------------------------------------


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


@pytest.fixture(scope="module")
def one_layer(model_dir: Path) -> Iterator[Weights]:
    """One layer: its keys and values depend on the token and its position only, so a shifted cache
    should score like a fresh prefill of the shifted tokens. With more layers it does not, by design:
    a kept token's deeper keys and values were computed while the dropped ones were still there
    (llama-server's shift has the same property)."""
    w = Weights(write_tiny_llama(model_dir / "one-layer.gguf", seed=1, n_layer=1), n_gpu_layers=0)
    yield w
    w.close()


def shifted_and_fresh(w: Weights, params: ContextParams, can_shift: bool = True) -> tuple[Context, np.ndarray,
                                                                                           np.ndarray, bool]:
    rng = np.random.default_rng(0)
    tokens = [1, *(int(t) for t in rng.integers(3, 259, 200))]
    keep, discard = 5, 97
    expected = tokens[:keep] + tokens[keep + discard :]
    ctx, fresh = Context(w, params), Context(w, params)
    ctx.can_shift = can_shift
    ctx.prefill(tokens)
    in_place = ctx.shift(keep, discard)
    assert ctx.tokens == expected
    assert C.llama_memory_seq_pos_max(ctx.memory, 0) == len(expected) - 1
    fresh.prefill(expected)
    assert fresh.tokens == ctx.tokens
    a, b = ctx.decode([42])[0], fresh.decode([42])[0]
    fresh.close()
    return ctx, a, b, in_place


def test_shift_scores_like_a_fresh_prefill(one_layer: Weights) -> None:
    """How close: with an F32 cache the moved keys differ from freshly computed ones by the float
    rounding of the second rotation (measured ~2e-5 on logits of magnitude ~16); with the default F16
    cache the rotated keys are rounded to F16 again (measured ~0.05)."""
    for params, tol in ((F32_CACHE, 1e-3), (WINDOW, 0.25)):
        ctx, a, b, in_place = shifted_and_fresh(one_layer, params)
        assert in_place and ctx.fresh == 5  # the entries after the cut were computed before it
        assert np.abs(log_softmax(a) - log_softmax(b)).max() < tol
        assert not np.array_equal(a, b)  # a real in-place shift, not a re-prefill
        ctx.close()


def test_shift_rebuilds_memory_that_cannot_move(one_layer: Weights) -> None:
    ctx, a, b, in_place = shifted_and_fresh(one_layer, WINDOW, can_shift=False)
    assert not in_place and ctx.fresh == len(ctx.tokens)
    assert np.array_equal(a, b)  # it is a fresh prefill
    ctx.close()


def test_model_drafter_shifts_its_cache_or_drops_the_stale_part(endless_pair: tuple[Weights, Context, Context]) -> None:
    _, _, dctx = endless_pair
    context = list(range(3, 203))
    drafter = ModelDrafter(dctx)
    dctx.clear()
    dctx.prefill(context[:-1])  # caught up: the cache moves with the context
    drafter.shift(context, 5, 97)
    assert dctx.tokens == context[:5] + context[102:-1] and dctx.fresh == 5
    dctx.clear()
    dctx.prefill(context[:60])  # behind the cut: only the kept head stays
    drafter.shift(context, 5, 97)
    assert dctx.tokens == context[:5]


# -- generation ------------------------------------------------------------------------------------


def test_target_only_runs_past_the_window(endless: tuple[Weights, Context]) -> None:
    w, ctx = endless
    prompt = text_prompt(w, "a prompt that will not be the end of it")
    stopped = run(ctx, None, prompt, 800)
    assert stopped.done_reason == "length" and stopped.shifts == 0
    assert len(prompt) + len(stopped.tokens) == ctx.n_ctx + 1  # the last token is never scored
    shifted = run(ctx, None, prompt, 800, shift=True)
    assert shifted.done_reason == "length" and len(shifted.tokens) == 800
    assert shifted.shifts >= 4
    assert shifted.tokens[: len(stopped.tokens)] == stopped.tokens  # the same until the first shift
    # num_predict -2 fills one window, shift or not.
    filled = run(ctx, None, prompt, -2, shift=True)
    assert filled.done_reason == "length" and filled.tokens == stopped.tokens and filled.shifts == 0


@pytest.mark.parametrize("kind", ["ngram", "suffix", "model"])
def test_greedy_speculation_is_lossless_across_shifts(kind: str, endless: tuple[Weights, Context],
                                                      endless_pair: tuple[Weights, Context, Context]) -> None:
    if kind == "model":
        w, ctx, dctx = endless_pair
    else:
        w, ctx = endless
    prompt = text_prompt(w, f"speculate through the shifts with {kind} drafts")
    plain = run(ctx, None, prompt, 700, shift=True)
    drafter: Drafter
    if kind == "ngram":
        drafter = NgramDrafter(1, 3)
    elif kind == "suffix":
        cache = SuffixCache(capacity=10_000)
        cache.add(prompt + plain.tokens[:300])  # right early on, then a guess from elsewhere in it
        drafter = SuffixDrafter(cache)
    else:
        drafter = ModelDrafter(dctx)
    spec = run(ctx, drafter, prompt, 700, shift=True)
    assert plain.shifts >= 3 and spec.shifts == plain.shifts
    assert spec.draft_rounds > 0 and 0 < spec.draft_accepted_tokens < spec.draft_tokens
    assert spec.tokens == plain.tokens, f"{kind}: diverged at token " + str(
        next(i for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens, strict=False)) if a != b))
    if kind == "model":  # it drafted every round, so its cache was caught up and shifted in place
        assert dctx.fresh < len(dctx.tokens)


def test_smollm2_ngram_lossless_across_shifts(smollm2: Path) -> None:
    w = Weights(smollm2, n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=256))
    try:
        prompt = w.tokenize("<|im_start|>user\nTell me a long story about a lighthouse.<|im_end|>\n"
                            "<|im_start|>assistant\n", add_special=False, parse_special=True)
        plain = run(ctx, None, prompt, 480, shift=True)
        spec = run(ctx, NgramDrafter(2, 4), prompt, 480, shift=True)
        assert plain.shifts >= 2 and spec.draft_accepted_tokens > 0  # (it ends its story after two)
        assert spec.tokens == plain.tokens and spec.done_reason == plain.done_reason
    finally:
        ctx.close()
        w.close()


def test_sampled_runs_go_through_shifts(endless: tuple[Weights, Context]) -> None:
    w, ctx = endless
    prompt = text_prompt(w, "sample me")
    params = SamplingParams(temperature=0.8, seed=7)
    first = run(ctx, None, prompt, 600, params, shift=True)
    assert first.done_reason == "length" and len(first.tokens) == 600 and first.shifts >= 3
    assert run(ctx, None, prompt, 600, params, shift=True).tokens == first.tokens  # a seed reproduces it
    spec = run(ctx, NgramDrafter(1, 3), prompt, 600, params, shift=True)
    assert spec.done_reason == "length" and len(spec.tokens) == 600 and spec.shifts == first.shifts


def test_penalties_look_back_over_shifted_tokens(endless: tuple[Weights, Context]) -> None:
    """A repeat penalty covers the last repeat_last_n committed tokens, shifted out or not, as
    llama-server's sampler history does; speculation sees the same history."""
    w, ctx = endless
    prompt = text_prompt(w, "penalise repeats")
    params = SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=200)
    plain = run(ctx, None, prompt, 500, params, shift=True)
    spec = run(ctx, NgramDrafter(1, 3), prompt, 500, params, shift=True)
    assert plain.shifts >= 2 and spec.tokens == plain.tokens


def test_a_new_request_reuses_only_the_unshifted_prefix(endless: tuple[Weights, Context]) -> None:
    """Cache entries after a shift were computed with the dropped tokens still there, so a prompt that
    happens to match them is decoded afresh: its output does not depend on what ran before."""
    w, ctx = endless
    run(ctx, None, text_prompt(w, "fill and shift"), 400, shift=True)
    assert ctx.fresh < len(ctx.tokens)
    follow_up = ctx.tokens[:200]
    after_shift = list(Decoder(ctx).generate(Request(follow_up, GREEDY, num_predict=20)))[-1]
    assert isinstance(after_shift, Result)
    assert after_shift.tokens == run(ctx, None, follow_up, 20).tokens


# -- prompt truncation -----------------------------------------------------------------------------


def test_a_long_prompt_is_truncated_like_ollama(endless: tuple[Weights, Context]) -> None:
    _, ctx = endless
    rng = np.random.default_rng(3)
    prompt = [1, *(int(t) for t in rng.integers(40, 120, 299))]  # 300 tokens, BOS first
    with pytest.raises(PromptTooLong):
        run(ctx, None, prompt, 8)
    # n_keep = 4 + 1 (BOS), limit = 256 - (256 - 5) // 2 = 131: drop the 169 tokens after the head.
    used = prompt[:5] + prompt[174:]
    r = run(ctx, None, prompt, 8, truncate=True)
    assert (r.prompt_tokens, r.prompt_truncated) == (131, 169)
    assert ctx.tokens[:130] == used[:-1] and ctx.tokens[130] == used[-1]
    assert r.tokens == run(ctx, None, used, 8).tokens
    # num_keep -1 keeps the head alone: the first n_ctx - 1 tokens.
    r = run(ctx, None, prompt, 8, truncate=True, num_keep=-1)
    assert (r.prompt_tokens, r.prompt_truncated) == (255, 45)
    assert ctx.tokens[:255] == prompt[:255]
