"""Sampler.probs: the one distribution plain decoding, drafting and verification all draw from.

Checks each stage (penalties, top-k, temperature, top-p, min-p) against hand-computed values, and
that draws are reproducible with a seed and never land on a token the distribution rules out.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from sidecar.engine.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.pure

F32 = NDArray[np.float32]
# Only the stage under test is active: no top-k, top-p or min-p truncation, temperature 1.
PLAIN = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def sampler(n_vocab: int = 8, n_ctx: int = 256, **params: float) -> Sampler:
    return Sampler(SamplingParams(**params), n_vocab=n_vocab, n_ctx=n_ctx)  # type: ignore[arg-type]


def logits_of(*values: float) -> F32:
    return np.array(values, dtype=np.float32)


def softmax(x: NDArray[np.float64]) -> NDArray[np.float64]:
    e = np.exp(x - x.max())
    return e / e.sum()


# Sorted probabilities 0.5, 0.25, 0.15, 0.1 (cumulative 0.5, 0.75, 0.9, 1.0), shuffled in the vocab.
QUARTER = logits_of(*np.log([0.15, 0.5, 0.1, 0.25]))
BY_RANK = [1, 3, 0, 2]


@pytest.mark.parametrize(
    "params",
    [
        {},  # Ollama's defaults
        PLAIN,
        {"temperature": 0.3, "top_k": 3},
        {"temperature": 1.5, "top_p": 0.5, "min_p": 0.2},
        {"repeat_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.2},
        {"temperature": 0.0},
    ],
)
def test_probs_is_a_distribution(params: dict[str, float]) -> None:
    """Whatever the settings, probs is a float64 vector over the whole vocabulary summing to 1."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=64).astype(np.float32)
    p = sampler(64, **params).probs(logits, [1, 2, 3, 3, 60])
    assert p.shape == (64,) and p.dtype == np.float64
    assert np.all(p >= 0)
    assert p.sum() == pytest.approx(1.0, abs=1e-12)


def test_greedy_is_one_hot_on_the_argmax_of_the_penalised_logits() -> None:
    """Temperature 0: all mass on the argmax, taken after penalties (token 1 is penalised below 2)."""
    logits = logits_of(1.0, 5.0, 4.9, 0.0)
    s = sampler(4, temperature=0.0, repeat_penalty=1.5)
    assert s.probs(logits, []).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert s.probs(logits, [1]).tolist() == [0.0, 0.0, 1.0, 0.0]
    assert s.draw(s.probs(logits, [1])) == 2


def test_temperature_zero_ignores_truncation_settings() -> None:
    """Greedy does not depend on top_k/top_p/min_p."""
    logits = logits_of(0.3, 2.0, -1.0, 1.9)
    for kw in ({"top_k": 1}, {"top_p": 0.01}, {"min_p": 0.99}, {"top_k": 0, "top_p": 1.0}):
        assert sampler(4, temperature=0.0, **kw).probs(logits, []).tolist() == [0, 1, 0, 0]


def test_top_k_keeps_the_k_largest_logits() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, size=20).astype(np.float32)
    for k in (1, 3, 7):
        p = sampler(20, **{**PLAIN, "top_k": k}).probs(logits, [])
        top = np.argsort(-logits)[:k]
        assert set(np.flatnonzero(p)) == set(top)
        np.testing.assert_allclose(p[top], softmax(logits[top].astype(np.float64)), rtol=1e-12)


@pytest.mark.parametrize("k", [0, 20, 1000])
def test_top_k_zero_or_at_least_the_vocab_keeps_everything(k: int) -> None:
    logits = np.linspace(-3, 3, 20).astype(np.float32)
    p = sampler(20, **{**PLAIN, "top_k": k}).probs(logits, [])
    np.testing.assert_allclose(p, softmax(logits.astype(np.float64)), rtol=1e-12)


