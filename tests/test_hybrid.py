"""Hybrid drafting: several sources behind one drafter, the step's schedule picking one per round.

On real llama.cpp: the tiny pair (target and an ~80% agreeing draft), SmolLM2 (copying an edit, telling a
story) and the suffix cache. Greedy output must equal target-only token for token whatever source
drafts.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.cost import CostModel
from sidecar.engine.decoder import Decoder, Request, Result
from sidecar.engine.drafters import Drafter, ModelDrafter, NgramDrafter, Proposal, Support
from sidecar.engine.grammar import Grammar
from sidecar.engine.hybrid import HybridDrafter
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.sampling import SamplingParams
from sidecar.engine.suffix import SuffixCache, SuffixDrafter
from tests.models import write_tiny_pair
from tests.prices import Fixed
from tests.stats import chi_square_same_distribution

pytestmark = pytest.mark.model

INF = math.inf
GREEDY = SamplingParams(temperature=0.0)
FLAT = [1.0 + 0.02 * i for i in range(13)]  # seconds per 1..13 rows: verifying is nearly free


def fixed(t_step: Sequence[float] = FLAT, t_draft: float = 0.3) -> Fixed:
    """A machine where verifying is cheap and a model's draft step costs 0.3 target steps."""
    cost = Fixed(len(t_step))
    cost.t_step = [0.0, *t_step]
    cost.t_draft, cost.t_catchup = t_draft, 0.01
    return cost


