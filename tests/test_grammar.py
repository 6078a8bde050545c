"""Structured output in the engine: a grammar constrains the target, and speculation stays lossless under it.

Real llama.cpp grammars on real models: the tiny generated pair (byte vocabulary, so the grammar
decides every character) and SmolLM2 with the n-gram and a model drafter. The checks: output follows
the schema, greedy speculative output equals greedy target-only output with the same grammar, and a
drafted token the grammar forbids is rejected.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.cost import CostModel
from sidecar.engine.decoder import Decoder, Request, Result
from sidecar.engine.drafters import Drafter, ModelDrafter, NgramDrafter, Proposal, Support
from sidecar.engine.grammar import Grammar, GrammarError, gbnf_for_format
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.sampling import Sampler, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from derive_models import extend

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0)
# llama-cpp-python 0.3.36's converter ignores length and range bounds (maxLength, maximum,
# maxItems), so the schema sticks to what it enforces: types, required keys, enums, consts.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "n": {"type": "integer"},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "bc"]},
    },
    "required": ["city", "n", "ok", "kind"],
}
# A random model sampled at temperature 1 rarely closes a free string: no strings here.
CLOSED = {**SCHEMA, "properties": {k: v for k, v in SCHEMA["properties"].items() if k != "city"},
          "required": ["n", "ok", "kind"]}


def generate(ctx: Context, drafter: Drafter | None, prompt: list[int], fmt: str | dict | None,
             params: SamplingParams = GREEDY, n: int = 160, n_max: int = 4) -> tuple[str, Result]:
    ctx.clear()
    config = SpeculativeConfig(n_max=n_max, p_min=0.0, min_predict=0, adaptive=False)
    req = Request(prompt, params, num_predict=n, grammar=gbnf_for_format(fmt))
    out = list(Decoder(ctx, drafter, config, CostModel(n_max + 1)).generate(req))
    result = out[-1]
    assert isinstance(result, Result)
    return "".join(str(p) for p in out[:-1]), result


def test_format_to_gbnf() -> None:
    assert gbnf_for_format(None) is None and gbnf_for_format("") is None
    assert "root" in (gbnf_for_format("json") or "")
    assert "root ::=" in (gbnf_for_format(SCHEMA) or "")
    for bad in ({"type": "nonsense"}, {"$ref": "#/nowhere"}, "yaml"):
        with pytest.raises(GrammarError):
            gbnf_for_format(bad)


def test_grammar_masks_and_advances(tiny_engines: tuple[Weights, Context, Context]) -> None:
    w = tiny_engines[0]
    g = Grammar(w, gbnf_for_format("json") or "")
    brace, letter = w.tokenize("{", add_special=False, parse_special=False)[0], w.tokenize(
        "x", add_special=False, parse_special=False)[0]
    assert g.allows(brace) and not g.allows(letter)
    clone = g.clone()
    clone.accept(brace)
    assert not clone.allows(brace) and g.allows(brace)  # the clone moved, the original did not
    with pytest.raises(Exception, match="not allowed"):
        g.accept(letter)  # refused in Python: llama.cpp itself would abort the process
    for x in (clone, g):
        x.close()
    with pytest.raises(GrammarError):
        Grammar(w, "root ::= undefined-rule")


def test_masked_sampling_matches_full_mask(tiny_engines: tuple[Weights, Context, Context]) -> None:
    """The lazy masks (argmax first, top-k candidates first) give exactly the fully masked distribution."""
    w, ctx, _ = tiny_engines
    g = Grammar(w, gbnf_for_format(SCHEMA) or "")
    ctx.clear()
    logits = ctx.decode(w.tokenize("some prompt", add_special=True, parse_special=False))[-1]
    ids = np.arange(w.n_vocab, dtype=np.int32)
    full = np.where(g.allowed(ids), logits, -np.inf).astype(np.float32)
    for params in (GREEDY, SamplingParams(temperature=0.9, top_k=3), SamplingParams(temperature=0.9, top_k=0)):
        s = Sampler(params, w.n_vocab, 512)
        assert np.array_equal(s.probs(logits, [], g), s.probs(full, []))
    g.close()


def tiny_prompt(w: Weights, i: int) -> list[int]:
    return w.tokenize(f"<|im_start|>user\nrecord {i}<|im_end|>\n<|im_start|>assistant\n",
                      add_special=True, parse_special=True)


def test_tiny_greedy_lossless_and_valid(tiny_engines: tuple[Weights, Context, Context]) -> None:
    w, ctx, dctx = tiny_engines
    for i in range(6):
        prompt = tiny_prompt(w, i)
        plain_text, plain = generate(ctx, None, prompt, SCHEMA)
        assert plain.done_reason == "stop", plain_text
        jsonschema.validate(json.loads(plain_text), SCHEMA)
        for drafter in (ModelDrafter(dctx), NgramDrafter(1, 3)):
            _text, spec = generate(ctx, drafter, prompt, SCHEMA)
            assert spec.tokens == plain.tokens, f"record {i} with {drafter.name}"
            assert spec.draft_rounds > 0


def test_tiny_sampled_output_follows_schema(tiny_engines: tuple[Weights, Context, Context]) -> None:
    w, ctx, dctx = tiny_engines
    accepted = 0
    for seed in range(6):
        for drafter in (ModelDrafter(dctx), NgramDrafter(1, 3), None):
            params = SamplingParams(temperature=1.0, seed=seed)
            text, r = generate(ctx, drafter, tiny_prompt(w, seed), CLOSED, params)
            assert r.done_reason == "stop", text
            jsonschema.validate(json.loads(text), CLOSED)
            accepted += r.draft_accepted_tokens
    assert accepted > 0


class Forbidden:
    """A drafter that always proposes text the grammar forbids at that point (letters outside strings)."""

    name = "forbidden"
    has_cost = False

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)

    def begin(self, sampler: Sampler) -> None:
        pass

    def propose(self, context: Sequence[int], max_tokens: int, grammar: Grammar | None = None) -> Proposal:
        return Proposal(self.tokens[:max_tokens], Support())


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, seed=5)])
def test_forbidden_drafts_are_rejected(tiny_engines: tuple[Weights, Context, Context],
                                       params: SamplingParams) -> None:
    w, ctx, _ = tiny_engines
    prompt = tiny_prompt(w, 0)
    _plain_text, plain = generate(ctx, None, prompt, "json", params, n=24)
    text, spec = generate(ctx, Forbidden(w.tokenize("xyz}}", add_special=False, parse_special=False)),
                          prompt, "json", params, n=24)
    assert text.startswith("{") and spec.draft_tokens > 0
    if params.greedy:
        assert spec.tokens == plain.tokens
    assert spec.draft_accepted_tokens < spec.draft_tokens


# -- SmolLM2: a real vocabulary, where one token spans several grammar characters -----------------
@pytest.fixture(scope="module")
def smol(smollm2: Path, model_dir: Path) -> Iterator[tuple[Weights, Context, Context]]:
    path = model_dir / "smollm2-perturbed.gguf"  # the draft test_lossless builds (shared per session)
    if not path.exists():
        extend(smollm2, path, extra_layers=2, eps=0.0, eps_layers={1: 0.75})
    w, dw = Weights(smollm2, n_gpu_layers=0), Weights(path, n_gpu_layers=0)
    ctx, dctx = Context(w, ContextParams(n_ctx=1024)), Context(dw, ContextParams(n_ctx=1024))
    yield w, ctx, dctx
    for x in (dctx, ctx, dw, w):
        x.close()


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "hobbies"],
}


def smol_prompt(w: Weights) -> list[int]:
    text = "Describe Alice, 30, who likes chess and tennis, as JSON with name, age and hobbies."
    return w.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                      add_special=False, parse_special=True)


def test_smollm2_schema_greedy_lossless(smol: tuple[Weights, Context, Context]) -> None:
    w, ctx, dctx = smol
    prompt = smol_prompt(w)
    plain_text, plain = generate(ctx, None, prompt, PERSON, n=64)
    assert plain.done_reason == "stop", plain_text
    jsonschema.validate(json.loads(plain_text), PERSON)
    for drafter in (NgramDrafter(1, 3), ModelDrafter(dctx)):
        _text, spec = generate(ctx, drafter, prompt, PERSON, n=64)
        assert spec.tokens == plain.tokens, drafter.name
        assert spec.draft_accepted_tokens > 0, drafter.name


def test_smollm2_json_sampled_with_model_draft(smol: tuple[Weights, Context, Context]) -> None:
    w, ctx, dctx = smol
    text, r = generate(ctx, ModelDrafter(dctx), smol_prompt(w), PERSON,
                       SamplingParams(temperature=0.7, seed=11), n=64)
    assert r.done_reason == "stop", text
    jsonschema.validate(json.loads(text), PERSON)
    assert r.draft_accepted_tokens > 0