@pytest.mark.parametrize(("top_p", "keep"), [(0.4, 1), (0.6, 2), (0.8, 3), (0.95, 4), (1.0, 4)])
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p: float, keep: int) -> None:
    """Sorted masses 0.5, 0.25, 0.15, 0.1: top_p keeps the fewest tokens whose mass reaches top_p."""
    p = sampler(4, **{**PLAIN, "top_p": top_p}).probs(QUARTER, [])
    kept = BY_RANK[:keep]
    assert set(np.flatnonzero(p)) == set(kept)
    base = np.array([0.5, 0.25, 0.15, 0.1])[:keep]
    np.testing.assert_allclose(p[kept], base / base.sum(), rtol=1e-6)  # float32 logits


def test_top_p_zero_keeps_only_the_top_token() -> None:
    """top_p = 0: Ollama (sample/transforms.go topP) and llama.cpp keep the single most likely token.

    Ollama clamps top_p to [0, 1] and cuts at the first token whose cumulative mass exceeds it, so
    `top_p: 0` means "always the top token"; it must not switch top-p off."""
    p = sampler(4, **{**PLAIN, "top_p": 0.0}).probs(QUARTER, [])
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize(("min_p", "keep"), [(0.0, 4), (0.19, 4), (0.25, 3), (0.31, 2), (0.49, 2), (0.51, 1)])
def test_min_p_is_relative_to_the_most_likely_token(min_p: float, keep: int) -> None:
    """min_p keeps tokens with probability >= min_p x max (max 0.5; thresholds avoid exact ties)."""
    p = sampler(4, **{**PLAIN, "min_p": min_p}).probs(QUARTER, [])
    assert set(np.flatnonzero(p)) == set(BY_RANK[:keep])


def test_temperature_sharpens_and_flattens() -> None:
    """Lower temperature moves mass to the top token; higher spreads it. The ranking never changes."""
    logits = logits_of(0.0, 1.0, 2.0, 0.5, -1.0)
    tops, entropies = [], []
    for t in (0.25, 0.5, 1.0, 2.0, 4.0):
        p = sampler(5, **{**PLAIN, "temperature": t}).probs(logits, [])
        np.testing.assert_allclose(p, softmax(logits.astype(np.float64) / t), rtol=1e-9)
        assert list(np.argsort(-p)) == [2, 1, 3, 0, 4]
        tops.append(p.max())
        entropies.append(-(p * np.log(p)).sum())
    assert tops == sorted(tops, reverse=True)
    assert entropies == sorted(entropies)


def test_tiny_positive_temperature_behaves_like_greedy() -> None:
    """A positive temperature too small to divide by (effective() accepts any finite value >= 0)
    must still give a valid distribution concentrated on the argmax, not NaNs."""
    logits = logits_of(*np.log([0.5, 0.25, 0.15, 0.1]))
    s = sampler(4, temperature=1e-320)
    p = s.probs(logits, [])
    assert np.all(np.isfinite(p)), p
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert s.draw(p) == 0


# -- penalties --------------------------------------------------------------------------------------


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    """llama.cpp's repeat penalty, applied once per distinct token in the window."""
    logits = logits_of(2.0, -2.0, 3.0, -1.0)
    s = sampler(4, repeat_penalty=2.0)
    out = s.penalise(logits, [0, 1, 0, 0])
    np.testing.assert_allclose(out, [1.0, -4.0, 3.0, -1.0])
    assert logits.tolist() == [2.0, -2.0, 3.0, -1.0]  # the caller's logits are not modified


def test_presence_and_frequency_penalties() -> None:
    """Presence subtracts once per seen token; frequency subtracts once per occurrence."""
    logits = logits_of(1.0, 1.0, 1.0, 1.0)
    s = sampler(4, presence_penalty=0.5, frequency_penalty=0.25)
    np.testing.assert_allclose(s.penalise(logits, [2, 0, 2, 2]), [0.25, 1.0, -0.25, 1.0])


def test_penalties_only_see_the_last_repeat_last_n_tokens() -> None:
    """Token 5 appears only before the window; token 1 inside it."""
    logits = np.ones(8, dtype=np.float32)
    history = [5, 5, 5] + [1] * 4
    s = sampler(8, repeat_penalty=2.0, repeat_last_n=4)
    out = s.penalise(logits, history)
    assert out[1] == 0.5
    assert out[5] == 1.0
    assert s.history_window == 4
    p = s.probs(logits, history)
    assert p[5] == p[0] > p[1]


