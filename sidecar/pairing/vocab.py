"""A GGUF's vocabulary as llama.cpp would load it, read from the file's header alone.

Suggesting drafts means matching every model in the stores against every other by llama.cpp's
compatibility rules (pairing.rules). Loading each model with llama.cpp to ask costs seconds and
memory per model; the rules only need the tokenizer, which sits in the GGUF header. So this module
repeats what llama_vocab::impl::load (src/llama-vocab.cpp) derives from that header — the
vocabulary type, the BOS/EOS ids and add_bos/add_eos with their per-tokenizer defaults, and the
token texts — and tests check it against a loaded `Weights` on real files.

A `Fingerprint` keeps only what the rules compare: the facts above and, for every size the other
vocabulary may have (within 128 of this one), a sha256 over the token texts the rule compares. It is
small enough to cache for every model (models.cache.FileCache), so a rescan reads no token arrays at all.

A Fingerprint's last digest, over every id the rules compare, is also the vocabulary's one identity
(`vocab_id`): the name under which models whose token ids mean the same texts share what they
learnt (runtime.llamacpp.caches' suffix caches), whether it was read from a header or a loaded model.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sidecar.engine.llama import VocabInfo
from sidecar.models.gguf import Header, StringArray, read_header
from sidecar.pairing.rules import VOCAB_CHECK_START_TOKEN_ID, VOCAB_MAX_SIZE_DIFFERENCE, Vocabulary, compared_ids

TOKENS_KEY = "tokenizer.ggml.tokens"
NULL = -1  # LLAMA_TOKEN_NULL

# tokenizer.ggml.model -> llama_vocab_type (llama.h: NONE 0, SPM 1, BPE 2, WPM 3, UGM 4, RWKV 5, PLAMO2 6).
VOCAB_TYPES = {"no_vocab": 0, "none": 0, "llama": 1, "gpt2": 2, "hybriddna": 2, "whitespace": 2, "gemma4": 2,
               "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}
# Each tokenizer's special ids when the header names none: (bos, eos).
_DEFAULT_IDS = {"llama": (1, 2), "bert": (101, NULL), "gpt2": (11, 11), "hybriddna": (11, 11),
                "whitespace": (11, 11), "t5": (NULL, 1), "rwkv": (NULL, NULL), "plamo2": (1, 2),
                "gemma4": (NULL, NULL)}
# add_bos/add_eos per vocabulary type before the header's keys override them; BPE depends on the
# pre-tokenizer (below).
_DEFAULT_ADD = {1: (True, False), 3: (True, False), 4: (False, True), 5: (False, False)}
_BPE_ADD_BOS_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                    "jina-v5-nano", "tekken", "chameleon"}
_NO_BOS_PRE = {"glm4", "chatglm-bpe"}
_GEMMA4_PRE = {"gemma4", "granite-embed-multi-311m"}  # llama.cpp forces add_bos on for these
_DNA_MARKER = "\ue000".encode()  # hybriddna k-mer suffix, erased from token texts at load
_LEN = struct.Struct("<Q")
FINGERPRINT_VERSION = 1


class VocabError(ValueError):
    """The header has no vocabulary llama.cpp could load (or none at all)."""


def _flag(meta: Mapping[str, Any], key: str, default: bool) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise VocabError(f"{key} is not a bool")
    return value


def _special_id(meta: Mapping[str, Any], key: str, default: int, n_tokens: int) -> int:
    """llama.cpp's rule: an out-of-range default is disabled, an out-of-range key keeps the default."""
    if default >= n_tokens:
        default = NULL
    value = meta.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise VocabError(f"{key} is not an integer")
    return value if 0 <= value < n_tokens else default


def tokenizer_info(meta: Mapping[str, Any], n_tokens: int) -> VocabInfo:
    """The facts llama.cpp derives from a header whose token list has n_tokens entries."""
    model = meta.get("tokenizer.ggml.model")
    if not isinstance(model, str):
        raise VocabError("no tokenizer (tokenizer.ggml.model is missing)")
    vtype = VOCAB_TYPES.get(model)
    if vtype is None:
        raise VocabError(f"tokenizer {model!r} is unknown to llama.cpp")
    if vtype == 0:
        raise VocabError("the model has no vocabulary")
    pre = "gemma4" if model == "gemma4" else str(meta.get("tokenizer.ggml.pre", ""))
    bos, eos = _DEFAULT_IDS[model]
    if vtype == 2:
        add_bos, add_eos = pre in _BPE_ADD_BOS_PRE, False
        if pre in _NO_BOS_PRE:
            bos = NULL
    else:
        add_bos, add_eos = _DEFAULT_ADD.get(vtype, (False, False))
    bos = _special_id(meta, "tokenizer.ggml.bos_token_id", bos, n_tokens)
    eos = _special_id(meta, "tokenizer.ggml.eos_token_id", eos, n_tokens)
    add_bos = _flag(meta, "tokenizer.ggml.add_bos_token", add_bos) or (vtype == 2 and pre in _GEMMA4_PRE)
    add_eos = _flag(meta, "tokenizer.ggml.add_eos_token", add_eos)
    for on, tok, what in ((add_bos, bos, "bos"), (add_eos, eos, "eos")):
        if on and tok == NULL:  # llama.cpp refuses to load such a model
            raise VocabError(f"tokenizer.ggml.add_{what}_token is true, but tokenizer.ggml.{what}_token_id is not set")
    return VocabInfo(vtype, n_tokens, bos, eos, add_bos, add_eos)