class Counted:
    """A drafter that counts its proposals (the planner calls a model's only when it drafts), and
    with `halve` proposes only the first half of what it was asked for."""

    def __init__(self, inner: Drafter, halve: bool = False) -> None:
        self.inner = inner
        self.name, self.has_cost = inner.name, inner.has_cost
        self.halve = halve
        self.calls: list[int] = []  # the context's length at each proposal

    def begin(self, sampler: object) -> None:
        self.inner.begin(sampler)  # type: ignore[arg-type]

    def propose(self, context: Sequence[int], max_tokens: int, grammar: Grammar | None = None) -> Proposal:
        if max_tokens:  # not the planner's look, which drafts nothing
            self.calls.append(len(context))
        proposal = self.inner.propose(context, max_tokens, grammar)
        if self.halve:
            proposal.tokens = proposal.tokens[: (max_tokens + 1) // 2]
            proposal.q = proposal.q[: len(proposal.tokens)] if proposal.q is not None else None
        return proposal

    def shift(self, context: Sequence[int], keep: int, discard: int) -> None:
        self.inner.shift(context, keep, discard)


def generate(ctx: Context, drafter: Drafter | HybridDrafter | None, prompt: list[int], n: int,
             cost: CostModel | None = None, params: SamplingParams = GREEDY, n_max: int = 8,
             **request: object) -> Result:
    ctx.clear()
    config = SpeculativeConfig(n_max=n_max, p_min=0.0, min_predict=0)
    out = list(Decoder(ctx, drafter, config, cost or fixed()).generate(
        Request(prompt, params, num_predict=n, **request)))  # type: ignore[arg-type]
    result = out[-1]
    assert isinstance(result, Result)
    return result


def assert_adds_up(r: Result) -> None:
    assert sum(d for d, _ in r.drafts_by_source.values()) == r.draft_tokens
    assert sum(a for _, a in r.drafts_by_source.values()) == r.draft_accepted_tokens
    assert all(0 <= a <= d for d, a in r.drafts_by_source.values())
    assert sum(r.accepted_per_pos) == r.draft_accepted_tokens


# -- the drafter's shape -----------------------------------------------------


@pytest.mark.parametrize("sources", [[], ["ngram", "ngram"], ["model", "model2"]])
def test_a_hybrid_needs_distinct_sources_and_one_model_at_most(
        sources: list[str], tiny_engines: tuple[Weights, Context, Context]) -> None:
    _, _, dctx = tiny_engines
    drafters: list[Drafter] = []
    for name in sources:
        d: Drafter = NgramDrafter() if name == "ngram" else ModelDrafter(dctx)
        d.name = name
        drafters.append(d)
    with pytest.raises(ValueError, match=r"source|model"):
        HybridDrafter(drafters)


# -- on real llama.cpp: the tiny pair ------------------------------------------------------------


def tiny_prompts(w: Weights, n: int) -> Iterator[list[int]]:
    rng = np.random.default_rng(5)
    for i in range(n):
        words = ["".join(chr(c) for c in rng.integers(97, 123, 5)) for _ in range(4)]
        yield w.tokenize(f"prompt {i}: {' '.join(words)} {' '.join(words)}", add_special=True, parse_special=False)


def test_tiny_pair_hybrid_greedy_identical(tiny_engines: tuple[Weights, Context, Context]) -> None:
    w, ctx, dctx = tiny_engines
    used: Counter[str] = Counter()
    for prompt in tiny_prompts(w, 12):
        plain = generate(ctx, None, prompt, 96)
        spec = generate(ctx, HybridDrafter([NgramDrafter(1, 3), ModelDrafter(dctx)]), prompt, 96)
        assert spec.tokens == plain.tokens
        assert spec.drafter == "ngram+model" and set(spec.drafts_by_source) == {"ngram", "model"}
        assert_adds_up(spec)
        used.update(name for name, (d, _) in spec.drafts_by_source.items() if d)
    assert used["ngram"] and used["model"], f"both sources should have drafted: {used}"


def test_tiny_pair_hybrid_sampled_runs_keep_the_distribution(tiny_engines: tuple[Weights, Context, Context]) -> None:
    """At temperature 0.8 the first two tokens are distributed as without speculation."""
    w, ctx, dctx = tiny_engines
    prompt = w.tokenize("the distribution test", add_special=True, parse_special=False)
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0)

    def first(drafter: HybridDrafter | None, seeds: range) -> Counter[tuple[int, ...]]:
        counts: Counter[tuple[int, ...]] = Counter()
        for seed in seeds:
            r = generate(ctx, drafter, prompt, 2 if drafter is None else 24,
                         params=SamplingParams(**{**params.__dict__, "seed": seed}), n_max=3)
            if drafter is not None:
                assert len(r.tokens) == 24 or r.done_reason == "stop"
                assert_adds_up(r)
            counts[tuple(r.tokens[:2])] += 1
        return counts

    plain = first(None, range(0, 600))
    hybrid = first(HybridDrafter([NgramDrafter(1, 2), ModelDrafter(dctx)]), range(30_000, 30_600))
    assert chi_square_same_distribution(plain, hybrid) > 1e-3


class Two:
    """A free drafter sure of itself that proposes two tokens, whatever it is asked for."""

    name, has_cost = "two", False

    def begin(self, sampler: object) -> None:
        pass

    def propose(self, context: Sequence[int], max_tokens: int, grammar: Grammar | None = None) -> Proposal:
        return Proposal([context[-1]] * min(2, max_tokens), Support(cls=1, prior=0.99))

    def shift(self, context: Sequence[int], keep: int, discard: int) -> None:
        pass


def test_hybrid_is_lossless_across_context_shifts(model_dir: Path) -> None:
    """The model source's cache follows shifts it sat out (it drafted in some rounds only)."""
    target, draft = write_tiny_pair(model_dir / "endless-pair", seed=6, end_bias=0.0)
    tw, dw = Weights(target, n_gpu_layers=0), Weights(draft, n_gpu_layers=0)
    params = ContextParams(n_ctx=128, n_threads=1)
    ctx, dctx = Context(tw, params), Context(dw, params)
    try:
        prompt = tw.tokenize("shift me " * 6, add_special=True, parse_special=False)
        plain = generate(ctx, None, prompt, 300, shift=True)
        spec = generate(ctx, HybridDrafter([NgramDrafter(1, 3), ModelDrafter(dctx)]), prompt, 300, shift=True)
        assert plain.shifts > 0 and spec.shifts == plain.shifts
        assert spec.tokens == plain.tokens
        assert all(d for d, _ in spec.drafts_by_source.values())
    finally:
        for x in (dctx, ctx, dw, tw):
            x.close()


