"""Vocabularies read from GGUF headers against llama.cpp's own loading, the compatibility rules on
file-read vocabularies and their fingerprints, the header reader, and the fingerprint cache."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import pytest

import tests.models as factory
from sidecar.engine.kernels import FILE_TYPES as LLAMA_FILE_TYPES
from sidecar.engine.llama import Weights
from sidecar.models.cache import FileCache
from sidecar.models.gguf import FILE_TYPES, ArrayInfo, GGUFError, read_header, read_metadata
from sidecar.pairing.rules import IncompatibleDraft, check_pair, digest_mismatch
from sidecar.pairing.vocab import (
    TOKENS_KEY,
    VOCAB_TYPES,
    FileVocab,
    Fingerprint,
    VocabError,
    read_vocab,
    vocab_id,
)
from sidecar.storage import cache_dir
from tests.models import write_tiny_llama

pytestmark = pytest.mark.model

Patch = dict[str, Callable[..., Any]]


def _noop(*_: Any) -> None:
    pass


def _tokenizer(model: str, pre: str | None = None) -> Callable[..., None]:
    """Replace add_tokenizer_model: another tokenizer (a BPE one gets the merges llama.cpp demands)."""
    def add(w: gguf.GGUFWriter, _: str) -> None:
        w.add_string("tokenizer.ggml.model", model)
        if pre:
            w.add_string("tokenizer.ggml.pre", pre)
        if model == "gpt2":
            w.add_token_merges(["a b"])
    return add


def _vocab_with(**texts: str) -> Callable[..., tuple[list[str], list[int]]]:
    """tiny_vocab with some texts replaced, by id (`t259="..."`)."""
    base = factory.tiny_vocab

    def vocab(kind: str = "bytes", n_extra_tokens: int = 0) -> tuple[list[str], list[int]]:
        t, types = base(kind, n_extra_tokens)
        for key, text in texts.items():
            t[int(key[1:])] = text
        return t, types
    return vocab


def write_variant(path: Path, patches: Patch, **kwargs: Any) -> Path:
    """A tiny model whose header the factory writes with some GGUFWriter calls replaced."""
    with pytest.MonkeyPatch.context() as mp:
        for name, fn in patches.items():
            if name == "tiny_vocab":
                mp.setattr(factory, "tiny_vocab", fn)
            else:
                mp.setattr(gguf.GGUFWriter, name, fn)
        return write_tiny_llama(path, **kwargs)


def same_as_llama_cpp(path: Path) -> None:
    """The file-read vocabulary says what the loaded model says, down to every token text."""
    v = read_vocab(path)
    w = Weights(path, n_gpu_layers=0)
    try:
        assert astuple(v.vocab_info()) == astuple(w.vocab_info())
        assert [v.token_text(i) for i in range(w.n_vocab)] == [w.token_text(i) for i in range(w.n_vocab)]
        # One identity, whichever way the vocabulary was read.
        assert vocab_id(w) == vocab_id(v) == v.fingerprint().vocab_id
    finally:
        w.close()


# -- the file-read vocabulary is llama.cpp's ------------------------------------------------------
def test_smollm2_reads_as_llama_cpp_loads_it(smollm2: Path) -> None:
    same_as_llama_cpp(smollm2)
    info = read_vocab(smollm2).vocab_info()
    assert (info.type, info.n_tokens, info.add_bos) == (2, 49152, False)  # BPE, add_bos_token false


@pytest.mark.parametrize("vocab", factory.VOCABS)
@pytest.mark.parametrize("n_extra", [0, 100])
def test_tiny_models_read_as_llama_cpp_loads_them(tmp_path: Path, vocab: str, n_extra: int) -> None:
    same_as_llama_cpp(write_tiny_llama(tmp_path / "m.gguf", vocab=vocab, n_extra_tokens=n_extra))


# Headers that leave keys out or put odd values in, so llama.cpp's defaults decide.
DEFAULTS: dict[str, Patch] = {
    "spm without add_bos_token": {"add_add_bos_token": _noop},
    "spm without bos/eos ids": {"add_bos_token_id": _noop, "add_eos_token_id": _noop},
    "bos id out of range": {"add_bos_token_id": lambda w, _: w.add_uint32("tokenizer.ggml.bos_token_id", 9999)},
    "add_eos_token true": {"add_add_eos_token": lambda w, _: w.add_bool("tokenizer.ggml.add_eos_token", True)},
    "an empty token text": {"tiny_vocab": _vocab_with(t259="")},
    "bpe llama3 pre-tokenizer": {"add_tokenizer_model": _tokenizer("gpt2", "llama-bpe"), "add_add_bos_token": _noop},
    "bpe default pre-tokenizer": {"add_tokenizer_model": _tokenizer("gpt2", "default"), "add_add_bos_token": _noop},
    "bpe without ids": {"add_tokenizer_model": _tokenizer("gpt2", "default"), "add_add_bos_token": _noop,
                        "add_bos_token_id": _noop, "add_eos_token_id": _noop},
    "bpe chatglm pre-tokenizer": {"add_tokenizer_model": _tokenizer("gpt2", "chatglm-bpe"),
                                  "add_add_bos_token": _noop, "add_bos_token_id": _noop},
    "t5 defaults": {"add_tokenizer_model": _tokenizer("t5"), "add_add_bos_token": _noop, "add_add_eos_token": _noop,
                    "add_bos_token_id": _noop, "add_eos_token_id": _noop},
    "rwkv defaults": {"add_tokenizer_model": _tokenizer("rwkv"), "add_add_bos_token": _noop,
                      "add_add_eos_token": _noop},
}


@pytest.mark.parametrize("case", DEFAULTS)
def test_llama_cpp_defaults_apply_where_keys_are_absent(tmp_path: Path, case: str) -> None:
    same_as_llama_cpp(write_variant(tmp_path / "m.gguf", DEFAULTS[case]))


@pytest.mark.parametrize(("patches", "match"), [
    ({"add_tokenizer_model": _tokenizer("sentencepiece")}, "unknown to llama.cpp"),
    ({"tiny_vocab": _vocab_with(t300="<|im_end|>")}, "duplicate token"),
], ids=["unknown tokenizer", "duplicate text"])
def test_vocabularies_llama_cpp_refuses_are_refused(tmp_path: Path, patches: Patch, match: str) -> None:
    path = write_variant(tmp_path / "m.gguf", patches, n_extra_tokens=50)
    with pytest.raises(VocabError, match=match):
        read_vocab(path)
    # In a child process: llama.cpp refuses some of these with an exception, others by aborting.
    load = f"from sidecar.engine.llama import Weights; Weights({str(path)!r}, n_gpu_layers=0)"
    child = subprocess.run([sys.executable, "-c", load], capture_output=True, timeout=60)
    assert child.returncode < 0 or b"EngineError: llama.cpp could not load" in child.stderr


def test_vocabulary_types_are_llama_cpps_enum() -> None:
    names = {"llama": "SPM", "gpt2": "BPE", "bert": "WPM", "t5": "UGM", "rwkv": "RWKV", "plamo2": "PLAMO2"}
    for model, enum in names.items():
        assert VOCAB_TYPES[model] == getattr(llama_cpp, f"LLAMA_VOCAB_TYPE_{enum}")


# -- one set of rules for loaded models, file-read vocabularies and fingerprints ------------------
def test_check_pair_says_the_same_on_files_and_on_loaded_models(tmp_path: Path) -> None:
    tiny, shifted = (write_tiny_llama(tmp_path / f"{v}.gguf", vocab=v) for v in factory.VOCABS)
    loaded = [Weights(p, n_gpu_layers=0) for p in (tiny, shifted)]
    try:
        messages = []
        for a, b in (loaded, (read_vocab(tiny), read_vocab(shifted))):
            with pytest.raises(IncompatibleDraft) as e:
                check_pair(a, b)
            messages.append(str(e.value))
        assert messages[0] == messages[1]
        assert messages[0] == "draft shifted.gguf cannot speculate for target bytes.gguf: token 5 differs " \
                              "(b'<0x02>' vs b'<0x03>')"
        check_pair(loaded[0], read_vocab(tiny))  # a loaded model and its file agree with themselves
    finally:
        for w in loaded:
            w.close()


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FileVocab]:
    """Vocabularies that pass or fail each rule; a renamed last token tests min(n_a, n_b)."""
    d = tmp_path_factory.mktemp("variants")
    specs: dict[str, tuple[Patch, dict[str, Any]]] = {
        "base": ({}, {}),
        "shifted": ({}, {"vocab": "shifted"}),
        "extra100": ({}, {"n_extra_tokens": 100}),
        "extra100-renamed-last": ({"tiny_vocab": _vocab_with(t361="<renamed>")}, {"n_extra_tokens": 100}),
        "extra128": ({}, {"n_extra_tokens": 128}),
        "extra129": ({}, {"n_extra_tokens": 129}),
        "other-eos": ({"add_eos_token_id": lambda w, _: w.add_uint32("tokenizer.ggml.eos_token_id", 2)}, {}),
        "add-eos": ({"add_add_eos_token": lambda w, _: w.add_bool("tokenizer.ggml.add_eos_token", True)}, {}),
        "no-bos": ({"add_add_bos_token": lambda w, _: w.add_bool("tokenizer.ggml.add_bos_token", False)}, {}),
        "empty-text": ({"tiny_vocab": _vocab_with(t259="")}, {}),
    }
    return {name: read_vocab(write_variant(d / f"{name}.gguf", patches, **kw))
            for name, (patches, kw) in specs.items()}


def test_fingerprints_decide_as_check_pair_does(variants: dict[str, FileVocab]) -> None:
    verdicts = {}
    for (a, va), (b, vb) in itertools.product(variants.items(), repeat=2):
        try:
            check_pair(va, vb)
            full = None
        except IncompatibleDraft as e:
            full = str(e).split(": ", 1)[1]
        digest = digest_mismatch(va.fingerprint(), vb.fingerprint())
        assert (digest is None) == (full is None), (a, b, full, digest)
        if full is not None and not full.startswith("token"):
            assert digest == full  # the header rules are one piece of code
        verdicts[a, b] = digest is None
    # The rules at their edges, by name.
    assert verdicts["base", "extra100-renamed-last"]  # id 361 lies beyond the smaller vocabulary
    assert not verdicts["extra100", "extra100-renamed-last"]
    assert verdicts["base", "extra128"] and not verdicts["base", "extra129"]
    assert verdicts["base", "other-eos"]  # EOS ids only matter when EOS is added
    assert not verdicts["base", "add-eos"] and not verdicts["base", "no-bos"]
    assert not verdicts["base", "shifted"] and not verdicts["base", "empty-text"]


def test_a_fingerprint_survives_json_and_keeps_129_digests(variants: dict[str, FileVocab]) -> None:
    fp = variants["extra128"].fingerprint()
    assert len(fp.digests) == 129 and fp.first_end == 390 - 128
    again = Fingerprint.from_json(json.loads(json.dumps(fp.to_json())))
    assert again == fp
    assert fp.texts_digest(fp.first_end - 1) is None and fp.texts_digest(391) is None
    with pytest.raises(ValueError):
        Fingerprint.from_json({**fp.to_json(), "digests": fp.to_json()["digests"][:-1]})


# -- the header reader ----------------------------------------------------------------------------
def test_the_header_reader_keeps_what_it_is_asked_for(smollm2: Path) -> None:
    meta = read_metadata(smollm2)
    assert meta["general.architecture"] == "llama" and meta["general.size_label"] == "135M"
    assert isinstance(meta[TOKENS_KEY], ArrayInfo) and meta[TOKENS_KEY].length == 49152
    header = read_header(smollm2, keep_strings=(TOKENS_KEY,), tensors=True)
    assert repr(header.metadata) == repr(meta)  # keeping the tokens does not change the metadata
    tokens = header.strings[TOKENS_KEY]
    assert len(tokens) == 49152 and tokens.tolist()[:3] == [tokens[0], tokens[1], tokens[2]]
    reader = gguf.GGUFReader(smollm2)
    assert [(t.name, tuple(int(x) for x in t.shape)) for t in reader.tensors] == \
        [(t.name, t.shape) for t in header.tensors]
    assert sum(t.n_elements for t in header.tensors) == sum(int(t.n_elements) for t in reader.tensors)


def test_broken_files_are_gguf_errors(tmp_path: Path, smollm2: Path) -> None:
    empty, junk, cut = tmp_path / "empty.gguf", tmp_path / "junk.gguf", tmp_path / "cut.gguf"
    empty.write_bytes(b"")
    junk.write_bytes(b"PK\x03\x04 a zip, say")
    with open(smollm2, "rb") as f:
        cut.write_bytes(f.read(500_000))  # ends inside the token list
    for path in (empty, junk, cut):
        with pytest.raises(GGUFError):
            read_header(path, keep_strings=(TOKENS_KEY,))


def test_file_type_names_are_llama_cpps() -> None:
    """The model store names a file's type without loading llama.cpp; the engine reads llama.cpp's."""
    assert LLAMA_FILE_TYPES == FILE_TYPES


# -- the cache ------------------------------------------------------------------------------------
def test_the_cache_round_trips_and_prunes(tmp_path: Path) -> None:
    path = tmp_path / "c" / "facts.json"
    cache = FileCache(path)
    cache.put("sha256-" + "a" * 64, {"x": 1})
    cache.put("other", {"y": 2})
    cache.save()
    again = FileCache(path)
    assert again.get("sha256-" + "a" * 64) == {"x": 1}
    again.save(prune=True)  # "other" was not used since opening
    assert FileCache(path).get("other") is None
    assert [p.name for p in path.parent.iterdir()] == ["facts.json"]  # no temporary files left


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"format": "someone-else", "version": 1}',
                                     b'{"format": "spec-sidecar/gguf-facts", "version": 999, "entries": {}}'])
def test_a_corrupt_or_foreign_cache_is_empty(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "facts.json"
    path.write_bytes(content)
    cache = FileCache(path)
    assert cache.get("anything") is None
    cache.put("k", 1)
    cache.save()
    assert FileCache(path).get("k") == 1


def test_failed_writes_leave_the_old_cache_and_raise_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "facts.json"
    cache = FileCache(path)
    cache.put("k", 1)
    cache.save()
    cache.put("k", 2)

    def full(*_: Any, **__: Any) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("sidecar.storage.json.dump", full)
    cache.save()
    assert FileCache(path).get("k") == 1
    assert [p.name for p in tmp_path.iterdir()] == ["facts.json"]
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    nowhere = FileCache(blocked / "facts.json")  # its directory cannot exist
    nowhere.put("k", 1)
    nowhere.save()


def test_cache_keys_and_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blob = tmp_path / ("sha256-" + "b" * 64)
    blob.write_bytes(b"x")
    assert FileCache.key(blob) == blob.name  # an Ollama blob is its digest, wherever it lies
    plain = tmp_path / "m.gguf"
    plain.write_bytes(b"x")
    before = FileCache.key(plain)
    assert str(plain.resolve()) in before
    os.utime(plain, ns=(1, 2))
    assert FileCache.key(plain) != before
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "spec-sidecar"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert cache_dir() == tmp_path / ".cache" / "spec-sidecar"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert FileCache().path.parent == tmp_path / ".cache" / "spec-sidecar"
