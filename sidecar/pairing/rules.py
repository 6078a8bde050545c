"""Can this draft model speculate for this target? llama.cpp's rules, in one place.

Verification compares token ids, so the two vocabularies must mean the same thing by every id the
draft can propose. Same rules as llama.cpp's common_speculative_are_compatible (with its 2024-25
bool-typed vocabulary-type bug fixed): same vocabulary type, same BOS/EOS handling, sizes within
128 of each other, and identical token texts from id 5 up (ids 0-4 are control tokens that models
legitimately differ on).

The facts compared are llama.cpp's own (`VocabInfo`, declared once, where the engine reads them off
a loaded model); pairing.vocab derives the same facts from a GGUF header. The rules run on two kinds
of vocabulary: one that can name every token's text (a loaded `engine.llama.Weights`, or a
`pairing.vocab.FileVocab` read from the header), which is what a pair is checked with before it
loads, and one that only keeps digests of its token texts (a cached `pairing.vocab.Fingerprint`),
which is how a whole model store is matched up without holding 150k strings per model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from sidecar.engine.llama import VocabInfo

VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


class IncompatibleDraft(ValueError):
    pass


class Vocabulary(Protocol):
    """A vocabulary that can say each token's text, as llama.cpp stores it (llama_vocab_get_text)."""

    @property
    def path(self) -> Path: ...
    def vocab_info(self) -> VocabInfo: ...
    def token_text(self, token: int) -> bytes: ...


class DigestedVocabulary(Protocol):
    """A vocabulary that keeps, for each `end` near its size, a digest of its texts over compared_ids(..., end).

    Digests of two vocabularies are equal exactly when their texts over that range are (up to hash
    collisions); `None` means no digest is kept for that end."""

    def vocab_info(self) -> VocabInfo: ...
    def texts_digest(self, end: int) -> str | None: ...


def header_mismatch(t: VocabInfo, d: VocabInfo) -> str | None:
    """Why two vocabularies cannot pair by their type, BOS/EOS handling and size; None if they can."""
    if t.type != d.type:
        return f"vocabulary types differ ({t.type} vs {d.type})"
    if t.add_bos != d.add_bos or (t.add_bos and t.bos != d.bos):
        return f"BOS handling differs (add_bos {t.add_bos}/{d.add_bos}, id {t.bos}/{d.bos})"
    if t.add_eos != d.add_eos or (t.add_eos and t.eos != d.eos):
        return f"EOS handling differs (add_eos {t.add_eos}/{d.add_eos}, id {t.eos}/{d.eos})"
    if abs(t.n_tokens - d.n_tokens) > VOCAB_MAX_SIZE_DIFFERENCE:
        return f"vocabulary sizes differ by more than {VOCAB_MAX_SIZE_DIFFERENCE} ({t.n_tokens} vs {d.n_tokens})"
    return None


def compared_ids(end: int) -> range:
    """The ids whose texts must match when the smaller vocabulary has `end` tokens."""
    return range(VOCAB_CHECK_START_TOKEN_ID, end)


def check_pair(target: Vocabulary, draft: Vocabulary) -> None:
    """Raise IncompatibleDraft naming both models and the first difference."""
    t, d = target.vocab_info(), draft.vocab_info()
    who = f"draft {draft.path.name} cannot speculate for target {target.path.name}"
    reason = header_mismatch(t, d)
    if reason:
        raise IncompatibleDraft(f"{who}: {reason}")
    for tok in compared_ids(min(t.n_tokens, d.n_tokens)):
        a, b = target.token_text(tok), draft.token_text(tok)
        if a != b:
            raise IncompatibleDraft(f"{who}: token {tok} differs ({a!r} vs {b!r})")


def digest_mismatch(target: DigestedVocabulary, draft: DigestedVocabulary) -> str | None:
    """check_pair's verdict from digests: why the draft cannot pair, or None if it can.

    A digest says whether the texts differ, not where, so the reason names the whole range."""
    t, d = target.vocab_info(), draft.vocab_info()
    reason = header_mismatch(t, d)
    if reason:
        return reason
    end = min(t.n_tokens, d.n_tokens)
    a, b = target.texts_digest(end), draft.texts_digest(end)
    if a is None or b is None:
        raise ValueError(f"no digest of the token texts below {end} (sizes {t.n_tokens}, {d.n_tokens})")
    if a != b:
        ids = compared_ids(end)
        return f"token texts differ (ids {ids.start}-{ids.stop - 1})"
    return None