def _text_fixes(model: str, texts: list[bytes]) -> dict[int, bytes]:
    """Texts llama.cpp changes at load: empty ones get a placeholder, hybriddna k-mers lose their marker."""
    fixes = {i: f"[EMPTY_{i}]".encode() for i, t in enumerate(texts) if not t}
    if model == "hybriddna" and b"<oov>" in texts:
        for i in range(texts.index(b"<oov>") + 1, len(texts)):
            t = texts[i]
            if len(t) > len(_DNA_MARKER) and t.endswith(_DNA_MARKER):
                fixes[i] = t[: -len(_DNA_MARKER)]
    return fixes


class FileVocab:
    """A vocabulary read from a GGUF header; pairing.rules.check_pair takes it like a loaded Weights."""

    def __init__(self, path: Path, tokenizer: str, info: VocabInfo, texts: StringArray,
                 fixes: dict[int, bytes]) -> None:
        self.path = path
        self.tokenizer = tokenizer
        self._info = info
        self._texts = texts
        self._fixes = fixes

    @classmethod
    def from_header(cls, path: Path, header: Header) -> FileVocab:
        """The vocabulary of a header read with keep_strings=(TOKENS_KEY,)."""
        texts = header.strings.get(TOKENS_KEY)
        if texts is None:
            raise VocabError(f"no token list ({TOKENS_KEY})")
        info = tokenizer_info(header.metadata, len(texts))
        model = str(header.metadata["tokenizer.ggml.model"])
        items = texts.tolist()
        fixes = _text_fixes(model, items)
        unique = {fixes.get(i, t) for i, t in enumerate(items)} if fixes else set(items)
        if len(unique) != len(items):
            raise VocabError("duplicate token texts (llama.cpp refuses to load this vocabulary)")
        return cls(path, model, info, texts, fixes)

    def vocab_info(self) -> VocabInfo:
        return self._info

    def token_text(self, token: int) -> bytes:
        fixed = self._fixes.get(token)
        return fixed if fixed is not None else self._texts[token]

    def _feed(self, h: Any, start: int, end: int) -> None:
        """Hash the texts of ids [start, end) as GGUF stores them (u64 length + bytes), fixes applied."""
        pos = start
        for i in sorted(i for i in self._fixes if start <= i < end):
            h.update(self._texts.serialized(pos, i))
            h.update(_LEN.pack(len(self._fixes[i])) + self._fixes[i])
            pos = i + 1
        if pos < end:
            h.update(self._texts.serialized(pos, end))

    def fingerprint(self) -> Fingerprint:
        n = self._info.n_tokens
        first = max(VOCAB_CHECK_START_TOKEN_ID, n - VOCAB_MAX_SIZE_DIFFERENCE)
        h = hashlib.sha256()
        self._feed(h, VOCAB_CHECK_START_TOKEN_ID, first)
        digests = [h.hexdigest()]
        for i in range(first, n):
            self._feed(h, i, i + 1)
            digests.append(h.hexdigest())
        return Fingerprint(self.tokenizer, self._info, first, tuple(digests))


def read_vocab(path: str | Path) -> FileVocab:
    """Raises GGUFError for a file that is no GGUF, VocabError for one without a usable vocabulary."""
    return FileVocab.from_header(Path(path), read_header(path, keep_strings=(TOKENS_KEY,)))


@dataclass(frozen=True)
class Fingerprint:
    """What pairing.rules.digest_mismatch needs of a vocabulary: its facts and text digests.

    `digests[k]` covers the texts of compared_ids(first_end + k), for every end from
    max(5, n - 128) to n: the sizes a compatible partner's min(n_a, n_b) can take."""

    tokenizer: str
    info: VocabInfo
    first_end: int
    digests: tuple[str, ...]

    def vocab_info(self) -> VocabInfo:
        return self.info

    @property
    def vocab_id(self) -> str:
        """The vocabulary's identity (module docstring): what `vocab_id` gives for the loaded model."""
        return _identity(self.digests[-1], self.info.n_tokens)

    def texts_digest(self, end: int) -> str | None:
        if not compared_ids(end):  # no ids to compare: the digest of nothing, kept at first_end 5
            end = VOCAB_CHECK_START_TOKEN_ID
        k = end - self.first_end
        return self.digests[k] if 0 <= k < len(self.digests) else None

    def to_json(self) -> dict[str, Any]:
        return {"v": FINGERPRINT_VERSION, "tokenizer": self.tokenizer, "info": asdict(self.info),
                "first_end": self.first_end, "digests": list(self.digests)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Fingerprint:
        """Raises KeyError/TypeError/ValueError on anything but what to_json wrote."""
        if d["v"] != FINGERPRINT_VERSION:
            raise ValueError("another fingerprint version")
        info = VocabInfo(**d["info"])
        digests = tuple(str(x) for x in d["digests"])
        fp = cls(str(d["tokenizer"]), info, int(d["first_end"]), digests)
        if len(digests) != max(1, info.n_tokens - fp.first_end + 1):
            raise ValueError("digest count does not match the vocabulary size")
        return fp


def _identity(digest: str, n_tokens: int) -> str:
    return f"{digest[:16]}-{n_tokens}"


def vocab_id(vocab: Vocabulary) -> str:
    """The identity of a vocabulary that names its token texts (a loaded Weights: tens of ms):
    the sha256 a Fingerprint keeps over every compared id, hashed as the GGUF stores the texts."""
    n = vocab.vocab_info().n_tokens
    h = hashlib.sha256()
    for i in compared_ids(n):
        text = vocab.token_text(i)
        h.update(_LEN.pack(len(text)) + text)
    return _identity(h.hexdigest(), n)
