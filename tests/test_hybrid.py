"""Hybrid drafting: several sources behind one drafter, the planner picking one per round.

The planner's choice is checked with sources whose numbers are set by hand; the rest on real
llama.cpp: the tiny pair (target and an ~80% agreeing draft), SmolLM2 (copying an edit, telling a
story) and the suffix cache. Greedy output must equal target-only token for token whatever source
drafts, and with batches padded to a shape (CostModel.t_same, forced here on the CPU).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from sidecar.engine.adaptive import CostModel, SpeculativeConfig
from sidecar.engine.decoder import Decoder, Request, Result
from sidecar.engine.drafters import Drafter, ModelDrafter, NgramDrafter, Proposal, Support
from sidecar.engine.grammar import Grammar
from sidecar.engine.hybrid import HybridDrafter
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.planner import Plan
from sidecar.engine.rounds import Source
from sidecar.engine.sampling import SamplingParams
from sidecar.engine.suffix import SuffixCache, SuffixDrafter
from tests.models import write_tiny_pair
from tests.prices import Fixed
from tests.stats import chi_square_same_distribution

pytestmark = pytest.mark.model

INF = math.inf
GREEDY = SamplingParams(temperature=0.0)
FLAT = [1.0 + 0.02 * i for i in range(13)]  # seconds per 1..13 rows: verifying is nearly free


def fixed(t_step: Sequence[float] = FLAT, t_draft: float = 0.3, t_same: Sequence[float] = ()) -> Fixed:
    """A machine where verifying is cheap and a model's draft step costs 0.3 target steps."""
    cost = Fixed(len(t_step))
    cost.t_step = [0.0, *t_step]
    cost.t_same = [0.0, *t_same] if t_same else []
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


# -- the planner's choice, on hand-set numbers -----------------------------------------------------


def two_sources(ngram: Support, t_draft: float = 0.3) -> Plan:
    """An n-gram source with the given support, and a model whose drafts agree 90% of the time."""
    cost = fixed(t_draft=t_draft)
    cost.explored.add("model")  # past its exploratory probe (test_adaptive has that)
    return Plan.start(SpeculativeConfig(n_max=12), cost, [
        Source("ngram", support=lambda: ngram),
        Source("model", has_cost=True, support=lambda: Support(cls=0, prior=0.9)),
    ], -1)


def test_a_near_certain_free_match_skips_the_model() -> None:
    p = two_sources(Support(cls=6, prior=64 / 66))
    rnd = p.decide(0, INF, 100)
    assert rnd.k == 12 and rnd.source == 0


def test_without_a_free_draft_the_model_drafts() -> None:
    for ngram in (Support(ready=False), Support(cls=1, prior=0.3)):
        p = two_sources(ngram)
        rnd = p.decide(0, INF, 100)
        assert rnd.k > 0 and rnd.source == 1


def test_a_costly_model_loses_to_a_likely_free_draft_and_wins_over_an_unlikely_one() -> None:
    likely = two_sources(Support(cls=4, prior=0.9), t_draft=0.3)
    rnd = likely.decide(0, INF, 100)
    assert rnd.k > 0 and rnd.source == 0
    cheap = two_sources(Support(cls=4, prior=0.6), t_draft=0.01)
    rnd = cheap.decide(0, INF, 100)
    assert rnd.k > 0 and rnd.source == 1


def test_a_model_switched_off_leaves_the_free_source_drafting() -> None:
    p = two_sources(Support(ready=False))
    for i in range(8):  # the model's rounds are far slower than its price says
        rnd = p.decide(5 * i, INF, 100)
        k = rnd.k
        assert k > 0 and rnd.source == 1
        p.record(rnd, drafted=k, accepted=k, draft_seconds=20.0, verify_seconds=FLAT[k], produced=5 * i + 5)
    assert p.fallback is not None and p.fallback.startswith("slower than target-only")
    assert p.decide(41, INF, 100).k == 0
    p.sources[0].support = lambda: Support(cls=5, prior=0.95)
    rnd = p.decide(41, INF, 100)
    assert rnd.k > 0 and rnd.source == 0
    by_source = p.tally.by_source
    assert by_source["ngram"] == [0, 0] and by_source["model"][0] == by_source["model"][1] > 0