def test_repeat_last_n_zero_disables_penalties() -> None:
    logits = np.ones(8, dtype=np.float32)
    s = sampler(8, repeat_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0, repeat_last_n=0)
    assert not s.params.penalised
    assert s.history_window == 0
    np.testing.assert_array_equal(s.penalise(logits, [1, 2, 3]), logits)


def test_repeat_last_n_minus_one_covers_the_whole_context() -> None:
    """-1 means num_ctx tokens: a token seen 200 tokens ago is still penalised."""
    logits = np.ones(8, dtype=np.float32)
    history = [5] + [1] * 199
    s = sampler(8, n_ctx=256, repeat_penalty=2.0, repeat_last_n=-1)
    assert s.history_window == 256
    assert s.penalise(logits, history)[5] == 0.5
    default = sampler(8, n_ctx=256, repeat_penalty=2.0)  # Ollama's default window is 64
    assert default.penalise(logits, history)[5] == 1.0


def test_neutral_penalties_leave_logits_alone() -> None:
    """repeat_penalty 1 with no presence/frequency penalty is not penalised at all (no copy, no window)."""
    logits = logits_of(1.0, 2.0)
    s = sampler(2)
    assert not s.params.penalised and s.history_window == 0
    assert s.penalise(logits, [0, 1]) is logits


def test_history_tokens_outside_the_vocabulary_are_ignored() -> None:
    logits = logits_of(1.0, 1.0, 1.0)
    s = sampler(3, repeat_penalty=2.0)
    np.testing.assert_allclose(s.penalise(logits, [7, 2, 1000]), [1.0, 1.0, 0.5])


# -- draws ------------------------------------------------------------------------------------------


def test_seeded_draws_reproduce() -> None:
    logits = np.random.default_rng(3).normal(size=50).astype(np.float32)

    def run(seed: int) -> list[int]:
        s = sampler(50, seed=seed, temperature=1.2, top_k=0, top_p=1.0)
        p = s.probs(logits, [])
        return [s.draw(p) for _ in range(40)]

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)


def test_draw_frequencies_follow_probs() -> None:
    """Inverse-CDF draws land on each token about as often as its probability says."""
    s = sampler(4, **{**PLAIN, "seed": 7})
    p = s.probs(QUARTER, [])
    n = 20_000
    freq = np.bincount([s.draw(p) for _ in range(n)], minlength=4) / n
    np.testing.assert_allclose(freq, p, atol=4 * np.sqrt(0.25 / n))


def test_greedy_draw_is_the_argmax_and_uses_no_randomness() -> None:
    s = sampler(4, temperature=0.0, seed=5)
    state = s.rng.bit_generator.state
    assert s.draw(np.array([0.1, 0.2, 0.6, 0.1])) == 2
    assert s.rng.bit_generator.state == state


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    logits=st.lists(st.floats(-30, 30, width=32), min_size=1, max_size=40),
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    top_k=st.integers(0, 50),
    top_p=st.floats(0.0, 1.0),
    min_p=st.floats(0.0, 1.0),
    repeat_penalty=st.floats(0.5, 2.0),
    presence=st.floats(-1.0, 1.0),
    history=st.lists(st.integers(0, 45), max_size=20),
    seed=st.integers(0, 2**31),
)
def test_probs_and_draw_properties(
    logits: list[float],
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    repeat_penalty: float,
    presence: float,
    history: list[int],
    seed: int,
) -> None:
    """For any logits and settings: a valid distribution, and draws only on tokens it allows."""
    x = np.array(logits, dtype=np.float32)
    s = Sampler(
        SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repeat_penalty=repeat_penalty, presence_penalty=presence, seed=seed,
        ),
        n_vocab=len(x),
        n_ctx=64,
    )
    p = s.probs(x, history)
    assert np.all(np.isfinite(p)) and np.all(p >= 0)
    assert p.sum() == pytest.approx(1.0, abs=1e-9)
    pen = s.penalise(x, history)
    assert p[pen == pen.max()].sum() > 0  # a top token always survives (ties may go either way)
    if top_k > 0:
        assert np.count_nonzero(p) <= top_k
    for _ in range(10):
        assert p[s.draw(p)] > 0
