"""A pair's speculation settings, and the expected-tokens formula every price starts from.

How a step is decided lives in engine.schedule (one schedule per step), what it costs in
engine.cost (one fitted model), and how often each kind of draft holds in engine.evidence.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    """Per-pair speculation settings; defaults were measured with bench/bench_spec.py on 2 CPU cores."""

    n_max: int = 8  # longest draft per round
    n_min: int = 1  # shorter drafts are not worth a round
    p_min: float = 0.5  # a sampled model draft stops where its q's top probability is below this
    min_predict: int = 16  # num_predict below this runs target-only from the start
    fallback_margin: float = 0.97  # no stream's step may fall below this share of a plain step's progress
    min_gain: float = 1.05  # predicted speed-up of a step to start drafting (keeping on needs > 1)
    horizon: int = 512  # tokens a request without num_predict is assumed to have left (a catch-up's repayment)
    acceptance_prior: float = 0.7  # per-position acceptance assumed before any evidence
    prior_weight: float = 0.5  # weak: on a CPU only near-certain acceptance pays, so evidence must rule
    adaptive: bool = True  # False: always draft n_max from the first ready source (llama.cpp's rule)


NGRAM_N_MAX = 64
"""An n-gram pair's default n_max, llama.cpp's ngram-mod's: its drafts cost nothing to make, a
copied stretch runs long, and on a CPU a wide batch costs less per row (SmolLM2 on 2 cores, all
accepted: 13 rows give 1.73x, 33 rows 2.04x, 65 rows 2.19x). The schedule drafts that far only
where a class's acceptance is near-certain."""


def expected_tokens(a: float, k: int) -> float:
    """Tokens emitted by a round with k drafts at per-position acceptance a (Leviathan et al.)."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def round_seconds(k: int, t_draft: float, t_rows: float, switch: float = 0.0) -> float:
    """What a round drafting k tokens costs: k draft steps (0 for a free source), the rows it
    decodes on the target, and what a batch costs the warm plain steps (t_switch): how the pairing
    probe (pairing.probe) predicts a pair's speed-up from its calibration."""
    return t_draft * k + t_rows + switch