def test_source_keys_are_the_source_and_its_class() -> None:
    """Each source reports its own classes; the planner keys evidence by (source, class), so the
    n-gram's class c and the suffix cache's class c never share evidence."""
    suffix = SuffixDrafter(SuffixCache(1000))
    suffix.cache.add([1, 2, 3, 4, 5, 6, 7, 8])
    hybrid = HybridDrafter([NgramDrafter(1, 2), suffix])
    context = [9, 1, 2, 3, 1, 2, 3]
    sources = hybrid.plan_sources(context)
    ngram, cached = (s.support() for s in sources)
    assert ngram == NgramDrafter(1, 2).propose(context, 0).support  # each source keeps its classes
    assert cached.cls == suffix.propose(context, 0).support.cls
    plan = Plan.start(SpeculativeConfig(), fixed(), sources, -1)
    assert plan._key(0, ngram) != plan._key(1, Support(cls=ngram.cls))
    assert ngram.along is not None and ngram.along(0).cls == ngram.cls


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


def test_padding_to_a_shape_keeps_the_output(tiny_engines: tuple[Weights, Context, Context]) -> None:
    """With same-shape batches priced as on a GPU a stretch keeps one shape, and drafts shorter than
    it (here every proposal is cut to half of what was asked) are padded; the output stays, logprobs
    asked or not, greedy or sampled."""
    w, ctx, dctx = tiny_engines
    gpu = fixed([1.33, 3.40, 3.40, 3.39, 3.42, 3.45, 3.47, 3.49, 3.50], t_draft=0.05,
                t_same=[1.33, 1.38, 1.50, 1.64, 1.70, 1.76, 1.82, 1.86, 1.90])
    drafted: list[int] = []
    rounds: list[tuple[int, int]] = []  # (rows decoded, tokens drafted) of each speculative round
    decode = ctx.decode_many  # every decode of the step loop (engine.step)

    class Watched(HybridDrafter):
        def propose(self, source: int, context: Sequence[int], max_tokens: int, grammar: Grammar | None) -> Proposal:
            proposal = super().propose(source, context, max_tokens, grammar)
            drafted.append(min(max_tokens, len(proposal.tokens)))
            return proposal

    def counted(parts: Sequence[tuple[int, Sequence[int], bool]], copy: bool = True) -> list[np.ndarray | None]:
        if drafted and parts[0][2]:  # a round's rows, not a prefill chunk
            rounds.append((len(parts[0][1]), drafted.pop()))
        return decode(parts, copy)

    def halved() -> Watched:
        return Watched([Counted(NgramDrafter(1, 3), halve=True), Counted(ModelDrafter(dctx), halve=True)])

    sampled = SamplingParams(temperature=0.8, seed=3)
    for prompt in tiny_prompts(w, 6):
        plain = generate(ctx, None, prompt, 80)
        ctx.decode_many = counted  # type: ignore[method-assign]
        try:
            spec = generate(ctx, halved(), prompt, 80, cost=gpu)
            logprobs = generate(ctx, halved(), prompt, 80, cost=gpu, logprobs=2)
            rolled = generate(ctx, halved(), prompt, 80, cost=gpu, params=sampled)
        finally:
            del ctx.decode_many
        assert spec.tokens == plain.tokens and logprobs.tokens == plain.tokens
        assert_adds_up(spec)
        assert_adds_up(rolled)
    padded = sum(n > d + 1 for n, d in rounds)
    assert padded > len(rounds) // 2, f"{padded} of {len(rounds)} rounds padded"
    shapes = Counter(n for n, _ in rounds)
    assert shapes.most_common(1)[0][1] > len(rounds) // 2, f"stretches should keep a shape: {shapes}"


class Two:
    """A free drafter sure of itself that proposes two tokens, whatever it is asked for."""

    name, has_cost = "two", False

    def begin(self, sampler: object) -> None:
        pass

    def propose(self, context: Sequence[int], max_tokens: int, grammar: Grammar | None = None) -> Proposal:
        return Proposal([context[-1]] * min(2, max_tokens), Support(cls=1, prior=0.99))

    def shift(self, context: Sequence[int], keep: int, discard: int) -> None:
        pass


