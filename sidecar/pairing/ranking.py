"""Order a target's compatible drafts by how likely each is to speed it up, from plain facts.

Speculative decoding gains when the draft is cheap next to the target (each drafted token costs a
draft step) and still agrees with it often (each rejected token is wasted work). Neither can be
measured without running both, so the score guesses from what predicts them. It takes only
numbers and strings, with no file access: `pairing.catalog` feeds it what the headers say.

Scoring, a product of factors in (0, 1]; higher is better:

- **Size.** r = target parameters / draft parameters (file sizes when either count is missing),
  c = target file size / draft file size (what a step costs: decoding reads every weight once).
  A draft with r <= 2 or c <= 2 costs at least half a target step per token and is left out
  altogether. Above 2, up to 5, the factor rises linearly from 0.1 to 1 (on min(r, c): a draft stored
  at higher precision than the target costs more than its parameter count says). From 5 to 30 it
  is 1. Past 30 it falls as 1 / (1 + 0.5 log2(r / 30)): 0.67 at 60x, 0.5 at 120x, 0.33 at 480x:
  a tiny draft is cheap but agrees less with a much larger target.
- **Family** (same base model, e.g. both `smollm2`: distilled or trained on the same data, they
  agree most): same 1, unknown on either side 0.9, different 0.8.
- **Architecture** (`general.architecture`): same 1, unknown 0.95, different 0.9.
- **Quantisation.** A heavily quantised draft (1-3 bits: Q2_K, Q3_K_*, IQ1-IQ3, TQ*) is fine, and
  cheap; it agrees a little less: 0.95, and the reason says so.

Ties go to the size ratio nearest 12x, then to the name. Each suggestion carries a one-line
reason. Only candidates that already passed the vocabulary rules (pairing.rules) come here: a
model with another vocabulary can never appear.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

USELESS_RATIO = 2.0
BEST_RATIO = (5.0, 30.0)
_HEAVY_QUANTS = ("Q2", "Q3", "IQ1", "IQ2", "IQ3", "TQ")


@dataclass(frozen=True)
class Profile:
    """A model as the ranking sees it."""

    name: str
    params: int | None  # parameter count
    size: int  # bytes on disk
    architecture: str | None = None
    family: str | None = None
    quant: str | None = None  # e.g. "Q4_K_M"


@dataclass(frozen=True)
class Suggestion:
    name: str
    score: float
    ratio: float  # target size / draft size, in parameters where both are known
    why: str


def human(n: float) -> str:
    """135M, 1.7B, 107K: parameter counts as model cards write them."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + unit
    return str(int(n))


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def size_factor(r: float, c: float) -> float:
    """The size part of the score (module docstring), 0 for a draft too large to help."""
    low = min(r, c)
    if low <= USELESS_RATIO:
        return 0.0
    lo, hi = BEST_RATIO
    rise = 1.0 if low >= lo else 0.1 + 0.9 * (low - USELESS_RATIO) / (lo - USELESS_RATIO)
    fall = 1.0 if r <= hi else 1.0 / (1.0 + 0.5 * math.log2(r / hi))
    return rise * fall


def heavily_quantised(quant: str | None) -> bool:
    return quant is not None and quant.upper().startswith(_HEAVY_QUANTS)


def _match(a: str | None, b: str | None, same: float, unknown: float, other: float) -> float:
    if not a or not b:
        return unknown
    return same if a.lower() == b.lower() else other


def judge(target: Profile, draft: Profile) -> Suggestion | None:
    """The draft's score and reason, or None when it is too large to speed the target up."""
    c = target.size / max(draft.size, 1)
    if target.params and draft.params:
        r = target.params / draft.params
        what = f"{human(draft.params)} vs {human(target.params)} parameters"
    else:
        r = c
        what = f"{_bytes(draft.size)} vs {_bytes(target.size)} on disk"
    size = size_factor(r, c)
    if size == 0.0:
        return None
    if min(r, c) < BEST_RATIO[0]:
        parts = [f"only {min(r, c):.1f}x smaller ({what}): each drafted token costs a good share of a target step"]
    elif r > BEST_RATIO[1]:
        parts = [f"{r:.0f}x smaller ({what}): cheap, but agrees less with a much larger target"]
    else:
        parts = [f"{r:.0f}x smaller ({what})"]
    family = _match(target.family, draft.family, 1.0, 0.9, 0.8)
    if family == 1.0:
        parts.append(f"same family ({draft.family})")
    elif family == 0.8:
        parts.append(f"another family ({draft.family} vs {target.family})")
    arch = _match(target.architecture, draft.architecture, 1.0, 0.95, 0.9)
    if arch == 1.0:
        parts.append(f"same architecture ({draft.architecture})")
    elif arch == 0.9:
        parts.append(f"another architecture ({draft.architecture} vs {target.architecture})")
    quant = 1.0
    if heavily_quantised(draft.quant):
        quant = 0.95
        parts.append(f"heavily quantised ({draft.quant}): fine for a draft, agrees a little less")
    elif draft.quant:
        parts.append(draft.quant)
    return Suggestion(draft.name, round(size * family * arch * quant, 4), r, ", ".join(parts))


def rank_drafts(target: Profile, candidates: Iterable[Profile]) -> list[Suggestion]:
    """The candidates worth drafting with, best first (the scoring is in the module docstring)."""
    judged = [s for s in (judge(target, d) for d in candidates) if s is not None]
    return sorted(judged, key=lambda s: (-s.score, abs(math.log(s.ratio / 12.0)), s.name))
