"""Logprobs: the target's log probabilities of what it emitted, the same with and without speculation.

Exact equality on the CPU build, on SmolLM2 (its 49k vocabulary, n-gram drafts and a perfect model
draft, SmolLM2 drafting for itself) and on the tiny pair (a model draft that is often wrong).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.cost import CostModel
from sidecar.engine.decoder import Decoder, Request, Result
from sidecar.engine.drafters import Drafter, ModelDrafter, NgramDrafter
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.logprobs import Logprobs, TokenLogprob
from sidecar.engine.sampling import SamplingParams

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0)


def generate(ctx: Context, drafter: Drafter | None, prompt: list[int], n: int, params: SamplingParams = GREEDY,
             **kw: object) -> list[object]:
    ctx.clear()
    config = SpeculativeConfig(n_max=4, p_min=0.0, min_predict=0, adaptive=False)
    request = Request(prompt, params, num_predict=n, **kw)  # type: ignore[arg-type]
    return list(Decoder(ctx, drafter, config, CostModel(5)).generate(request))


def entries(items: list[object]) -> list[TokenLogprob]:
    return [e for it in items if isinstance(it, Logprobs) for e in it.entries]


def result(items: list[object]) -> Result:
    assert isinstance(items[-1], Result)
    return items[-1]


def chat(w: Weights, text: str) -> list[int]:
    return w.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                      add_special=False, parse_special=True)


def check_shape(items: list[object], n_top: int) -> None:
    """One entry per emitted token, each before the text it produced, alternatives best first."""
    got = entries(items)
    assert [e.id for e in got] == result(items).tokens
    described = b""
    shown = ""
    for it in items:
        if isinstance(it, Logprobs):
            described += b"".join(e.bytes for e in it.entries)
        elif isinstance(it, str):
            shown += it
            assert described.decode("utf-8", "replace").startswith(shown)
    for e in got:
        assert len(e.top) == n_top and e.logprob <= 0.0
        assert e.token == e.bytes.decode("utf-8", "replace")
        lps = [t.logprob for t in e.top]
        assert lps == sorted(lps, reverse=True)
        assert sum(np.exp(lps)) <= 1.0 + 1e-9


def test_smollm2_logprobs_do_not_depend_on_the_drafter(smollm2_engines: tuple[Weights, Context, Context]) -> None:
    w, ctx, dctx = smollm2_engines
    accepted = {"ngram": 0, "model": 0}
    for text in ("Copy this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes.",
                 "Write a Python function that reverses a string."):
        prompt = chat(w, text)
        plain = generate(ctx, None, prompt, 64, logprobs=3)
        check_shape(plain, 3)
        for e in entries(plain):  # greedy: the emitted token is the most likely one
            assert e.logprob == e.top[0].logprob and e.bytes == e.top[0].bytes
        for drafter in (NgramDrafter(2, 4), ModelDrafter(dctx)):
            spec = generate(ctx, drafter, prompt, 64, logprobs=3)
            accepted[drafter.name] += result(spec).draft_accepted_tokens
            assert entries(spec) == entries(plain), drafter.name
    assert all(accepted.values()), accepted


def test_logprobs_are_the_raw_logits_log_softmax(smollm2_engines: tuple[Weights, Context, Context]) -> None:
    """Of the target's raw logits, before penalties shape them (llama-server, post_sampling_probs off)."""
    w, ctx, _ = smollm2_engines
    prompt = chat(w, "Say hello.")
    params = SamplingParams(temperature=0.0, repeat_penalty=1.5)
    first = entries(generate(ctx, None, prompt, 2, logprobs=5, params=params))[0]
    ctx.clear()
    ctx.prefill(prompt[:-1])
    row = ctx.decode([prompt[-1]])[0].astype(np.float64)
    lsm = row - row.max() - np.log(np.exp(row - row.max()).sum())
    assert first.logprob == pytest.approx(lsm[first.id], abs=1e-9)
    best = np.argsort(-lsm, kind="stable")[:5]
    assert [t.logprob for t in first.top] == pytest.approx(lsm[best].tolist(), abs=1e-9)
    assert [t.bytes for t in first.top] == [w.piece(int(i)) for i in best]


def test_tiny_pair_logprobs_under_model_drafts(tiny_engines: tuple[Weights, Context, Context]) -> None:
    w, ctx, dctx = tiny_engines
    rng = np.random.default_rng(1)
    for i in range(6):
        prompt = w.tokenize(f"logprobs {i}: " + "".join(chr(c) for c in rng.integers(97, 123, 16)),
                            add_special=True, parse_special=False)
        plain = generate(ctx, None, prompt, 96, logprobs=2)
        check_shape(plain, 2)
        for drafter in (ModelDrafter(dctx), NgramDrafter(1, 3)):
            spec = generate(ctx, drafter, prompt, 96, logprobs=2)
            assert entries(spec) == entries(plain), (i, drafter.name)


def test_zero_alternatives_and_off(tiny_engines: tuple[Weights, Context, Context]) -> None:
    w, ctx, dctx = tiny_engines
    prompt = w.tokenize("no alternatives", add_special=True, parse_special=False)
    zero = generate(ctx, ModelDrafter(dctx), prompt, 40, logprobs=0)
    check_shape(zero, 0)
    off = generate(ctx, ModelDrafter(dctx), prompt, 40)
    assert not any(isinstance(it, Logprobs) for it in off)  # existing consumers see str and Result only
    assert result(off).tokens == result(zero).tokens


def test_entries_cover_tokens_cut_by_a_stop_string(tiny_engines: tuple[Weights, Context, Context]) -> None:
    w, ctx, _ = tiny_engines
    prompt = w.tokenize("stop somewhere", add_special=True, parse_special=False)
    text = "".join(it for it in generate(ctx, None, prompt, 40) if isinstance(it, str))
    stop = text[10:13]
    items = generate(ctx, NgramDrafter(1, 3), prompt, 40, logprobs=1, stop=[stop])
    assert result(items).done_reason == "stop"
    assert [e.id for e in entries(items)] == result(items).tokens


def test_logprobs_through_a_context_shift(tiny_endless: Path) -> None:
    w = Weights(tiny_endless, n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=256, n_threads=1))
    try:
        prompt = w.tokenize("through the shift", add_special=True, parse_special=False)
        plain = generate(ctx, None, prompt, 400, logprobs=1, shift=True)
        spec = generate(ctx, NgramDrafter(1, 3), prompt, 400, logprobs=1, shift=True)
        assert result(plain).shifts >= 2
        assert len(entries(plain)) == 400 and entries(spec) == entries(plain)
    finally:
        ctx.close()
        w.close()
