"""One request being generated: a sequence that a step drives.

A `Sequence` holds everything of one request: its committed tokens, sampler, grammar, drafter and
counters, and its output. It never decodes. Each step it says which rows it needs scored next
(`rows`: a chunk of its prompt's prefill, one plain token, or a token with its drafted stretch),
takes those rows' logits back (`take`), verifies the draft against them, commits what holds and
updates its drafters; then says its output (`say`: text, stop strings), which the step loop may do
while the next decode runs. Between steps it tells the step loop (engine.step) how many positions
of its KV cache to keep (`kv_len`) and, when its window is full, what to shift. So the decode
calls, and the llama.cpp context they run on, belong to the step loop alone.

A round with no draft is a plain target step, so target-only decoding is the same code path with
k = 0; that is what makes speculative and plain output comparable token for token.

Prompt handling is the same on both paths: the prompt is prefilled in n_batch chunks (reusing any
cached prefix), and the last row of the chunk that ends it gives the first token, a plain round, as
in Ollama and llama-server: a streaming client sees it once the prompt is in, not after a first
draft's verification. The prompt's time runs to that token and the generation's from it, as
Ollama's runner counts them (runner/ollamarunner/runner.go, startGenerationTime). The pending
token (the last committed token, not yet in the KV cache) leads every verification batch.

Under a grammar (`format`) every row is masked with the grammar state it would have in plain
decoding: row i of a draft with the state after draft tokens 0..i-1 (a clone walked along the
draft), so a drafted token the grammar forbids has p = 0 and is rejected. The committed state
advances only by emitted tokens. A deferred grammar (`grammar_after`, Ollama holding `format` back
until a thinking model's thinking ends) applies from the token after the one whose text completes
the trigger; inside one verification the rows up to that token are unmasked and the later ones are
masked with a fresh state walked from there, exactly as plain decoding would mask them.

A full window is shifted (`shift`, engine.window) and stays lossless: after every round the
target's cache holds the committed tokens but the pending one (rejected drafts are rolled back) and
a draft never exceeds the room left, so the cache fills up at the same committed length with or
without drafts, holding the same entries, and the same (keep, discard) shift leaves the same cache.
llama.cpp then puts the next tokens in the freed cells in position order either way (the first free
cell from its head, which removing rejected drafts moves back to the first freed cell), so a batch
after a shift reads the cache exactly as plain steps do. Drafters only see the shifted context
(`Drafter.shift`); what they propose cannot change the output.

Logprobs (engine.logprobs), only when asked for, come from the row that scored each emitted token.

A drafter is held as a hybrid.HybridDrafter (a lone one as a hybrid of one). Each step the
sequence offers every ready source's draft (`menu`), the step's schedule picks one or none
(engine.schedule), and the sequence learns how the draft fared (engine.evidence). Pad rows
(engine.step) are copies of the pending token, never read, rolled back with the rejected drafts.
At the end the drafter learns the finished request (`finish`), so a cross-request cache has it.
"""

from __future__ import annotations

import time
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.cost import CostModel
from sidecar.engine.drafters import ModelDrafter, Proposal, Support, common_prefix
from sidecar.engine.evidence import Evidence
from sidecar.engine.grammar import DraftStates, Grammar
from sidecar.engine.hybrid import HybridDrafter
from sidecar.engine.llama import EngineError, Weights
from sidecar.engine.logprobs import Logprobs, TokenLogprob, token_logprob
from sidecar.engine.sampling import Sampler, SamplingParams
from sidecar.engine.schedule import PLAIN, Choice, Option
from sidecar.engine.tally import Tally
from sidecar.engine.text import TextStream, Trigger, renderer
from sidecar.engine.verify import verify, verify_greedy_rows
from sidecar.engine.window import shift_span, truncate_prompt
from sidecar.errors import ClientError


class PromptTooLong(EngineError, ClientError):
    """The prompt does not fit in the context window."""


class InvalidToken(EngineError, ClientError):
    """The prompt holds a token id outside the vocabulary (a client's `context` can)."""


@dataclass
class Result:
    """What a finished generation reports (Ollama's metrics plus speculation counters)."""

    tokens: list[int] = field(default_factory=list)  # generated tokens, end-of-generation excluded
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    eval_seconds: float = 0.0
    done_reason: str = "stop"  # stop | length | cancel
    draft_tokens: int = 0
    draft_accepted_tokens: int = 0
    draft_rounds: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # Per source of the drafter (its name, e.g. "ngram"): (tokens drafted, tokens accepted).
    drafts_by_source: dict[str, tuple[int, int]] = field(default_factory=dict)
    fallback: str | None = None
    drafter: str | None = None
    prompt_truncated: int = 0  # prompt tokens dropped to fit the window (prompt_tokens counts the rest)
    prompt_cached: int = 0  # prompt tokens whose KV was reused, not evaluated (prompt_tokens counts them too)
    shifts: int = 0  # context shifts during generation
    withdrawn: int = 0  # rounds the schedule stepped plain though a draft was ready, for the log line
    saved_seconds: float = 0.0  # what drafting saved against plain steps, by the cost model (Tally)


