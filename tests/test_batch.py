"""Many sequences in one batch on real llama.cpp: each one's output is what it gives alone.

Every test runs SmolLM2 through engine.step.StepLoop over one context with several KV streams and
compares each sequence, token for token, with the same request decoded alone on a one-sequence
context, target-only. Sequences join at different steps (so a prompt is prefilled in chunks while
others decode), carry different options, are cancelled, reuse and lose cached prefixes, and shift
their windows, all inside shared steps. The equality is exact: a stream per sequence keeps each
one's cells where they are alone (engine.step, Losslessness).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import pytest

from sidecar.engine.adaptive import CostModel, SpeculativeConfig, Step
from sidecar.engine.decoder import Decoder, Request, Result
from sidecar.engine.drafters import ModelDrafter, NgramDrafter
from sidecar.engine.grammar import gbnf_for_format
from sidecar.engine.hybrid import HybridDrafter
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.logprobs import Logprobs
from sidecar.engine.sampling import SamplingParams
from sidecar.engine.sequence import Sequence
from sidecar.engine.seqview import SeqView
from sidecar.engine.step import MIN_CHUNK, PREFILL_SHARE, PRICE_ROWS, StepLoop, pad_widths
from tests.prices import Fixed
from tests.test_lossless import chat_prompt

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0)
N_CTX = 1024

PROMPTS = [
    "Write a short poem about the sea.",
    "Copy this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "Explain what a hash map is.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="module")
def weights(smollm2_engines: tuple[Weights, Context, Context]) -> Weights:
    return smollm2_engines[0]


@dataclass
class Run:
    """One sequence's output: tokens, text, logprobs and its Result."""

    text: str = ""
    logprobs: list[Logprobs] = field(default_factory=list)
    result: Result | None = None

    def add(self, item: object) -> None:
        if isinstance(item, Result):
            self.result = item
        elif isinstance(item, Logprobs):
            self.logprobs.append(item)
        else:
            assert isinstance(item, str)
            self.text += item

    @property
    def tokens(self) -> list[int]:
        assert self.result is not None
        return self.result.tokens


def speculative() -> tuple[SpeculativeConfig, CostModel]:
    """The planner's own choices, on a flat made-up curve (a GPU's) so drafts pay in a batch too."""
    cost = CostModel(13)
    cost.t_step = [0.0] + [0.01 * (1 + 0.001 * n) for n in range(1, 14)]
    return SpeculativeConfig(n_max=12, min_predict=0), cost


def solo(weights: Weights, req: Request, n_ctx: int = N_CTX) -> Run:
    """The reference: the request alone on a one-sequence context, target-only."""
    ctx = Context(weights, ContextParams(n_ctx=n_ctx, n_batch=512))
    try:
        run = Run()
        for item in Decoder(ctx).generate(replace(req, speculate=False)):
            run.add(item)
        return run
    finally:
        ctx.close()


class Batch:
    """A StepLoop over one context with `n_seq` streams, fed requests at chosen steps."""

    def __init__(self, weights: Weights, n_seq: int, n_ctx: int = N_CTX, ngram: bool = False,
                 draft: Context | None = None, n_batch: int = 512) -> None:
        self.weights = weights
        self.ctx = Context(weights, ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_seq=n_seq))
        self.loop = StepLoop(self.ctx)
        self.config, self.cost = speculative() if ngram or draft is not None else (SpeculativeConfig(), CostModel(9))
        sources: list[list[object]] = [[] for _ in range(n_seq)]
        for sid in range(n_seq):
            if ngram:
                sources[sid].append(NgramDrafter())
            if draft is not None:
                sources[sid].append(ModelDrafter(SeqView(draft, sid)))
        self.drafters = [HybridDrafter(s) if s else None for s in sources]  # type: ignore[arg-type]
        self.runs: dict[int, Run] = {}
        self.seqs: dict[int, Sequence] = {}

    def add(self, key: int, req: Request, cancelled: Callable[[], bool] = lambda: False) -> Sequence:
        w = self.weights

        def make(sid: int) -> Sequence:
            return Sequence(w, self.ctx.n_ctx, self.ctx.n_batch, req, self.drafters[sid], self.config, self.cost,
                            cancelled)

        seq = self.loop.add(req.prompt, make)
        self.runs[key] = Run()
        self.seqs[key] = seq
        return seq

    def step(self) -> None:
        keys = {id(s): k for k, s in self.seqs.items()}
        for seq, got in self.loop.step():
            assert not isinstance(got, BaseException), got
            for item in got:
                self.runs[keys[id(seq)]].add(item)

    def drain(self) -> Iterator[int]:
        """Step until every sequence is done; yields the step count as it goes."""
        n = 0
        while self.loop.running:
            self.step()
            n += 1
            yield n

    def alongside(self, reqs: list[Request], want: list[Run]) -> None:
        """Run `reqs` together to their ends, and check each output against its solo run."""
        for i, r in enumerate(reqs):
            self.add(i, r)
        list(self.drain())
        for i in range(len(reqs)):
            assert self.runs[i].tokens == want[i].tokens, f"sequence {i} parted from its solo run"

    def close(self) -> None:
        self.ctx.close()


