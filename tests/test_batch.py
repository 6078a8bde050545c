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

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.cost import CostModel, Layout
from sidecar.engine.decoder import Decoder, Request, Result
from sidecar.engine.drafters import ModelDrafter, NgramDrafter
from sidecar.engine.grammar import gbnf_for_format
from sidecar.engine.hybrid import HybridDrafter
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.logprobs import Logprobs
from sidecar.engine.sampling import SamplingParams
from sidecar.engine.sequence import Sequence
from sidecar.engine.seqview import SeqView
from sidecar.engine.step import MIN_CHUNK, PREFILL_SHARE, StepLoop, pad_widths
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
    """The schedule's own choices, on a flat made-up curve (a GPU's) so drafts pay in a batch too,
    held there: refitted to this CPU's decodes (a row ~0.4 of a step), a busy machine's prices
    withheld every draft of seven streams (CI: test_overlapped_steps_equal_each_request_alone)."""
    cost = Fixed(13)
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
                 draft: Context | None = None, n_batch: int = 512, overlap: bool = False) -> None:
        self.weights = weights
        self.ctx = Context(weights, ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_seq=n_seq))
        self.loop = StepLoop(self.ctx, overlap=overlap)
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
        self.publish(self.loop.step(publish=self.publish))

    def publish(self, outputs: list[tuple[Sequence, list[object] | BaseException]]) -> None:
        keys = {id(s): k for k, s in self.seqs.items()}
        for seq, got in outputs:
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
    moves them, so which drafts a step affords is the same on any machine."""

    def __init__(self) -> None:
        super().__init__(13)
        self.t_step = [0.0] + [0.01 * (1 + 0.05 * (n - 1)) for n in range(1, 14)]
        self.t_draft = self.t_catchup = 0.0005


@pytest.mark.parametrize("source", ["ngram", "model"])
def test_a_draft_that_leaves_the_others_behind_is_held_back(weights: Weights, smollm2: object, source: str) -> None:
    """Three sequences, the middle one drafting (it copies its prompt; the model draft is the
    target's own weights, so it always holds). Its draft is a pass of its own (or, padded, rows on
    every stream) that both neighbours wait for: more than their slack of a plain step, so the
    schedule holds it back (engine.schedule), the sequence steps plain, and every output is still
    its solo run."""
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
        # llama.cpp gets the streams in order (Context.decode_many): it would split streams 0, 2, 1
        # into more passes than 0, 1, 2.
        assert all(order == sorted(order) for order in orders)
    finally:
        b.close()
        if draft is not None:
            draft.close()


class PairPrices(HeldPrices):
    """Prices under which no lone model draft pays beside another stream's plain row, but two
    drafting together do: a pass costs a step, each row 10% of one, and a draft step 40% of a
    target step, most of it its own pass (a draft row beside another adds little)."""

    def __init__(self) -> None:
        super().__init__()
        self.t_step = [0.0] + [0.01 * (1 + 0.1 * (n - 1)) for n in range(1, 14)]
        self.t_draft, self.t_catchup = 0.004, 0.0001

    def seed(self) -> None:
        super().seed()
        self.draft.w[:] = [0.0038, 0.0002, 0.0001]


def test_model_drafts_that_pay_only_together_are_made_together(weights: Weights, smollm2: object,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sequences, each drafting from the model on its stream of one draft context (the
    target's own weights, trusted to agree: acceptance prior 0.95). Each sequence alone sees its
    draft beside the other's plain row, which does not pay at these prices; drafting together, the
    draft steps carry both rows and the verify rows share a pass, which does: the schedule weighs
    both drafting at one length (engine.schedule), and both outputs are their solo runs."""
    import sidecar.engine.step as step

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
    b.config = replace(b.config, n_max=8, acceptance_prior=0.95, prior_weight=50.0)
    try:
        b.alongside(reqs, want)
        assert b.loop.stats.together > 0 and drafts.count(2) > 1
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


