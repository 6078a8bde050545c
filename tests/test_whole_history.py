"""Drafting sees the whole history: the n-gram and suffix sources look up over every token the
conversation holds, the system prompt and tool results included, also the stretch that the window
cut (or the chat's dropped messages) left out of what the model runs on.

The unit test is pure (HybridDrafter over a real NgramDrafter); the engine test runs the tiny model
that never ends its output: a conversation that already holds the answer, where the cut left that
answer out of the window, still gets it drafted (and verified: the output is the same)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.cost import CostModel
from sidecar.engine.decoder import Decoder, Request, Result
from sidecar.engine.drafters import NgramDrafter
from sidecar.engine.hybrid import HybridDrafter
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.sampling import SamplingParams
from sidecar.engine.window import prompt_limit, truncate_prompt

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0)


def test_free_sources_look_up_in_everything_seen() -> None:
    """The window holds only the latest turn; what was said before is in `seen`."""
    earlier = [7, 8, 9, 10, 11, 12, 13, 14]
    window = [50, 51, 7, 8, 9]  # ends like the earlier stretch began
    seen = [1, *earlier, 60, 61, 62, *window]
    hybrid = HybridDrafter([NgramDrafter()])
    hybrid.begin(None, seen)  # type: ignore[arg-type]
    assert hybrid.propose(0, window, 5, None).tokens == [10, 11, 12, 13, 14]
    seen.append(10)  # the sequence commits a token: `seen` grows with the window
    assert hybrid.propose(0, [*window, 10], 3, None).tokens == [11, 12, 13]
    # Without it the window is all there is.
    alone = HybridDrafter([NgramDrafter()])
    alone.begin(None)  # type: ignore[arg-type]
    assert alone.propose(0, window, 5, None).tokens == []


@pytest.fixture(scope="module")
def endless(tiny_endless: Path) -> Iterator[tuple[Weights, Context]]:
    w = Weights(tiny_endless, n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=256, n_threads=1))
    yield w, ctx
    ctx.close()
    w.close()


def run(ctx: Context, prompt: list[int], n: int, draft: bool, **kw: object) -> Result:
    ctx.clear()
    config = SpeculativeConfig(n_max=6, p_min=0.0, min_predict=0, adaptive=False)
    dec = Decoder(ctx, NgramDrafter() if draft else None, config, CostModel(7))
    out = list(dec.generate(Request(prompt, GREEDY, num_predict=n, **kw)))
    assert isinstance(out[-1], Result)
    return out[-1]


def test_a_cut_prompt_is_drafted_from_what_the_cut_left_out(endless: tuple[Weights, Context]) -> None:
    _, ctx = endless
    rng = np.random.default_rng(5)
    head, question, filler = ([int(t) for t in rng.integers(40, 120, n)] for n in (4, 24, 300))
    # The window cut keeps 4 + BOS tokens at the head and the newest ones: here the end of the filler
    # and the question, so the answer to the cut prompt is known before the conversation is built.
    cut = [1, *head, *[*filler, *question][-(prompt_limit(256, 5) - 5):]]
    answer = run(ctx, cut, 40, draft=False).tokens
    # The conversation asked the same question before and got this answer, then went on at length.
    conversation = [1, *head, *question, *answer, *filler, *question]
    assert truncate_prompt(conversation, 256, 4, add_bos=True) == cut
    assert not any(cut[i:i + 8] == answer[:8] for i in range(len(cut)))

    r = run(ctx, conversation, 40, draft=True, truncate=True)
    assert r.prompt_truncated > 0 and r.tokens == answer
    assert r.draft_accepted_tokens >= 30, r  # the earlier answer, copied from the whole prompt

    # The runtime's path: the prompt is already fitted, the whole conversation comes beside it.
    r = run(ctx, cut, 40, draft=True, lookup=conversation)
    assert r.tokens == answer and r.draft_accepted_tokens >= 30, r
    # Without it, only the window: the earlier answer is not there to copy.
    plain = run(ctx, cut, 40, draft=True)
    assert plain.tokens == answer and plain.draft_accepted_tokens < r.draft_accepted_tokens
