"""The generation loop: prefill, then rounds of (draft, verify in one target decode, commit).

A round with no draft is a plain target step, so target-only decoding is the same code path with
k = 0; that is what makes speculative and plain output comparable token for token.

Prompt handling is fixed so both paths see bit-identical numerics: the prompt minus its last token
is prefilled in n_batch chunks (reusing any cached prefix), and the last prompt token is always
decoded together with the first round's draft (or alone). The pending token — the last committed
token, not yet in the KV cache — leads every verification batch.

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

Logprobs (engine.logprobs) come from the row that scored each emitted token, the verify batch's
under speculation; they are computed only when asked for.

A drafter is held as a hybrid.HybridDrafter (a lone one as a hybrid of one): the planner picks the
source of each round's draft. Where a batch of the previous decode's shape costs less (a GPU's
CUDA graphs, CostModel.t_same) the planner may ask for more rows than the draft fills: the rest are
copies of the pending token, whose rows are never read and whose cache entries are rolled back with
the rejected drafts, so they change nothing but the batch's shape. At the end the drafter is told
of the finished request (`finish`), speculative or not, so a cross-request cache learns it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from sidecar.engine.adaptive import CostModel, SpeculativeConfig
from sidecar.engine.drafters import Drafter, Proposal, common_prefix
from sidecar.engine.grammar import Grammar
from sidecar.engine.hybrid import HybridDrafter
from sidecar.engine.llama import Context, ContextFull, EngineError
from sidecar.engine.logprobs import Logprobs, TokenLogprob, token_logprob
from sidecar.engine.planner import Plan
from sidecar.engine.sampling import Sampler, SamplingParams
from sidecar.engine.text import TextStream, Trigger
from sidecar.engine.verify import verify_greedy, verify_rejection, verify_sample_and_match
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
    shifts: int = 0  # context shifts during generation


@dataclass
class Request:
    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # -1: until end of generation (or a full window without `shift`); -2: until the window is full
    num_predict: int = -1
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


class Decoder:
    """Generates from one target Context, optionally with a drafter. Runs on the context's thread."""

    def __init__(
        self,
        target: Context,
        drafter: Drafter | HybridDrafter | None = None,
        config: SpeculativeConfig | None = None,
        cost: CostModel | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter if drafter is None or isinstance(drafter, HybridDrafter) else HybridDrafter([drafter])
        self.config = config or SpeculativeConfig()
        self.cost = cost or CostModel(self.config.n_max + 1)

    def generate(
        self, req: Request, cancelled: Callable[[], bool] = lambda: False
    ) -> Iterator[str | Logprobs | Result]:
        """Yield text pieces as they are final, then one Result; with `logprobs`, a Logprobs item
        before the text of the tokens it describes."""
        grammar = Grammar(self.target.weights, req.grammar) if req.grammar else None
        try:
            yield from self._generate(req, cancelled, grammar)
        finally:
            if grammar is not None:
                grammar.close()

    def _prompt(self, req: Request) -> list[int]:
        """The prompt to decode: checked, and cut to fit the window when the request allows it."""
        target, weights = self.target, self.target.weights
        prompt = req.prompt
        if not prompt:
            raise EngineError("empty prompt")
        bad = next((t for t in prompt if not 0 <= t < weights.n_vocab), None)
        if bad is not None:  # llama.cpp would refuse the batch, after a prefill of everything before it
            raise InvalidToken(f"token id {bad} is not in the vocabulary (0 to {weights.n_vocab - 1})")
        if len(prompt) >= target.n_ctx and req.truncate:
            prompt = truncate_prompt(prompt, target.n_ctx, req.num_keep, weights.vocab_info().add_bos)
        if len(prompt) >= target.n_ctx:
            raise PromptTooLong(
                f"the prompt is {len(prompt)} tokens, the context holds {target.n_ctx} (raise num_ctx)"
            )
        return prompt

    def _generate(
        self, req: Request, cancelled: Callable[[], bool], grammar: Grammar | None
    ) -> Iterator[str | Logprobs | Result]:
        target, weights = self.target, self.target.weights
        prompt = self._prompt(req)
        res = Result(prompt_tokens=len(prompt), prompt_truncated=len(req.prompt) - len(prompt))
        t0 = time.perf_counter()
        keep = min(common_prefix(target.tokens, prompt), target.fresh, len(prompt) - 1)
        target.truncate(keep)
        target.prefill(prompt[keep:-1])
        res.prompt_seconds = time.perf_counter() - t0

        sampler = Sampler(req.sampling, weights.n_vocab, target.n_ctx)
        drafter = self.drafter if req.speculate else None
        config = self.config
        if req.n_max is not None:
            config = SpeculativeConfig(**{**config.__dict__, "n_max": min(config.n_max, req.n_max)})
        tokens = list(prompt)  # committed and in the window; tokens[-1] is pending (not in the KV cache yet)
        history = list(prompt)  # committed, shifts or not: what the penalties look back over
        if drafter is not None:
            drafter.begin(sampler)
            res.drafter = drafter.name
        plan = Plan.start(config, self.cost, drafter.plan_sources(tokens) if drafter else [], req.num_predict)
        window = sampler.history_window
        greedy = sampler.params.greedy
        out = res.tokens
        text = TextStream(req.stop)
        text_of = _renderer(weights.piece, weights.special_piece, req.preserve)
        trigger = Trigger(req.grammar_after) if grammar is not None and req.grammar_after else None
        pending: list[TokenLogprob] = []  # logprobs of tokens whose text is not out yet
        limit = req.num_predict if req.num_predict >= 0 else float("inf")
        t_gen = time.perf_counter()
        done: str | None = None
        while done is None:
            if cancelled():
                done = "cancel"
                break
            if len(target.tokens) >= target.n_ctx:  # no room for the pending token
                if not self._shift(req, tokens, len(prompt), drafter):
                    done = "length"
                    break
                res.shifts += 1
            room = target.n_ctx - len(target.tokens) - 1
            live = grammar if trigger is None or trigger.fired else None
            k = plan.draft_length(len(out), limit - len(out), room)
            proposal = drafter.propose(plan.source, tokens, k, live) if k > 0 and drafter else Proposal()
            draft = proposal.tokens[:k]
            batch = [tokens[-1], *draft]
            if draft and plan.rows > len(batch):  # the stretch's shape (see the module docstring)
                batch += [tokens[-1]] * (plan.rows - len(batch))
            t_v = time.perf_counter()
            try:
                logits = target.decode(batch)
            except ContextFull:
                done = "length"
                break
            verify_seconds = time.perf_counter() - t_v
            head = history[-window:] if window else []
            states = _DraftStates(grammar, trigger, draft, text_of)

            def p_at(i: int, logits: np.ndarray = logits, head: list[int] = head, draft: list[int] = draft,
                     states: _DraftStates = states):
                seen = head + draft[:i] if window else head
                mask = states.at(i)
                if greedy:  # the verifier only takes the argmax: skip building the one-hot vector
                    return sampler.choice_logits(logits[i], seen, mask)
                return sampler.probs(logits[i], seen, mask)

            try:
                m, nxt = self._verify(sampler, draft, proposal, p_at)
            finally:
                states.close()
            target.truncate(len(tokens) + m)  # keep the pending token and the accepted drafts
            plan.record(len(draft), m, proposal.seconds, verify_seconds, len(out), proposal.step_seconds,
                        proposal.caught_up, len(batch))
            for row, tok in enumerate((*draft[:m], nxt)):
                if weights.is_eog(tok):
                    done = "stop"
                    break
                if grammar is not None and (trigger is None or trigger.fired):
                    grammar.accept(tok)
                raw = text_of(tok)
                if trigger is not None:
                    trigger.feed(raw)  # a grammar that starts here applies from the next token on
                tokens.append(tok)
                history.append(tok)
                out.append(tok)
                if req.logprobs is not None:
                    pending.append(token_logprob(logits[row], tok, req.logprobs, text_of))
                piece, hit = text.feed(raw)
                if piece:
                    if pending:
                        yield Logprobs(tuple(pending))
                        pending.clear()
                    yield piece
                if hit:
                    done = "stop"
                    break
                if len(out) >= limit:
                    done = "length"
                    break
        rest = text.flush()
        if done != "cancel":
            if pending:
                yield Logprobs(tuple(pending))
            if rest:
                yield rest
        res.eval_seconds = time.perf_counter() - t_gen
        res.done_reason = done
        res.draft_tokens = plan.draft_tokens
        res.draft_accepted_tokens = plan.accepted_tokens
        res.draft_rounds = plan.rounds
        res.accepted_per_pos = list(plan.accepted_per_pos)
        res.drafts_by_source = {name: (d, a) for name, (d, a) in plan.by_source.items()}
        res.fallback = plan.fallback if drafter else None
        if self.drafter is not None:  # before the Result: a consumer may stop reading at it
            self.drafter.finish(prompt, out, done)
        yield res

    def _shift(self, req: Request, tokens: list[int], n_prompt: int, drafter: HybridDrafter | None) -> bool:
        """Make room for the pending token as llama-server does; False when the request stops instead
        (shift off, num_predict -2 asks for one window, or the kept head leaves nothing to drop)."""
        target = self.target
        if not req.shift or req.num_predict == -2:
            return False
        add_bos = target.weights.vocab_info().add_bos
        keep, discard = shift_span(len(target.tokens), target.n_ctx, req.num_keep, n_prompt, add_bos)
        if discard == 0:
            return False
        if drafter is not None:
            drafter.shift(tokens, keep, discard)
        target.shift(keep, discard)
        del tokens[keep : keep + discard]
        return True

    @staticmethod
    def _verify(
        sampler: Sampler, draft: Sequence[int], proposal: Proposal, p_at: Callable[[int], np.ndarray]
    ) -> tuple[int, int]:
        if sampler.params.greedy:
            return verify_greedy(draft, p_at)
        if not draft:
            return 0, sampler.draw(p_at(0))
        if proposal.q is not None:
            return verify_rejection(draft, proposal.q, p_at, sampler.rng)
        return verify_sample_and_match(draft, p_at, sampler.rng)


def _renderer(piece: Callable[[int], bytes], special: Callable[[int], bytes],
              preserve: frozenset[int]) -> Callable[[int], bytes]:
    """A token's output bytes: its special rendering for the `preserve` ids, its plain piece otherwise."""
    if not preserve:
        return piece
    return lambda tok: special(tok) if tok in preserve else piece(tok)


class _DraftStates:
    """Grammar states for the rows of one verification: row i sees the state after draft[:i].

    The verifiers ask for rows in order and stop at the first rejection, so one clone walked
    forward serves every row, and it only ever accepts draft tokens already verified. A deferred
    grammar not started yet masks no row until a draft token completes its trigger (a copy of the
    committed watcher walks the draft); the rows after it get the grammar's start state walked from
    there."""

    def __init__(self, grammar: Grammar | None, trigger: Trigger | None, draft: Sequence[int],
                 text_of: Callable[[int], bytes]) -> None:
        self.grammar = grammar
        self.draft = draft
        self._text_of = text_of
        # Set while the grammar has not started by the row being walked to.
        self._watch = trigger.copy() if trigger is not None and not trigger.fired else None
        self._walker: Grammar | None = None
        self._walked = 0

    def at(self, i: int) -> Grammar | None:
        if self.grammar is None:
            return None
        while self._walked < i:
            tok = self.draft[self._walked]
            self._walked += 1
            if self._watch is None:
                if self._walker is None:
                    self._walker = self.grammar.clone()
                self._walker.accept(tok)
            elif self._watch.feed(self._text_of(tok)):
                self._watch = None  # the grammar applies from the next row on, from its start state
        if self._watch is not None:
            return None
        return self._walker if self._walker is not None else self.grammar

    def close(self) -> None:
        if self._walker is not None:
            self._walker.close()