def test_overlapped_steps_equal_each_request_alone(weights: Weights) -> None:
    """Where a GPU's decode runs while the host says the last step's text (StepLoop.overlap),
    every option still gives what it gives alone: a stop string found during the next decode
    drops the rows that decode scored for it, a late prompt prefills beside the others, and a
    cancelled sequence leaves in the very next step. The output is made inside the decode's call,
    between its launch and the read of its logits."""
    fmt = gbnf_for_format({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    reqs = [
        request(weights, 1),  # a copy: drafts that hold
        request(weights, 1, sampling=SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7)),
        request(weights, 2, grammar=fmt),
        request(weights, 3, logprobs=3),
        request(weights, 0, n=64, stop=["sea"]),
        request(weights, 3, n=64, stop=[" fox"]),  # inside a copied draft
        request(weights, 2, n=64),
    ]
    want = [solo(weights, r) for r in reqs]
    b = Batch(weights, len(reqs), ngram=True, overlap=True)
    decode, inside = b.ctx.decode_many, [0]

    def counted(parts: list[tuple[int, list[int], int]], copy: bool = True, meanwhile: Callable[[], object]
                | None = None) -> list[object]:
        def said() -> None:
            before = sum(len(r.text) for r in b.runs.values())
            assert meanwhile is not None
            meanwhile()
            inside[0] += sum(len(r.text) for r in b.runs.values()) > before
        return decode(parts, copy, said if meanwhile else None)  # type: ignore[return-value]

    b.ctx.decode_many = counted  # type: ignore[method-assign]
    gone = [False]
    try:
        for i in range(5):
            b.add(i, reqs[i])
        cancelled = b.add(6, reqs[6], cancelled=lambda: gone[0])
        for n in b.drain():
            if n == 4:
                b.add(5, reqs[5])
            if n == 10:
                gone[0] = True
            if n == 11:
                assert cancelled not in b.loop.running.values()
        for i in range(6):
            assert b.runs[i].tokens == want[i].tokens, f"sequence {i} parted from its solo run"
            assert b.runs[i].text == want[i].text
        assert [e.logprob for lp in b.runs[3].logprobs for e in lp.entries] == \
            [e.logprob for lp in want[3].logprobs for e in lp.entries]
        for i in (4, 5):
            assert b.runs[i].result.done_reason == want[i].result.done_reason == "stop"  # type: ignore[union-attr]
        assert b.runs[6].result.done_reason == "cancel"  # type: ignore[union-attr]
        assert sum(b.runs[i].result.draft_accepted_tokens for i in range(6)) > 0  # type: ignore[union-attr]
        assert inside[0] > 10  # the text came out while decodes ran
        assert sum(b.loop.host.step.counts) >= b.loop.stats.steps - 1  # the host's fit learnt each step, a step late
    finally:
        del b.ctx.decode_many
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


@pytest.mark.parametrize(("shift", "overlap"), [(True, False), (False, False), (True, True)],
                         ids=["shift", "stop", "shift-overlapped"])
def test_padding_never_overflows_a_window(weights: Weights, shift: bool, overlap: bool) -> None:
    """Drafting sequences (so the step pads the others to their width) at the end of small windows:
    each shifts, or stops at `length`, exactly as alone, and none fails the step for the others
    (Open WebUI's long side requests once ended both streams of a batch with a 500 this way)."""
    reqs = [request(weights, i, n=300, shift=shift, num_keep=8) for i in (1, 3, 0)]
    want = [solo(weights, r, n_ctx=256) for r in reqs]
    b = Batch(weights, 3, n_ctx=256, ngram=True, overlap=overlap)
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

    def counted(parts: list[tuple[int, list[int], int]], copy: bool = True, meanwhile: object = None) -> list[object]:
        widths.append([len(t) for _, t, _ in parts])
        return decode(parts, copy, meanwhile)  # type: ignore[arg-type, return-value]

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

    def counted(parts: list[tuple[int, list[int], bool]], copy: bool = True, meanwhile: object = None) -> list[object]:
        widths.append(sum(len(t) for _, t, _ in parts))
        return decode(parts, copy, meanwhile)  # type: ignore[arg-type, return-value]

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


def test_a_prompt_chunk_adds_a_share_of_the_decoding_step() -> None:
    """Beside decoding rows, a chunk adds PREFILL_SHARE times the decoding step's price, at the
    cost model's price of a prompt row at the step's depth (within n_batch, MIN_CHUNK at least)."""
    cost = CostModel(13)
    cost.t_step = [0.0] + [0.010 + 0.005 * (n - 1) for n in range(1, 14)]
    cost.seed()
    loop = StepLoop.__new__(StepLoop)
    loop.target = type("Ctx", (), {"n_batch": 512})()  # type: ignore[assignment]
    step = cost.step(Layout(1, 8))
    per_token = cost.step(Layout(0, 0, 1))
    assert loop._chunk(cost, step, 0) == int(PREFILL_SHARE * step / per_token) > MIN_CHUNK
    assert loop._chunk(cost, 1e-9, 0) == MIN_CHUNK
    assert loop._chunk(cost, 100.0, 0) == 512  # n_batch


def test_each_decode_teaches_the_cost_model_its_layout(weights: Weights) -> None:
    """The layout the cost model learns from is the decode's: its rows, and the cells its deepest
    stream held before it (llama.cpp sizes a pass's attention by its deepest stream)."""
    b = Batch(weights, 2, ngram=True)
    seen: list[tuple[Layout, int, int]] = []  # (layout, the deepest stream before, rows decoded)
    observe = b.cost.observe_step
    decode = b.ctx.decode_many
    before: list[int] = []

    def counted(parts: list[tuple[int, list[int], bool]], copy: bool = True, meanwhile: object = None) -> list[object]:
        before[:] = [max(len(b.ctx.held(sid)) for sid in b.loop.running), sum(len(t) for _, t, _ in parts)]
        return decode(parts, copy, meanwhile)  # type: ignore[arg-type, return-value]

    def spy(layout: Layout, seconds: float) -> None:
        seen.append((layout, *before))
        observe(layout, seconds)

    b.ctx.decode_many = counted  # type: ignore[method-assign]
    b.cost.observe_step = spy  # type: ignore[method-assign]
    try:
        b.add(0, request(weights, 3, n=48))
        steps = b.drain()
        while len(seen) < 3:
            next(steps)
        b.add(1, request(weights, 1, n=24))
        list(steps)
        assert seen and all(layout.cells == deepest for layout, deepest, _ in seen)
        assert all(layout.rows + layout.prefill == rows for layout, _, rows in seen)
    finally:
        del b.ctx.decode_many
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