def test_a_proposal_shorter_than_the_stretchs_shape_is_padded(tiny_engines: tuple[Weights, Context, Context]) -> None:
    w, ctx, _ = tiny_engines
    batches: list[int] = []
    decode = ctx.decode_many  # every decode of the step loop (engine.step)

    def counted(parts: Sequence[tuple[int, Sequence[int], bool]], copy: bool = True) -> list[np.ndarray | None]:
        if parts[0][2]:  # not a prefill chunk
            batches.append(len(parts[0][1]))
        return decode(parts, copy)

    prompt = next(tiny_prompts(w, 1))
    plain = generate(ctx, None, prompt, 80)
    ctx.decode_many = counted  # type: ignore[method-assign]
    try:
        spec = generate(ctx, Two(), prompt, 80, cost=fixed([1.33, *[3.4] * 8], t_same=[1.33, *[1.5] * 8]))
    finally:
        del ctx.decode_many
    assert spec.tokens == plain.tokens
    assert spec.draft_rounds > 0 and spec.draft_tokens <= 2 * spec.draft_rounds
    assert batches.count(9) >= spec.draft_rounds  # every draft of two verified in 9 rows


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


def test_in_a_models_round_a_free_source_learns_what_it_would_have_drafted(
        smollm2_engines: tuple[Weights, Context, Context], monkeypatch: pytest.MonkeyPatch) -> None:
    """The rounds a model drafts still give the n-gram evidence: in each one the n-gram is asked
    what it would have drafted (a lookup; here one-token matches, which a story has in most
    places), and the verify shows how much of it held. Without it a hybrid's n-gram learnt nothing
    while its model drafted, and priced the next request's copies from fewer rounds than n-gram
    alone had. The output stays the target's."""
    w, ctx, dctx = smollm2_engines
    prompt = chat(w, STORY)
    plain = generate(ctx, None, prompt, 96)
    learnt: list[tuple[int, int, int]] = []
    learn = Plan.learn

    def spy(self: Plan, i: int, support: Support, drafted: int, accepted: int) -> None:
        learnt.append((i, drafted, accepted))
        learn(self, i, support, drafted, accepted)

    monkeypatch.setattr(Plan, "learn", spy)
    ngram, model = Counted(NgramDrafter(1, 4)), Counted(ModelDrafter(dctx))
    spec = generate(ctx, HybridDrafter([ngram, model]), prompt, 96, n_max=12)
    assert spec.tokens == plain.tokens
    assert model.calls and set(model.calls) <= set(ngram.calls)  # asked in every model round
    ngram_rounds = spec.draft_rounds - len(model.calls)
    from_ngram = [(d, a) for i, d, a in learnt if i == 0]
    assert len(from_ngram) > ngram_rounds and all(0 <= a <= d for d, a in from_ngram)


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


def test_a_model_that_must_catch_up_starts_only_for_what_free_sources_leave() -> None:
    """A model draft whose gain over the next 200 tokens repays its catch-up (2000 tokens at 0.01
    s) when every token so far came from plain steps, but not when the n-gram source produced 90%
    of them: its catch-up is weighed against the plain steps it would replace."""
    for free_share, starts in ((0.0, True), (0.9, False)):
        ngram = [Support(cls=3, prior=0.99)]
        p = two_sources(ngram[0])
        p.sources[0].support = lambda ngram=ngram: ngram[0]
        p.sources[1].lag = lambda: 2000
        produced = 0
        while p.tally.free_tokens < 100 * free_share:
            rnd = p.decide(produced, INF, 100)
            assert rnd.k > 0 and rnd.source == 0
            p.record(rnd, 1, 1, 0.0, 1.0, produced)  # two tokens a round from the n-gram source
            produced += 2
        ngram[0] = Support(ready=False)  # no match now: only the model could draft
        while produced < 100:  # plain steps: what they lose to the held-back model rents its catch-up
            rnd = p.decide(produced, 300 - produced, 100)
            if rnd.k:
                break
            p.record(rnd, 0, 0, 0.0, 1.0, produced)
            produced += 1
        rnd = p.decide(100, 200, 100)
        assert (rnd.k > 0 and rnd.source == 1) == starts, free_share