@dataclass
class Request:
    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_predict: int = -1  # -1: to end of generation (or a full window without `shift`); -2: to a full window
    stop: list[str] = field(default_factory=list)
    speculate: bool = True  # False forces target-only (Ollama's draft_num_predict: 0)
    n_max: int | None = None  # per-request cap on the draft length
    grammar: str | None = None  # GBNF the output must follow (Ollama's `format`, engine.grammar)
    logprobs: int | None = None  # None: off; N: each token's logprob and the N most likely (Logprobs items)
    truncate: bool = False  # cut a prompt that does not fit (Ollama's `truncate`) instead of refusing it
    num_keep: int = 4  # tokens after the BOS that truncation and shifting keep; -1: the whole prompt
    shift: bool = False  # shift a full window and go on (Ollama's context shift) instead of stopping
    grammar_after: str | None = None  # hold `grammar` back until the output's text contains this
    preserve: frozenset[int] = frozenset()  # control tokens emitted as their text (output parsers need them)
    lookup: list[int] | None = None  # the whole conversation where `prompt` was cut from it (HybridDrafter.begin)


Item = str | Logprobs | Result


@dataclass(frozen=True)
class Rows:
    """What a sequence needs scored next: `tokens`, decoded after the positions its KV cache keeps,
    in one llama_decode; `logits`, whether their rows are read (a prefill chunk's are not, `first`
    marks the one whose last row is); `shift`, a (keep, discard) the step loop applies first."""

    tokens: list[int]
    logits: bool = True
    shift: tuple[int, int] | None = None
    first: bool = False  # the prefill chunk that ends the prompt: its last row gives the first token

    @property
    def read(self) -> int:
        """How many rows, counted from the end, have their logits read."""
        return len(self.tokens) if self.logits else int(self.first)


@dataclass(frozen=True)
class Ask:
    """A model draft a round needs before its rows: drafted for every sequence of a step at once
    (drafters.propose_together)."""

    drafter: ModelDrafter
    context: list[int]
    k: int
    grammar: Grammar | None


@dataclass
class _Pending:
    """The round between `rows` and `take`: the step's choice, its draft and the proposal behind it."""

    choice: Choice
    draft: list[int]
    proposal: Proposal