def request(weights: Weights, i: int, n: int = 48, **kw: object) -> Request:
    return Request(chat_prompt(weights, PROMPTS[i % len(PROMPTS)]), kw.pop("sampling", GREEDY),  # type: ignore[arg-type]
                   num_predict=n, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("ngram", [False, True], ids=["plain", "ngram"])
def test_batched_greedy_equals_each_request_alone(weights: Weights, ngram: bool) -> None:
    """Four sequences join at steps 0, 0, 3 and 7 (the late ones prefill while the others decode)."""
    reqs = [request(weights, i) for i in range(4)]
    want = [solo(weights, r) for r in reqs]
    b = Batch(weights, 4, ngram=ngram)
    try:
        b.add(0, reqs[0])
        b.add(1, reqs[1])
        for n in b.drain():
            if n == 3:
                b.add(2, reqs[2])
            if n == 7:
                b.add(3, reqs[3])
        for i in range(4):
            assert b.runs[i].tokens == want[i].tokens, f"sequence {i} parted from its solo run"
            assert b.runs[i].text == want[i].text
        if ngram:
            assert sum(b.runs[i].result.draft_tokens for i in range(4)) > 0  # type: ignore[union-attr]
        assert b.loop.stats.rows > b.loop.stats.steps  # steps held several sequences' rows
    finally:
        b.close()


def test_batched_model_drafts_equal_each_request_alone(weights: Weights, smollm2: object) -> None:
    """A model draft per stream on one shared draft context (here the target's own weights, so
    drafts are taken), verified inside the shared steps."""
    reqs = [request(weights, i, n=32) for i in range(3)]
    want = [solo(weights, r) for r in reqs]
    draft = Context(weights, ContextParams(n_ctx=N_CTX, n_batch=512, n_seq=3))
    b = Batch(weights, 3, draft=draft)
    try:
        b.alongside(reqs, want)
        assert sum(b.runs[i].result.draft_accepted_tokens for i in range(3)) > 0  # type: ignore[union-attr]
    finally:
        b.close()
        draft.close()


class HeldPrices(Fixed):
    """A GPU's prices, held as set: a pass costs a step and a row 5% more, and no decode's timing
    moves them (the shared steps' factors stay 1 too), so which drafts a step affords is the same
    on any machine."""

    def __init__(self) -> None:
        super().__init__(13)
        self.t_step = [0.0] + [0.01 * (1 + 0.05 * (n - 1)) for n in range(1, 14)]
        self.t_draft = self.t_catchup = 0.0005

    def observe_shared(self, rows: object, seconds: float, cells: int = 0) -> None:
        pass


@pytest.mark.parametrize("source", ["ngram", "model"])
def test_a_draft_that_leaves_the_others_behind_is_taken_back(weights: Weights, smollm2: object, source: str) -> None:
    """Three sequences, the middle one drafting (it copies its prompt; the model draft is the
    target's own weights, so it always holds). Its draft is a pass of its own that both neighbours
    wait for, and its row between theirs merges their passes, so its finishing early gives them
    nothing back: the step takes the draft back once their slack is spent (engine.fair), the
    sequence steps plain, and every output is still its solo run."""
    reqs = [request(weights, 0, n=40), request(weights, 3, n=40), request(weights, 2, n=40)]
    want = [solo(weights, r) for r in reqs]
    draft = Context(weights, ContextParams(n_ctx=N_CTX, n_batch=512, n_seq=3)) if source == "model" else None
    b = Batch(weights, 3, ngram=source == "ngram", draft=draft)
    b.cost = HeldPrices()
    b.drafters[0] = b.drafters[2] = None
    orders: list[list[int]] = []
    run = b.ctx._run

    def recorded(batch: list[tuple[int, list[int], int]]) -> None:  # the llama_batch as llama.cpp gets it
        orders.append([sid for sid, _, _ in batch])
        run(batch)

    b.ctx._run = recorded  # type: ignore[method-assign]
    try:
        b.alongside(reqs, want)
        assert b.loop.stats.withdrawn > 0
        # Each request reports its own (the request's log line carries it).
        assert sum(b.runs[i].result.withdrawn for i in range(3)) == b.loop.stats.withdrawn  # type: ignore[union-attr]
        # The one taken back decides last, but llama.cpp gets the streams in order
        # (Context.decode_many): it would split streams 0, 2, 1 into more passes than 0, 1, 2.
        assert all(order == sorted(order) for order in orders)
    finally:
        b.close()
        if draft is not None:
            draft.close()


class CpuPrices(HeldPrices):
    """A CPU's prices, held as set: each row adds 40% of a step, a model draft token costs 40% of
    one, and a pass of one sequence beside others' costs 30% of its price alone."""

    def __init__(self) -> None:
        super().__init__()
        self.t_step = [0.0] + [0.01 * (1 + 0.4 * (n - 1)) for n in range(1, 14)]
        self.t_draft, self.beside = 0.004, 0.3


def test_a_model_draft_waits_while_a_prompt_comes_in(weights: Weights, smollm2: object) -> None:
    """A sequence drafting from a model alone, then a long prompt arrives beside it. The drafting
    sequence decides first and alone (the prompt's chunk is cut after it), so its draft pays by its
    own price; but at these prices it adds more to the step than the row it gives back once done,
    and the prompt, whose first token waits for it, is a stream the step accounts for too: the
    step takes the draft back (engine.fair), and both outputs are their solo runs. (The draft model
    is the target's own weights, so its drafts always hold.)"""
    long = replace(request(weights, 0, n=16), prompt=chat_prompt(weights, " ".join(PROMPTS * 4)))
    reqs = [request(weights, 3, n=48), long]
    want = [solo(weights, r) for r in reqs]
    draft = Context(weights, ContextParams(n_ctx=N_CTX, n_batch=512, n_seq=2))
    b = Batch(weights, 2, draft=draft)
    b.cost = CpuPrices()
    b.drafters[1] = None
    try:
        b.add(0, reqs[0])
        while b.seqs[0].plan.tally.draft_tokens == 0:
            b.step()
        assert b.loop.stats.withdrawn == 0  # alone, no one waits on its drafts
        b.add(1, reqs[1])
        b.step()
        assert b.seqs[1].prefilling, "the prompt came in whole: no chunk for a draft to wait on"
        assert b.loop.stats.withdrawn == 1
        list(b.drain())
        for i in range(2):
            assert b.runs[i].tokens == want[i].tokens, f"sequence {i} parted from its solo run"
    finally:
        b.close()
        draft.close()


class PairPrices(HeldPrices):
    """Prices under which no lone model draft pays beside another stream's plain row, but two
    drafting together do (engine.together): a flat curve (each row 10% of a step), a draft step
    40% of a target step, a stream's pass beside others' at twice its price alone, and a draft
    row beside another half a draft step."""

    def __init__(self) -> None:
        super().__init__()
        self.t_step = [0.0] + [0.01 * (1 + 0.1 * (n - 1)) for n in range(1, 14)]
        self.t_draft, self.t_catchup, self.beside = 0.004, 0.0001, 2.0


@pytest.mark.parametrize("together", [True, False])
def test_model_drafts_that_pay_only_together_are_made_together(weights: Weights, smollm2: object,
                                                               together: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sequences, each drafting from the model on its stream of one draft context (the
    target's own weights, trusted to agree: acceptance prior 0.95). Each sequence alone sees its
    draft beside the other's plain row, which does not pay at these prices; drafting together, the
    draft steps carry both rows and the verify rows go in one pass, which does. With the joint
    offer they draft together, without it neither drafts while the other runs (the one left
    alone at the end may); both outputs are their solo runs."""
    import sidecar.engine.step as step

    if not together:
        monkeypatch.setattr(step, "choose", lambda *a, **k: None)
    drafts: list[int] = []  # the model drafts each draft batch made
    propose = step.propose_together

    def counted(asks: list[object]) -> object:
        drafts.append(len(asks))
        return propose(asks)  # type: ignore[arg-type]

    monkeypatch.setattr(step, "propose_together", counted)
    reqs = [request(weights, 0, n=40), request(weights, 2, n=40)]
    want = [solo(weights, r) for r in reqs]
    draft = Context(weights, ContextParams(n_ctx=N_CTX, n_batch=512, n_seq=2))
    b = Batch(weights, 2, draft=draft)
    b.cost = PairPrices()
    b.cost.explored.add("model")  # no exploring probe (Probing.due): every draft is a decision
    b.config = replace(b.config, n_max=8, acceptance_prior=0.95)
    try:
        b.alongside(reqs, want)
        if together:
            assert b.loop.stats.together > 0 and drafts.count(2) > 1
            assert b.loop.stats.withdrawn == 0
        else:
            assert 2 not in drafts
    finally:
        b.close()
        draft.close()


def test_mixed_options_share_one_batch(weights: Weights) -> None:
    """Greedy, seeded sampling, a JSON format, logprobs and a stop string, in the same steps."""
    fmt = gbnf_for_format({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    reqs = [
        request(weights, 0),
        request(weights, 1, sampling=SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7)),
        request(weights, 2, grammar=fmt),
        request(weights, 3, logprobs=3),
        request(weights, 0, n=64, stop=["sea"]),
    ]
    want = [solo(weights, r) for r in reqs]
    b = Batch(weights, 5, ngram=True)
    try:
        b.alongside(reqs, want)
        assert all(b.runs[i].text == want[i].text for i in range(5))
        assert b.runs[2].text.startswith("{")
        assert [e.logprob for lp in b.runs[3].logprobs for e in lp.entries] == \
            [e.logprob for lp in want[3].logprobs for e in lp.entries]
        assert "sea" not in b.runs[4].text and b.runs[4].result.done_reason == "stop"  # type: ignore[union-attr]
    finally:
        b.close()


def test_a_cancel_mid_batch_frees_its_stream_and_spares_the_others(weights: Weights) -> None:
    reqs = [request(weights, i) for i in range(3)]
    want = [solo(weights, r) for r in reqs]
    gone = [False]
    b = Batch(weights, 3)
    try:
        b.add(0, reqs[0])
        cancelled = b.add(1, reqs[1], cancelled=lambda: gone[0])
        b.add(2, reqs[2])
        for n in b.drain():
            if n == 10:
                gone[0] = True
            if n == 11:  # the very next step let it go
                assert cancelled not in b.loop.running.values()
        assert b.runs[1].result.done_reason == "cancel"  # type: ignore[union-attr]
        assert len(b.runs[1].tokens) < len(want[1].tokens)
        for i in (0, 2):
            assert b.runs[i].tokens == want[i].tokens
    finally:
        b.close()


def test_a_prefix_is_reused_copied_and_evicted(weights: Weights) -> None:
    """Turn 2 of a conversation reuses turn 1's stream; a second client with the same long head
    gets it copied from a busy stream; a stream used least recently is the one given away."""
    head = chat_prompt(weights, "You are a careful assistant. " * 40 + "Say hello.")
    turn1 = Request(head, GREEDY, num_predict=16)
    b = Batch(weights, 2)
    try:
        b.add(0, turn1)
        list(b.drain())
        assert b.runs[0].result.prompt_cached == 0  # type: ignore[union-attr]
        # Turn 2: turn 1's prompt and answer, then more.
        more = chat_prompt(weights, "And now say goodbye.")
        turn2 = Request(head + b.runs[0].tokens + more, GREEDY, num_predict=16)
        b.add(1, turn2)
        got = b.runs[1]
        b.add(2, Request(head[:-3] + chat_prompt(weights, "Other question?"), GREEDY, num_predict=16))
        list(b.drain())
        assert got.result.prompt_cached >= len(head) + len(b.runs[0].tokens) - 1  # type: ignore[union-attr]
        assert got.tokens == solo(weights, turn2).tokens
        # The second client shares the head: copied from the stream that holds it.
        assert b.runs[2].result.prompt_cached >= len(head) - 4  # type: ignore[union-attr]
        assert b.runs[2].tokens == solo(weights, Request(head[:-3] + chat_prompt(weights, "Other question?"),
                                                      GREEDY, num_predict=16)).tokens
        assert b.loop.stats.copied_tokens > 0
        # Two unrelated prompts take both streams: the head is evicted.
        for i in (3, 4):
            b.add(i, request(weights, i, n=4))
        list(b.drain())
        b.add(5, turn1)
        list(b.drain())
        assert b.runs[5].result.prompt_cached < 8  # type: ignore[union-attr]
        assert b.runs[5].tokens == b.runs[0].tokens
    finally:
        b.close()


def test_the_same_question_again_takes_its_own_stream(weights: Weights) -> None:
    """A short question under a long answer (never half of what its stream holds) asked again goes
    back to its stream, not to the least recently used one, whose long prompt stays cached."""
    short = Request(chat_prompt(weights, PROMPTS[0]), GREEDY, num_predict=48)
    long = Request(chat_prompt(weights, "You are a careful assistant. " * 40 + "Say hello."), GREEDY, num_predict=4)
    b = Batch(weights, 2)
    try:
        b.add(0, short)
        b.add(1, long)  # finishes first: the short question's stream is the more recently used
        list(b.drain())
        b.add(2, short)
        list(b.drain())
        assert b.runs[2].result.prompt_cached == len(short.prompt) - 1  # type: ignore[union-attr]
        assert b.runs[2].tokens == b.runs[0].tokens
        b.add(3, long)
        list(b.drain())
        assert b.runs[3].result.prompt_cached == len(long.prompt) - 1  # type: ignore[union-attr]
    finally:
        b.close()


def test_a_shift_inside_a_batch(weights: Weights) -> None:
    """Two sequences shift their small windows while sharing steps: each as it shifts alone."""
    reqs = [request(weights, i, n=320, shift=True, num_keep=8) for i in (0, 2)]
    want = [solo(weights, r, n_ctx=256) for r in reqs]  # llama.cpp's smallest window
    assert all(w.result.shifts > 0 for w in want)  # type: ignore[union-attr]
    b = Batch(weights, 2, n_ctx=256, ngram=True)
    try:
        b.add(0, reqs[0])
        b.add(1, reqs[1])
        list(b.drain())
        for i in range(2):
            assert b.runs[i].result.shifts == want[i].result.shifts  # type: ignore[union-attr]
            assert b.runs[i].tokens == want[i].tokens
    finally:
        b.close()


@pytest.mark.parametrize("shift", [True, False], ids=["shift", "stop"])
def test_padding_never_overflows_a_window(weights: Weights, shift: bool) -> None:
    """Drafting sequences (so the step pads the others to their width) at the end of small windows:
    each shifts, or stops at `length`, exactly as alone, and none fails the step for the others
    (Open WebUI's long side requests once ended both streams of a batch with a 500 this way)."""
    reqs = [request(weights, i, n=300, shift=shift, num_keep=8) for i in (1, 3, 0)]
    want = [solo(weights, r, n_ctx=256) for r in reqs]
    b = Batch(weights, 3, n_ctx=256, ngram=True)
    try:
        for i, r in enumerate(reqs):
            b.add(i, r)
        list(b.drain())  # Batch.step asserts that no sequence failed
        for i in range(3):
            assert b.runs[i].result.done_reason == want[i].result.done_reason  # type: ignore[union-attr]
            assert b.runs[i].tokens == want[i].tokens
    finally:
        b.close()


def test_padding_stays_inside_each_window_and_n_batch() -> None:
    """The padding rule alone: a run pads to its widest member unless one of its sequences is at
    the end of its window (the run keeps its widths), and nothing pads past n_batch."""
    widths = [(0, 1), (1, 4), (3, 1), (4, 2)]
    roomy = {0: 100, 1: 100, 3: 100, 4: 100}
    assert pad_widths(widths, roomy, 512) == {0: 4, 1: 4, 3: 2, 4: 2}
    assert pad_widths(widths, {**roomy, 0: 1}, 512) == {0: 1, 1: 4, 3: 2, 4: 2}  # seq 0 has one cell left
    assert pad_widths(widths, roomy, 11) == dict(widths)  # 12 padded rows do not fit


def test_prompts_arriving_together_share_n_batch(weights: Weights) -> None:
    """Four long prompts admitted at once: each step takes what n_batch holds, the rest waits."""
    reqs = [Request(chat_prompt(weights, f"Point {i}. " + "You are a careful assistant. " * 40), GREEDY, num_predict=8)
            for i in range(4)]
    assert sum(len(r.prompt) for r in reqs) > 512
    b = Batch(weights, 4)
    try:
        for i, r in enumerate(reqs):
            b.add(i, r)
        list(b.drain())
        for i, r in enumerate(reqs):
            assert b.runs[i].tokens == solo(weights, r).tokens
    finally:
        b.close()


@pytest.mark.parametrize("ngram", [True, False], ids=["ngram", "plain"])
def test_the_first_token_comes_from_the_chunk_that_ends_the_prompt(weights: Weights, ngram: bool) -> None:
    """As Ollama and llama-server give it: the pass over the prompt's last chunk gives the first
    token, before any draft (a copying request the n-gram drafter could draft for at once), and no
    step decodes the prompt's last token alone (a plain request of 8 tokens takes 8 decodes). The
    prompt's time runs to that first token (Ollama's startGenerationTime)."""
    req = request(weights, 1 if ngram else 0, n=48 if ngram else 8)
    want = solo(weights, req)
    b = Batch(weights, 1, ngram=ngram)
    widths: list[list[int]] = []
    decode = b.ctx.decode_many

    def counted(parts: list[tuple[int, list[int], int]], copy: bool = True) -> list[object]:
        widths.append([len(t) for _, t, _ in parts])
        return decode(parts, copy)  # type: ignore[return-value]

    b.ctx.decode_many = counted  # type: ignore[method-assign]
    try:
        seq = b.add(0, req)
        b.step()
        assert widths == [[len(req.prompt)]] and seq.result.tokens == want.tokens[:1]
        t_first = seq.result.prompt_seconds
        assert t_first > 0
        list(b.drain())
        run = b.runs[0]
        assert run.tokens == want.tokens and run.result is not None
        assert run.result.prompt_seconds == t_first and run.result.eval_seconds > 0
        if ngram:
            assert run.result.draft_tokens > 0
        else:
            assert len(run.tokens) == 8 and len(widths) == 8
    finally:
        del b.ctx.decode_many
        b.close()


def test_drafts_fit_n_batch_beside_the_other_sequences(weights: Weights) -> None:
    """Two copying sequences whose drafts pay (a flat curve, n_max 12) on a context whose n_batch
    (8) holds less than one full round beside the other sequence's row: each draft is cut to what
    the step has left, so no decode is refused, and both outputs are their solo runs."""
    reqs = [request(weights, 3, n=40), request(weights, 3, n=40)]
    want = [solo(weights, r) for r in reqs]
    b = Batch(weights, 2, ngram=True, n_batch=8)
    widths: list[int] = []
    decode = b.ctx.decode_many

    def counted(parts: list[tuple[int, list[int], bool]], copy: bool = True) -> list[object]:
        widths.append(sum(len(t) for _, t, _ in parts))
        return decode(parts, copy)  # type: ignore[return-value]

    b.ctx.decode_many = counted  # type: ignore[method-assign]
    try:
        b.add(0, reqs[0])
        b.add(1, reqs[1])
        list(b.drain())
        for i in range(2):
            assert b.runs[i].tokens == want[i].tokens
        assert max(widths) <= 8, widths
        assert sum(b.runs[i].result.draft_tokens for i in range(2)) > 0  # type: ignore[union-attr]
    finally:
        del b.ctx.decode_many
        b.close()


def test_a_prompt_chunk_is_priced_by_what_its_chunks_cost() -> None:
    """Beside decoding rows, a chunk starts at the verify curve's price of a row and then follows
    what the steps that carried it showed: a prompt token that cost as much as three decoding steps
    gets a chunk of the floor, a cheap one a wide chunk (within n_batch)."""
    cost = CostModel(13)
    cost.t_step = [0.0] + [0.010 + 0.005 * (n - 1) for n in range(1, 14)]
    seq = type("Seq", (), {"cost": cost, "n_batch": 512})()
    loop = StepLoop.__new__(StepLoop)
    loop._chunking = {}
    planned = {0: 8}  # one sequence verifying 8 rows: 45 ms
    budget = PREFILL_SHARE * cost.t_step[8]
    first = loop._chunk(1, seq, planned, 0)  # type: ignore[arg-type]
    assert first == int(budget / (cost.added(PRICE_ROWS, Step(1, ((0, 8),))) / PRICE_ROWS)) > MIN_CHUNK
    loop._chunking[1].observe(first, 3 * cost.t_step[8] * first)  # each token cost three such steps
    assert loop._chunk(1, seq, planned, 0) == MIN_CHUNK  # type: ignore[arg-type]
    for _ in range(40):
        loop._chunking[1].observe(100, 0.0001 * 100)  # then cheap ones: 675 would fit the budget
    assert loop._chunk(1, seq, planned, 0) == 512  # type: ignore[arg-type]  # n_batch


def test_each_price_is_asked_at_the_depth_its_step_attends_over(weights: Weights) -> None:
    """The cells the cost model is told a pass attends over are what the streams held before it:
    a lone sequence's own, and in a shared step the deepest stream's (llama.cpp sizes a pass's
    attention by its deepest stream)."""
    b = Batch(weights, 2, ngram=True)
    lone: list[tuple[int, int, int]] = []  # (rows, cells, what the stream holds once they are in)
    shared: list[tuple[int, int]] = []  # (cells, the deepest stream before the decode)
    observe_step, observe_shared = b.cost.observe_step, b.cost.observe_shared

    def spy_step(n: int, seconds: float, same: bool = False, cells: int = 0) -> None:
        (sid,) = b.loop.running
        lone.append((n, cells, len(b.ctx.held(sid))))
        observe_step(n, seconds, same, cells)

    def spy_shared(rows: list[tuple[int, int]], seconds: float, cells: int = 0) -> None:
        shared.append((cells, max(len(b.ctx.held(sid)) - n for sid, n in rows)))
        observe_shared(rows, seconds, cells)

    b.cost.observe_step, b.cost.observe_shared = spy_step, spy_shared  # type: ignore[method-assign]
    try:
        # The second request joins once the first has run a few steps alone, while it still has
        # far to go (its drafts may copy 12 tokens a step, so a count of steps is no measure).
        b.add(0, request(weights, 3, n=160))
        steps = b.drain()
        while len(lone) < 2:
            next(steps)
        b.add(1, request(weights, 1, n=24))
        list(steps)
        assert lone and all(cells + n == held for n, cells, held in lone), [x for x in lone if x[1] + x[0] != x[2]]
        assert lone[0][1] >= len(request(weights, 3).prompt)
        assert shared and all(cells == deepest for cells, deepest in shared), shared
    finally:
        b.close()


def test_a_sequence_gives_its_result_in_the_step_that_ends_it(weights: Weights, smollm2: object) -> None:
    """A sequence that reaches num_predict in a shared step leaves in that step, with its Result:
    otherwise its last chunk waits for the next step's decode, which may carry a long prompt's
    whole chunk once it is the only sequence left (seconds on a CPU)."""
    b = Batch(weights, 2)
    try:
        b.add(0, request(weights, 0, n=4))
        b.add(1, request(weights, 1, n=32))
        while b.runs[0].result is None:
            b.step()
            assert b.runs[0].result is not None or len(b.seqs[0].result.tokens) < 4, "its last step kept its Result"
        assert len(b.runs[0].tokens) == 4
        assert b.seqs[0] not in b.loop.running.values()
        assert b.runs[1].result is None  # the other one goes on
        list(b.drain())
        assert b.runs[1].result is not None
    finally:
        b.close()
