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
advances only by emitted tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from sidecar.engine.adaptive import CostModel, Plan, SpeculativeConfig
from sidecar.engine.drafters import Drafter, Proposal, common_prefix
from sidecar.engine.grammar import Grammar
from sidecar.engine.llama import Context, ContextFull, EngineError
from sidecar.engine.sampling import Sampler, SamplingParams
from sidecar.engine.text import TextStream
from sidecar.engine.verify import verify_greedy, verify_rejection, verify_sample_and_match
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
    fallback: str | None = None
    drafter: str | None = None


@dataclass
class Request:
    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_predict: int = -1  # -1: until end of generation or the context is full
    stop: list[str] = field(default_factory=list)
    speculate: bool = True  # False forces target-only (Ollama's draft_num_predict: 0)
    n_max: int | None = None  # per-request cap on the draft length
    grammar: str | None = None  # GBNF the output must follow (Ollama's `format`, engine.grammar)


class Decoder:
    """Generates from one target Context, optionally with a drafter. Runs on the context's thread."""

    def __init__(
        self,
        target: Context,
        drafter: Drafter | None = None,
        config: SpeculativeConfig | None = None,
        cost: CostModel | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.config = config or SpeculativeConfig()
        self.cost = cost or CostModel(self.config.n_max + 1)

    def generate(self, req: Request, cancelled: Callable[[], bool] = lambda: False) -> Iterator[str | Result]:
        """Yield text pieces as they are final, then one Result."""
        grammar = Grammar(self.target.weights, req.grammar) if req.grammar else None
        try:
            yield from self._generate(req, cancelled, grammar)
        finally:
            if grammar is not None:
                grammar.close()

    def _generate(self, req: Request, cancelled: Callable[[], bool], grammar: Grammar | None) -> Iterator[str | Result]:
        target, weights = self.target, self.target.weights
        prompt = req.prompt
        if not prompt:
            raise EngineError("empty prompt")
        bad = next((t for t in prompt if not 0 <= t < weights.n_vocab), None)
        if bad is not None:  # llama.cpp would refuse the batch, after a prefill of everything before it
            raise InvalidToken(f"token id {bad} is not in the vocabulary (0 to {weights.n_vocab - 1})")
        if len(prompt) >= target.n_ctx:
            raise PromptTooLong(
                f"the prompt is {len(prompt)} tokens, the context holds {target.n_ctx} (raise num_ctx)"
            )
        res = Result(prompt_tokens=len(prompt))
        t0 = time.perf_counter()
        keep = min(common_prefix(target.tokens, prompt), len(prompt) - 1)
        target.truncate(keep)
        target.prefill(prompt[keep:-1])
        res.prompt_seconds = time.perf_counter() - t0

        sampler = Sampler(req.sampling, weights.n_vocab, target.n_ctx)
        drafter = self.drafter if req.speculate else None
        config = self.config
        if req.n_max is not None:
            config = SpeculativeConfig(**{**config.__dict__, "n_max": min(config.n_max, req.n_max)})
        plan = Plan.start(config, self.cost, drafter.has_cost if drafter else False, req.num_predict)
        if drafter is None:
            plan.enabled = False
        else:
            drafter.begin(sampler)
            res.drafter = drafter.name
        window = sampler.history_window
        greedy = sampler.params.greedy
        tokens = list(prompt)  # committed; tokens[-1] is pending (not in the KV cache yet)
        if drafter is not None:
            plan.lag = partial(drafter.lag, tokens)
            plan.support = partial(drafter.support, tokens)
        out = res.tokens
        text = TextStream(req.stop)
        limit = req.num_predict if req.num_predict >= 0 else float("inf")
        t_gen = time.perf_counter()
        done: str | None = None
        while done is None:
            if cancelled():
                done = "cancel"
                break
            room = target.n_ctx - len(target.tokens) - 1
            if room < 0:
                done = "length"
                break
            k = plan.draft_length(len(out), limit - len(out), room)
            proposal = drafter.propose(tokens, k, grammar) if k > 0 and drafter else Proposal()
            draft = proposal.tokens[:k]
            t_v = time.perf_counter()
            try:
                logits = target.decode([tokens[-1], *draft])
            except ContextFull:
                done = "length"
                break
            verify_seconds = time.perf_counter() - t_v
            head = tokens[-window:] if window else []
            states = _DraftStates(grammar, draft)

            def p_at(i: int, logits: np.ndarray = logits, head: list[int] = head, draft: list[int] = draft,
                     states: _DraftStates = states):
                history = head + draft[:i] if window else head
                mask = states.at(i)
                if greedy:  # the verifier only takes the argmax: skip building the one-hot vector
                    return sampler.choice_logits(logits[i], history, mask)
                return sampler.probs(logits[i], history, mask)

            try:
                m, nxt = self._verify(sampler, draft, proposal, p_at)
            finally:
                states.close()
            target.truncate(len(tokens) + m)  # keep the pending token and the accepted drafts
            plan.record(len(draft), m, proposal.seconds, verify_seconds, len(out), proposal.step_seconds,
                        proposal.caught_up)
            for tok in (*draft[:m], nxt):
                if weights.is_eog(tok):
                    done = "stop"
                    break
                if grammar is not None:
                    grammar.accept(tok)
                tokens.append(tok)
                out.append(tok)
                piece, hit = text.feed(weights.piece(tok))
                if piece:
                    yield piece
                if hit:
                    done = "stop"
                    break
                if len(out) >= limit:
                    done = "length"
                    break
        rest = text.flush()
        if rest and done != "cancel":
            yield rest
        res.eval_seconds = time.perf_counter() - t_gen
        res.done_reason = done
        res.draft_tokens = plan.draft_tokens
        res.draft_accepted_tokens = plan.accepted_tokens
        res.draft_rounds = plan.rounds
        res.accepted_per_pos = list(plan.accepted_per_pos)
        res.fallback = plan.fallback if drafter else None
        yield res

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


class _DraftStates:
    """Grammar states for the rows of one verification: row i sees the state after draft[:i].

    The verifiers ask for rows in order and stop at the first rejection, so one clone walked
    forward serves every row, and it only ever accepts draft tokens already verified."""

    def __init__(self, grammar: Grammar | None, draft: Sequence[int]) -> None:
        self.grammar = grammar
        self.draft = draft
        self._walker: Grammar | None = None
        self._walked = 0

    def at(self, i: int) -> Grammar | None:
        if self.grammar is None or i == 0:
            return self.grammar
        if self._walker is None:
            self._walker = self.grammar.clone()
        while self._walked < i:
            self._walker.accept(self.draft[self._walked])
            self._walked += 1
        return self._walker

    def close(self) -> None:
        if self._walker is not None:
            self._walker.close()