# -- on real llama.cpp: SmolLM2 copying and inventing -------------------------------------------

COPY = (
    "Copy this paragraph exactly, word for word:\n\nThe lighthouse at Skerry Point was built in 1852, after "
    "three ships were lost on the reef in a single winter. For most of its history it was kept by the Marsh "
    "family, who lived in the cottage at the foot of the tower and climbed its one hundred and twelve steps "
    "several times each night to trim the wicks and wind the clockwork that turned the great lens."
)
STORY = "Write a story about a fox who learns to sail a small boat across a lake."


def chat(w: Weights, text: str) -> list[int]:
    return w.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                      add_special=False, parse_special=True)


def test_copying_drafts_from_ngram_and_inventing_from_the_model(
        smollm2_engines: tuple[Weights, Context, Context]) -> None:
    w, ctx, dctx = smollm2_engines
    for text, copying in ((COPY, True), (STORY, False)):
        prompt = chat(w, text)
        plain = generate(ctx, None, prompt, 96)
        ngram, model = NgramDrafter(2, 4), Counted(ModelDrafter(dctx))
        spec = generate(ctx, HybridDrafter([ngram, model]), prompt, 96, n_max=12)
        assert spec.tokens == plain.tokens, text
        assert_adds_up(spec)
        (ngram_drafted, _), (model_drafted, _) = spec.drafts_by_source["ngram"], spec.drafts_by_source["model"]
        model_rounds = len(model.calls)  # it is asked only in the rounds it drafts
        if copying:
            assert spec.draft_rounds - model_rounds > model_rounds, "n-gram rounds should be most"
            assert ngram_drafted > model_drafted
            # Where the copy ran long (a match of 16 tokens or more), the model was never asked.
            context = prompt + plain.tokens
            probe = NgramDrafter(2, 4)
            long = {n for n in range(len(prompt), len(context)) if probe.propose(context[:n], 0).support.cls >= 4}
            assert long and not long & set(model.calls)
        else:
            assert model_drafted > ngram_drafted and model_rounds > 0


# -- the suffix cache learns finished requests --------------------------------------------------


def test_a_second_identical_request_drafts_from_the_suffix_cache(tiny_endless: Path) -> None:
    w = Weights(tiny_endless, n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=512, n_threads=1))
    try:
        cache = SuffixCache(10_000)
        prompt = w.tokenize("<|im_start|>user\nsay it again<|im_end|>\n<|im_start|>assistant\n",
                            add_special=False, parse_special=True)
        plain = generate(ctx, None, prompt, 64)

        def hybrid() -> HybridDrafter:
            return HybridDrafter([NgramDrafter(2, 4), SuffixDrafter(cache)])

        cancelled = list(Decoder(ctx, hybrid(), SpeculativeConfig(min_predict=0), fixed()).generate(
            Request(prompt, GREEDY, num_predict=64), cancelled=lambda: True))
        assert isinstance(cancelled[-1], Result) and cancelled[-1].done_reason == "cancel"
        assert cache.size == 0  # a cancelled request is not learned
        first = generate(ctx, hybrid(), prompt, 64)
        assert first.tokens == plain.tokens and first.drafts_by_source["suffix"] == (0, 0)
        assert cache.sequences == 1  # the decoder taught it the finished request
        second = generate(ctx, hybrid(), prompt, 64)
        assert second.tokens == plain.tokens
        drafted, accepted = second.drafts_by_source["suffix"]
        assert accepted > 48 and drafted > second.drafts_by_source["ngram"][0]
        assert_adds_up(second)
        generate(ctx, hybrid(), prompt, 64, speculate=False)  # target-only output is learned too
        assert cache.sequences == 3
    finally:
        ctx.close()
        w.close()

