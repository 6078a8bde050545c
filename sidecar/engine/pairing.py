"""Can this draft model speculate for this target? llama.cpp's rules, checked at load.

Verification compares token ids, so the two vocabularies must mean the same thing by every id the
draft can propose. Same rules as llama.cpp's common_speculative_are_compatible (with its 2024-25
bool-typed vocabulary-type bug fixed): same vocabulary type, same BOS/EOS handling, sizes within
128 of each other, and identical token texts from id 5 up (ids 0-4 are control tokens that models
legitimately differ on).
"""

from __future__ import annotations

from sidecar.engine.llama import Weights

VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


class IncompatibleDraft(ValueError):
    pass


def check_pair(target: Weights, draft: Weights) -> None:
    """Raise IncompatibleDraft naming both models and the first difference."""
    t, d = target.vocab_info(), draft.vocab_info()
    who = f"draft {draft.path.name} cannot speculate for target {target.path.name}"
    if t.type != d.type:
        raise IncompatibleDraft(f"{who}: vocabulary types differ ({t.type} vs {d.type})")
    if t.add_bos != d.add_bos or (t.add_bos and t.bos != d.bos):
        raise IncompatibleDraft(f"{who}: BOS handling differs (add_bos {t.add_bos}/{d.add_bos}, id {t.bos}/{d.bos})")
    if t.add_eos != d.add_eos or (t.add_eos and t.eos != d.eos):
        raise IncompatibleDraft(f"{who}: EOS handling differs (add_eos {t.add_eos}/{d.add_eos}, id {t.eos}/{d.eos})")
    if abs(t.n_tokens - d.n_tokens) > VOCAB_MAX_SIZE_DIFFERENCE:
        raise IncompatibleDraft(
            f"{who}: vocabulary sizes differ by more than {VOCAB_MAX_SIZE_DIFFERENCE} ({t.n_tokens} vs {d.n_tokens})"
        )
    for tok in range(VOCAB_CHECK_START_TOKEN_ID, min(t.n_tokens, d.n_tokens)):
        a, b = target.token_text(tok), draft.token_text(tok)
        if a != b:
            raise IncompatibleDraft(f"{who}: token {tok} differs ({a!r} vs {b!r})")
