"""A deferred grammar (`grammar_after`) and preserved control tokens (`preserve`), lossless under speculation.

Ollama holds a `format` back until a thinking model's thinking ends; here the grammar starts with the
token after the one whose text completes the trigger. Drafts that cross the trigger inside one verify
batch must see the rows before it unmasked and the rows after it masked from the grammar's start.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.cost import CostModel
from sidecar.engine.decoder import Decoder, Request, Result
from sidecar.engine.drafters import Drafter, ModelDrafter, NgramDrafter, Proposal, Support
from sidecar.engine.grammar import Grammar, gbnf_for_format
from sidecar.engine.llama import Context, Weights
from sidecar.engine.logprobs import Logprobs
from sidecar.engine.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0)
JSON = gbnf_for_format("json")


def generate(ctx: Context, drafter: Drafter | None, prompt: list[int], n: int, n_max: int = 8,
             **kw: object) -> tuple[str, Result, list[object]]:
    ctx.clear()
    config = SpeculativeConfig(n_max=n_max, p_min=0.0, min_predict=0, adaptive=False)
    request = Request(prompt, GREEDY, num_predict=n, **kw)  # type: ignore[arg-type]
    items: list[object] = list(Decoder(ctx, drafter, config, CostModel(n_max + 1)).generate(request))
    result = items[-1]
    assert isinstance(result, Result)
    return "".join(it for it in items if isinstance(it, str)), result, items


class Oracle:
    """Drafts a known continuation of the prompt, and remembers where each draft started."""

    name = "oracle"
    has_cost = False

    def __init__(self, tokens: Sequence[int], n_prompt: int) -> None:
        self.tokens = list(tokens)
        self.n_prompt = n_prompt
        self.drafts: list[tuple[int, int]] = []  # (output index of the first drafted token, length)

    def begin(self, sampler: Sampler) -> None:
        self.drafts.clear()

    def propose(self, context: Sequence[int], max_tokens: int, grammar: Grammar | None = None) -> Proposal:
        at = len(context) - self.n_prompt
        draft = self.tokens[at : at + max_tokens]
        if max_tokens:  # not the planner's look, which drafts nothing
            self.drafts.append((at, len(draft)))
        return Proposal(draft, Support())

    def shift(self, context: Sequence[int], keep: int, discard: int) -> None:
        raise AssertionError("no shift here")


def completed_at(w: Weights, tokens: Sequence[int], needle: str) -> int:
    """Index of the token whose text first completes `needle`."""
    return next(i for i in range(len(tokens)) if needle in b"".join(map(w.piece, tokens[: i + 1])).decode())


@pytest.fixture(scope="module")
def case(tiny_engines: tuple[Weights, Context, Context]) -> tuple[list[int], list[int], str, int]:
    """(prompt, unconstrained greedy output, a trigger taken from it, where it completes)."""
    w, ctx, _ = tiny_engines
    prompt = w.tokenize("think first, then answer in JSON", add_special=True, parse_special=False)
    text, plain, _ = generate(ctx, None, prompt, 60)
    trigger = text[10:13]
    at = completed_at(w, plain.tokens, trigger)
    assert 9 <= at < 20 and "{" not in text[:at]
    return prompt, plain.tokens, trigger, at


def test_grammar_starts_after_the_trigger(tiny_engines: tuple[Weights, Context, Context],
                                          case: tuple[list[int], list[int], str, int]) -> None:
    w, ctx, _ = tiny_engines
    prompt, free, trigger, at = case
    text, held, _ = generate(ctx, None, prompt, 60, grammar=JSON, grammar_after=trigger)
    assert held.tokens[: at + 1] == free[: at + 1]  # unconstrained up to the trigger's last token
    assert held.tokens[at + 1 :] != free[at + 1 :]
    g = Grammar(w, JSON or "")
    try:
        for tok in held.tokens[at + 1 :]:  # and the grammar's from its start state after it
            g.accept(tok)
    finally:
        g.close()
    assert text[len(b"".join(map(w.piece, free[: at + 1])).decode()) :].startswith("{")
    # A trigger that never comes leaves the output unconstrained.
    _, never, _ = generate(ctx, None, prompt, 60, grammar=JSON, grammar_after="never said")
    assert never.tokens == free


def test_speculation_across_the_trigger_is_lossless(tiny_engines: tuple[Weights, Context, Context],
                                                    case: tuple[list[int], list[int], str, int]) -> None:
    _, ctx, dctx = tiny_engines
    prompt, free, trigger, at = case
    _, held, _ = generate(ctx, None, prompt, 60, grammar=JSON, grammar_after=trigger)
    for drafter in (NgramDrafter(1, 3), ModelDrafter(dctx)):
        _, spec, _ = generate(ctx, drafter, prompt, 60, grammar=JSON, grammar_after=trigger)
        assert spec.tokens == held.tokens, drafter.name
    # Drafting the constrained output itself: every row must agree, the unmasked ones before the
    # trigger and the masked ones after it, so every drafted token is accepted.
    right = Oracle(held.tokens, len(prompt))
    _, spec, _ = generate(ctx, right, prompt, 60, grammar=JSON, grammar_after=trigger)
    assert spec.tokens == held.tokens and spec.draft_accepted_tokens == spec.draft_tokens
    assert any(start <= at < start + n - 1 for start, n in right.drafts), "no draft crossed the trigger"
    # Drafting the unconstrained output: accepted up to the trigger, rejected where the grammar starts.
    wrong = Oracle(free, len(prompt))
    _, spec, _ = generate(ctx, wrong, prompt, 60, grammar=JSON, grammar_after=trigger)
    assert spec.tokens == held.tokens and spec.draft_accepted_tokens < spec.draft_tokens
    assert any(start <= at < start + n - 1 for start, n in wrong.drafts)


def test_preserved_control_tokens_are_emitted_as_text(tiny_engines: tuple[Weights, Context, Context]) -> None:
    w, ctx, _ = tiny_engines
    im_start = w.special_ids(["<|im_start|>"])
    assert im_start == [260] and w.special_ids(["<|im_end|>", "two tokens", ""]) == [261]
    assert w.piece(260) == b"" and w.special_piece(260) == b"<|im_start|>"
    prompt = w.tokenize("control", add_special=True, parse_special=False)
    forced = 'root ::= "ab" <|im_start|> "cd"'  # the grammar makes the model say the control token
    hidden, r1, _ = generate(ctx, None, prompt, 20, grammar=forced)
    shown, r2, items = generate(ctx, NgramDrafter(1, 3), prompt, 20, grammar=forced, preserve=frozenset(im_start),
                                logprobs=0)
    assert hidden == "abcd" and shown == "ab<|im_start|>cd" and r1.tokens == r2.tokens
    assert [e.token for it in items if isinstance(it, Logprobs) for e in it.entries][2] == "<|im_start|>"


def test_smollm2_trigger_on_a_preserved_control_token(smollm2_engines: tuple[Weights, Context, Context]) -> None:
    """SmolLM2 left at the end of a user turn opens the assistant's turn itself, with <|im_start|>: a
    trigger that includes that control token's text fires only when it is preserved."""
    w, ctx, dctx = smollm2_engines
    prompt = w.tokenize("<|im_start|>user\nGive me a JSON object with your name.<|im_end|>\n",
                        add_special=False, parse_special=True)
    keep = frozenset(w.special_ids(["<|im_start|>"]))
    held = {"grammar": JSON, "grammar_after": "<|im_start|>assistant\n", "preserve": keep}
    text, plain, _ = generate(ctx, None, prompt, 60, **held)
    assert text.startswith("<|im_start|>assistant\n{") and plain.done_reason == "stop"
    for drafter in (NgramDrafter(1, 3), ModelDrafter(dctx)):
        _, spec, _ = generate(ctx, drafter, prompt, 60, n_max=4, **held)
        assert spec.tokens == plain.tokens, drafter.name
    unseen, _, _ = generate(ctx, None, prompt, 60, grammar=JSON, grammar_after="<|im_start|>assistant\n")
    assert unseen.startswith("assistant\n") and "{" not in unseen[:12]  # the trigger never fired