def test_beside_a_free_source_a_catch_up_is_paid_once_plain_steps_cost_as_much() -> None:
    """Ski rental: before the request shows how much of it the free source covers, the model's
    catch-up (300 tokens at 0.01 s: 3 s) is paid only after plain steps the model would have sped
    up have lost that much, the step that buys counted; a lone model, with nothing that could
    cover the text, starts at once."""
    p = two_sources(Support(ready=False))
    p.sources[1].lag = lambda: 300
    lost = [0.0]  # what the plain steps so far lost to the held-back model, step by step
    for produced in range(1000):
        rnd = p.decide(produced, INF, 100)
        if rnd.k:
            break
        p.record(rnd, 0, 0, 0.0, 1.0, produced)
        lost.append(p._rent)
    step = lost[-1] - lost[-2]  # one plain step's loss (the same every step here)
    assert rnd.source == 1 and lost[-1] < 3.0 <= lost[-1] + step and produced > 1
    alone = Plan.start(SpeculativeConfig(n_max=12), fixed(), [
        Source("model", has_cost=True, support=lambda: Support(cls=0, prior=0.9), lag=lambda: 300)], -1)
    assert alone.decide(0, INF, 100).k > 0


def test_a_catch_ups_rental_is_priced_when_it_starts_though_the_lag_grows_while_it_runs() -> None:
    """Every plain step the held-back model sits out adds a token to what it must catch up. Where a
    token's catch-up (0.6 s here) costs more than a plain step loses to the held-back model, a price
    that grew with the rent would never be reached: the rental's price is the catch-up when it
    began (10 tokens, 6 s), and the model starts once the plain steps have lost that much, the
    step that buys counted."""
    p = two_sources(Support(ready=False))
    p.cost.t_catchup = 0.6
    produced = [0]
    p.sources[1].lag = lambda: 10 + produced[0]
    lost = [0.0]
    for produced[0] in range(200):
        rnd = p.decide(produced[0], INF, 100)
        if rnd.k:
            break
        p.record(rnd, 0, 0, 0.0, 1.0, produced[0])
        lost.append(p._rent)
    assert rnd.k > 0 and rnd.source == 1
    assert lost[-1] < 6.0 <= 2 * lost[-1] - lost[-2] and produced[0] < 30
    assert p.fallback is None  # drafting again


def test_a_model_held_back_by_its_catch_up_says_so() -> None:
    """A model whose drafts would pay (0.9 acceptance) but whose catch-up is not repaid yet is held
    back: the request's `fallback` says that, not that the draft does not pay."""
    p = two_sources(Support(ready=False))
    p.sources[1].lag = lambda: 300
    rnd = p.decide(0, INF, 100)
    assert rnd.k == 0
    assert p.fallback == "draft held back: catching up 300 tokens would not repay yet"


def test_beside_a_free_source_an_unexplored_model_is_probed_once_plain_steps_cost_its_catch_up() -> None:
    """Drafting alone, a model never probed is probed at its first chance (test_adaptive). Beside a
    free source that first probe is rented too: a 300-token catch-up (3 s at 0.01 s a token) waits
    for 3 s of plain steps, so a request the free source covers never prefills its prompt into the
    model; with nothing to catch up it probes at once."""
    for lag, after in ((300, 3), (0, 1)):
        p = Plan.start(SpeculativeConfig(n_max=12), fixed(), [
            Source("ngram", support=lambda: Support(ready=False)),
            Source("model", has_cost=True, support=lambda: Support(cls=0, prior=0.1), lag=lambda lag=lag: lag)], -1)
        for produced in range(100):
            rnd = p.decide(produced, INF, 100)
            if rnd.k:
                break
            p.record(rnd, 0, 0, 0.0, 1.0, produced)
        assert rnd.probe and rnd.source == 1 and produced + 1 == after, lag


def test_a_model_that_fell_behind_yields_to_a_free_source_that_can_draft() -> None:
    """The model's drafts are worth a little more than the n-gram's this round, until the round
    must also prefill the 300 tokens the n-gram source drafted meanwhile (3 s): then the free
    source drafts on."""
    for lag, source in ((0, 1), (300, 0)):
        p = two_sources(Support(cls=3, prior=0.5))  # 1.79 tokens a second against the model's 1.80
        p.sources[1].lag = lambda lag=lag: lag
        rnd = p.decide(0, INF, 100)
        assert rnd.k > 0
        assert rnd.source == source, lag