class Sequence:
    """One request on a target, from the prompt to the Result (module docstring); `drafter`
    drafts when the request speculates and learns the finished request in any case."""

    def __init__(self, weights: Weights, n_ctx: int, n_batch: int, req: Request, drafter: HybridDrafter | None,
                 config: SpeculativeConfig, cost: CostModel, cancelled: Callable[[], bool] = lambda: False,
                 evidence: Evidence | None = None) -> None:
        self.weights, self.n_ctx, self.n_batch = weights, n_ctx, n_batch
        self.req = req
        self.learner = drafter
        self.drafter = drafter if req.speculate else None
        if req.n_max is not None:
            config = SpeculativeConfig(**{**config.__dict__, "n_max": min(config.n_max, req.n_max)})
        self.config, self.cost = config, cost
        # This request's view of the pair's acceptance evidence (engine.evidence.Belief).
        self.evidence = (evidence or Evidence(config.acceptance_prior, config.prior_weight)).request()
        self.cancelled = cancelled
        self.grammar = Grammar(weights, req.grammar) if req.grammar else None
        self.done: str | None = None
        self.kv_len = 0  # positions of the KV cache this sequence holds: its tokens but the pending one

    # -- the prompt --------------------------------------------------------------------------
    def _prompt(self) -> list[int]:
        """The prompt to decode: checked, and cut to fit the window when the request allows it."""
        req, weights = self.req, self.weights
        prompt = req.prompt
        if not prompt:
            raise EngineError("empty prompt")
        bad = next((t for t in prompt if not 0 <= t < weights.n_vocab), None)
        if bad is not None:  # llama.cpp would refuse the batch, after a prefill of everything before it
            raise InvalidToken(f"token id {bad} is not in the vocabulary (0 to {weights.n_vocab - 1})")
        if len(prompt) >= self.n_ctx and req.truncate:
            prompt = truncate_prompt(prompt, self.n_ctx, req.num_keep, weights.vocab_info().add_bos)
        if len(prompt) >= self.n_ctx:
            raise PromptTooLong(
                f"the prompt is {len(prompt)} tokens, the context holds {self.n_ctx} (raise num_ctx)"
            )
        return prompt

    def start(self, cached: abc.Sequence[int], fresh: int) -> int:
        """Begin on a KV cache that holds `cached` (its first `fresh` positions as a prefill would
        compute them): returns how many of them to keep, the prompt's reusable prefix."""
        req = self.req
        prompt = self._prompt()
        self.prompt = prompt
        self.result = Result(prompt_tokens=len(prompt), prompt_truncated=len(req.prompt) - len(prompt))
        self._t0 = time.perf_counter()
        keep = min(common_prefix(cached, prompt), fresh, len(prompt) - 1)
        self.result.prompt_cached = keep
        # What is left to prefill, in chunks of at most n_batch from `keep` on (as
        # llama.Context.prefill chunks); a shared step may take less of it at a time (`rows`).
        self._rest = prompt[keep:]
        self._taking = 0
        self.kv_len = keep
        self.sampler = Sampler(req.sampling, self.weights.n_vocab, self.n_ctx)
        self.tokens = list(prompt)  # committed and in the window; tokens[-1] is pending (not in the KV cache yet)
        self.history = list(prompt)  # committed, shifts or not: what the penalties look back over
        self.seen = list(req.lookup or req.prompt)  # ... and before any cut: what free drafters look up in
        drafter = self.drafter
        if drafter is not None:
            drafter.begin(self.sampler, self.seen)
            self.result.drafter = drafter.name
        self.tally = Tally(by_source={s.name: [0, 0] for s in drafter.sources} if drafter else {})
        self.enabled, self.fallback = drafter is not None, None
        if drafter is not None and 0 <= req.num_predict < self.config.min_predict:
            self.enabled = False
            self.fallback = f"short output: num_predict {req.num_predict} < {self.config.min_predict}"
        self._menu: list[Option] = []  # this round's options, until the step chose (`_say`)
        self._shifting: tuple[int, int] | None = None  # the shift `ready` made, for the next rows
        self.text = TextStream(req.stop)
        self.text_of = renderer(self.weights.piece, self.weights.special_piece, req.preserve)
        self.trigger = Trigger(req.grammar_after) if self.grammar is not None and req.grammar_after else None
        self.pending: list[TokenLogprob] = []  # logprobs of tokens whose text is not out yet
        self._unsaid: list[tuple[bytes, TokenLogprob | None]] = []  # committed, not yet said (`say`)
        self.limit = req.num_predict if req.num_predict >= 0 else float("inf")
        self._round: _Pending | None = None
        self._asked: Choice | None = None  # the model draft `rows` asked for (an Ask)
        self._t_gen: float | None = None  # when the first token came (module docstring)
        return keep

    @property
    def prefilling(self) -> bool:
        """Whether the prompt is still being prefilled (its rows carry no logits but the last one's)."""
        return bool(self._rest)

    # -- a step --------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether the sequence runs in this step; False once it is done (then `finish`): it ended,
        its client went away, or its window is full and may not shift. A full window that may
        shift is shifted here (the step loop applies the shift with the rows)."""
        if self._rest:
            return True
        if self.done is None and self.cancelled():
            self.done = "cancel"
        if self.done is None and self.kv_len >= self.n_ctx:  # no room for the pending token
            self._shifting = self._shift()
            if self._shifting is None:
                self.done = "length"
            else:
                self.result.shifts += 1
        return self.done is None

    def menu(self, room: int) -> tuple[Option, ...]:
        """What this round may draft (engine.schedule): each ready source's expected tokens at k =
        0..k_cap, at acceptances drawn from the evidence (engine.evidence), within `room` drafted
        tokens (what the step's n_batch leaves) and the window's."""
        drafter = self.drafter
        self._menu = []
        if drafter is None or not self.enabled or self._rest:
            return ()
        out = self.result.tokens
        k_cap = int(min(self.config.n_max, self.limit - len(out) - 1, room, self.n_ctx - self.kv_len - 1))
        if k_cap < self.config.n_min:
            return ()
        options, produced = [], len(out)
        # The tokens a catch-up is repaid over: at most `horizon` to go, times the share plain
        # steps made so far (a copying request's free sources leave a model little to speed up).
        share = 1.0 - self.tally.free_tokens / produced if produced >= 32 else 1.0
        future = min(self.limit - produced, self.config.horizon) * share
        for i, src in enumerate(drafter.sources):
            look = drafter.propose(i, self.tokens, 0, None)
            if not look.support.ready:
                continue
            # Slow start (evidence.Belief.cap), but for llama.cpp's rule, which drafts all it may.
            k = min(k_cap, self.evidence.cap(src.name)) if self.config.adaptive else k_cap
            expected = self._expected(src.name, look.support, k)
            options.append(Option(i, expected, src.has_cost, look.lag, future, id(self.cost)))
        self._menu = options
        return tuple(options)

    def _expected(self, name: str, support: Support, k: int) -> np.ndarray:
        """Tokens a round drafting 0..k tokens of this class emits (Leviathan et al.), each drafted
        token at a draw of its own class's acceptance (Support.along: a copy that holds becomes a
        longer one)."""
        draws: dict[int, float] = {}
        held, total, out = 1.0, 0.0, [1.0]  # floats: numpy's calls cost more than a few k's products
        for j in range(k):
            s = support if support.along is None else support.along(j)
            a = draws.get(s.cls)
            if a is None:
                a = draws[s.cls] = self.evidence.draw(name, s)
            held *= a  # the chance the draft holds through token j
            total += held
            out.append(1.0 + total)
        return np.array(out)

    def rows(self, choice: Choice = PLAIN, budget: int | None = None) -> Rows | Ask:
        """The rows to score next, for the round the step chose (engine.schedule). Where the round
        drafts from a model, an `Ask` for that draft instead: the step loop drafts for every
        sequence at once and hands the draft back (`drafted`), which gives the rows. `budget` caps
        a prefill chunk, so a long prompt comes in a bit per step while other sequences keep
        their pace."""
        if self._rest:
            n = min(len(self._rest), self.n_batch, budget or self.n_batch)
            self._taking = n
            last = n == len(self._rest)
            if last:  # the chunk that ends the prompt: its last row gives the first token, a plain round
                self._round = _Pending(PLAIN, [], Proposal())
            return Rows(self._rest[:n], logits=False, first=last)
        self._say(choice)
        if choice.k > 0 and self.drafter is not None:
            source = self.drafter.sources[choice.source]
            if isinstance(source, ModelDrafter):  # drafted with the other sequences' (engine.step)
                self._asked = choice
                return Ask(source, self.tokens, choice.k, self._live)
            return self._rows(choice, self.drafter.propose(choice.source, self.tokens, choice.k, self._live))
        return self._rows(PLAIN, Proposal())

    def _say(self, choice: Choice) -> None:
        """Why this round steps plain though a source had a draft ready (Result.fallback), or
        nothing once it drafts again."""
        if choice.k > 0:
            self.fallback = None
            return
        menu, self._menu = self._menu, []
        if not menu:
            return
        self.result.withdrawn += 1
        if self.fallback is None:
            best = max(menu, key=lambda o: o.expected[1])
            a = best.expected[1] - 1.0  # the drawn acceptance of its first token
            self.fallback = (f"draft does not pay: acceptance {a:.2f}" if a < 0.5
                             else "verification too costly on this hardware")

    def drafted(self, proposal: Proposal) -> Rows:
        """The rows for the round `rows` asked a model draft for (an `Ask`), now drafted."""
        assert self._asked is not None
        choice, self._asked = self._asked, None
        return self._rows(choice, proposal)

    @property
    def _live(self) -> Grammar | None:
        """The grammar that masks this round's rows, if one does yet (`grammar_after`)."""
        return self.grammar if self.trigger is None or self.trigger.fired else None

    def _rows(self, choice: Choice, proposal: Proposal) -> Rows:
        draft = proposal.tokens[: choice.k]
        self._round = _Pending(choice, draft, proposal)
        shift, self._shifting = self._shifting, None
        return Rows([self.tokens[-1], *draft], shift=shift)

    def full(self) -> None:
        """The KV cache had no room for the rows asked for: the generation ends there."""
        self._round = None
        self.done = "length"

    def take(self, logits: np.ndarray | None) -> None:
        """The rows' logits (None for a prefill chunk): verify and commit what they accept. Their
        text comes out of `say`, which the step loop may call while the next decode runs: the next
        rows need the tokens, not their text (engine.step)."""
        if self._rest:
            del self._rest[: self._taking]
            self.kv_len += self._taking
            if self._rest:
                return
        assert logits is not None and self._round is not None
        pending, self._round = self._round, None
        draft, proposal = pending.draft, pending.proposal
        tokens, history, out = self.tokens, self.history, self.result.tokens
        sampler, grammar, trigger, text_of = self.sampler, self.grammar, self.trigger, self.text_of
        window, greedy = sampler.history_window, sampler.params.greedy
        head = history[-window:] if window else []
        if greedy and grammar is None and not window:  # the choice is each row's plain argmax
            m, nxt = verify_greedy_rows(logits, draft)
        else:
            states = DraftStates(grammar, trigger, draft, text_of)

            def p_at(i: int) -> np.ndarray:
                seen = head + draft[:i] if window else head
                mask = states.at(i)
                # Greedy: the verifier only takes the argmax, so no one-hot vector is built.
                return (sampler.choice_logits if greedy else sampler.probs)(logits[i], seen, mask)

            try:
                m, nxt = verify(sampler, draft, proposal.q, p_at)
            finally:
                states.close()
        self.kv_len = len(tokens) + m  # keep the pending token and the accepted drafts
        if draft and self.drafter is not None:
            src = self.drafter.sources[pending.choice.source]
            support = proposal.support if proposal.support.ready else Support()
            self.evidence.observe(src.name, support, len(draft), m)
            self.tally.add(src.name, len(draft), m)
            if not src.has_cost:
                self.tally.free_tokens += m + 1
        for row, tok in enumerate((*draft[:m], nxt)):
            if self.weights.is_eog(tok):
                self.done = "stop"
                break
            if grammar is not None and (trigger is None or trigger.fired):
                grammar.accept(tok)
            raw = text_of(tok)
            if trigger is not None:
                trigger.feed(raw)  # a grammar that starts here applies from the next token on
            for committed in (tokens, history, self.seen, out):
                committed.append(tok)
            # Logprobs now: the rows are llama.cpp's buffer, which the next decode overwrites.
            want = self.req.logprobs
            self._unsaid.append((raw, None if want is None else token_logprob(logits[row], tok, want, text_of)))
            if len(out) >= self.limit:
                self.done = "length"
                break
        if self._t_gen is None:  # the first token: the prompt's time ends, the generation's begins
            self._t_gen = now = time.perf_counter()
            self.result.prompt_seconds = now - self._t0

    def say(self) -> list[Item]:
        """The output of the tokens `take` committed since: text held back while it may grow into a
        stop string, logprobs before their text. A stop string ends the generation where it
        completes; tokens committed after it (in its round) are not output."""
        items: list[Item] = []
        unsaid, self._unsaid = self._unsaid, []
        for i, (raw, logprob) in enumerate(unsaid):
            if logprob is not None:
                self.pending.append(logprob)
            piece, hit = self.text.feed(raw)
            if piece:
                if self.pending:
                    items.append(Logprobs(tuple(self.pending)))
                    self.pending.clear()
                items.append(piece)
            if hit:
                self.done = "stop"
                if after := len(unsaid) - 1 - i:
                    del self.result.tokens[-after:]
                break
        return items

    def finish(self) -> list[Item]:
        """The output still held back, then the Result; the drafter learns the request first (a
        consumer may stop reading at the Result)."""
        res, tally, done = self.result, self.tally, self.done
        assert done is not None
        items: list[Item] = []
        rest = self.text.flush()
        if done != "cancel":
            if self.pending:
                items.append(Logprobs(tuple(self.pending)))
            if rest:
                items.append(rest)
        now = time.perf_counter()
        if self._t_gen is None:  # ended before its first token: all its time was the prompt's
            res.prompt_seconds, self._t_gen = now - self._t0, now
        res.eval_seconds = now - self._t_gen
        res.done_reason = done
        res.draft_tokens, res.draft_accepted_tokens = tally.draft_tokens, tally.accepted_tokens
        res.draft_rounds = tally.rounds
        res.accepted_per_pos = list(tally.accepted_per_pos)
        res.drafts_by_source = {name: (d, a) for name, (d, a) in tally.by_source.items()}
        res.saved_seconds = tally.saved_seconds
        res.fallback = self.fallback
        if self.learner is not None:
            self.learner.finish(self.prompt, res.tokens, done)
        items.append(res)
        return items

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()

    def _shift(self) -> tuple[int, int] | None:
        """Make room for the pending token as llama-server does: the (keep, discard) to drop from the
        KV cache, or None when the request stops instead (shift off, num_predict -2 asks for one
        window, or the kept head leaves nothing to drop)."""
        req = self.req
        if not req.shift or req.num_predict == -2:
            return None
        add_bos = self.weights.vocab_info().add_bos
        keep, discard = shift_span(self.kv_len, self.n_ctx, req.num_keep, len(self.prompt), add_bos)
        if discard == 0:
            return None
        if self.drafter is not None:
            self.drafter.shift(self.tokens, keep, discard)
        del self.tokens[keep : keep + discard]
        self.kv_len -= discard
        return keep, discard

