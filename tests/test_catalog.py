"""The model catalog and draft suggestions on real stores: an Ollama store (manifests, blobs, config
blobs) and LM Studio folders holding SmolLM2 and tiny factory models of both vocabularies."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest

import sidecar.pairing.catalog as catalog
from sidecar.models.cache import FileCache
from sidecar.models.resolve import Stores, resolve
from sidecar.pairing.catalog import NOT_GGUF, CatalogEntry, find_drafts, list_models, ollama_short_name
from sidecar.pairing.ranking import Profile, rank_drafts, size_factor
from tests.models import write_tiny_llama

pytestmark = pytest.mark.model

MEDIA = "application/vnd.ollama.image."
SMOL_CONFIG = {"model_format": "gguf", "model_family": "llama", "model_families": ["llama"],
               "model_type": "135M", "file_type": "Q4_1", "capabilities": ["completion"],
               "renderer": "smollm2", "parser": "smollm2"}


def _blob(root: Path, data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = root / "blobs" / digest.replace(":", "-")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"digest": digest, "size": len(data)}


def add_model(root: Path, manifest: str, model: Path | bytes, config: dict[str, Any] | None = None) -> Path:
    """A model as `ollama pull` leaves it: blobs named by digest, a manifest naming a config blob."""
    data = model if isinstance(model, bytes) else model.read_bytes()
    config = config or {"model_format": "gguf", "model_family": "llama", "file_type": "F32"}
    doc = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
           "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                      **_blob(root, json.dumps(config).encode())},
           "layers": [{"mediaType": MEDIA + "model", **_blob(root, data)},
                      {"mediaType": MEDIA + "template", **_blob(root, b"{{ .Prompt }}")}]}
    path = root / "manifests" / manifest
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def write_with(path: Path, **kwargs: Any) -> Path:
    """A tiny model with `pooling` (an embedding model's key) and/or split into `split` tensors a shard."""
    pooling, split = kwargs.pop("pooling", False), kwargs.pop("split", 0)
    with pytest.MonkeyPatch.context() as mp:
        if pooling:
            add_name = gguf.GGUFWriter.add_name

            def named(w: gguf.GGUFWriter, name: str) -> None:
                add_name(w, name)
                w.add_uint32("llama.pooling_type", 1)
            mp.setattr(gguf.GGUFWriter, "add_name", named)
        if split:
            mp.setattr(gguf, "GGUFWriter", functools.partial(gguf.GGUFWriter, split_max_tensors=split))
        return write_tiny_llama(path, **kwargs)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Stores:
    d = tmp_path_factory.mktemp("catalog")
    m = d / "files"
    big = write_tiny_llama(m / "big.gguf", seed=1, n_embd=128, n_layer=6, n_ff=512)  # 1.5M parameters
    small = write_tiny_llama(m / "small.gguf", seed=2)  # 107.6K: 14x smaller
    mini = write_tiny_llama(m / "mini.gguf", seed=3, n_layer=1, n_extra_tokens=100)  # 75K, 100 more tokens
    foreign = write_tiny_llama(m / "foreign.gguf", seed=4, vocab="shifted")  # small's size, other texts
    root = d / "ollama"
    add_model(root, "registry.ollama.ai/library/tiny/big", big)
    add_model(root, "registry.ollama.ai/library/tiny/small", small)
    add_model(root, "hf.co/org/Tiny-GGUF/Q8_0", small)  # the same blob under a second name
    add_model(root, "registry.ollama.ai/someone/mini/latest", mini)
    add_model(root, "registry.ollama.ai/library/foreign/latest", foreign)
    add_model(root, "registry.ollama.ai/library/smollm2/135m", smollm2, SMOL_CONFIG)
    add_model(root, "registry.ollama.ai/library/embed/cfg", small, {"capabilities": ["embedding"]})
    add_model(root, "registry.ollama.ai/library/embed/gguf", write_with(m / "embed.gguf", seed=5, pooling=True))
    add_model(root, "registry.ollama.ai/library/mlx/latest", b'{"safetensors": true}')
    lms = d / "lmstudio"
    repo = lms / "pub" / "Tiny-GGUF"
    repo.mkdir(parents=True)
    shutil.copy(small, repo / "tiny-small-Q8_0.gguf")
    shutil.copy(small, repo / "mmproj-tiny-F16.gguf")  # a vision projector: never a model
    write_with(lms / "pub" / "Split-GGUF" / "split.gguf", seed=2, split=12)  # split-0000{1,2}-of-00002.gguf
    (lms / "pub" / "Some-MLX").mkdir(parents=True)
    (lms / "pub" / "Some-MLX" / "model.safetensors").write_bytes(b"{}")
    return Stores(ollama=root, lmstudio=lms)


@pytest.fixture
def cache(tmp_path: Path) -> FileCache:
    return FileCache(tmp_path / "cache" / "facts.json")


def by_name(entries: list[CatalogEntry]) -> dict[str, CatalogEntry]:
    return {e.name: e for e in entries}


def test_every_model_is_listed_by_the_name_clients_send(stores: Stores, cache: FileCache) -> None:
    entries = by_name(list_models(stores, cache))
    assert sorted(entries) == sorted([
        "tiny:big", "tiny:small", "hf.co/org/Tiny-GGUF:Q8_0", "someone/mini:latest", "foreign:latest",
        "smollm2:135m", "embed:cfg", "embed:gguf", "mlx:latest",
        "lmstudio:pub/Tiny-GGUF/tiny-small-Q8_0.gguf", "lmstudio:pub/Split-GGUF/split-00001-of-00002.gguf",
        "lmstudio:pub/Some-MLX"])
    for name, e in entries.items():  # every listed name resolves to the same file
        if e.model is not None:
            assert resolve(name, stores=stores).path == e.path


def test_what_the_files_say(stores: Stores, cache: FileCache, smollm2: Path) -> None:
    entries = by_name(list_models(stores, cache))
    smol = entries["smollm2:135m"]
    assert smol.digest == "sha256:" + smol.path.name.removeprefix("sha256-")  # type: ignore[union-attr]
    assert (smol.size, smol.store, smol.family) == (smollm2.stat().st_size, "ollama", "smollm2")
    assert (smol.facts.architecture, smol.parameter_size, smol.quantization) == ("llama", "135M", "Q4_1")
    assert smol.facts.n_params == 134_515_008 and smol.problem is None
    assert smol.config == SMOL_CONFIG and smol.config["renderer"] == "smollm2"
    big = entries["tiny:big"]
    assert (big.parameter_size, big.quantization, big.family) == ("1.5M", "F32", "tiny")  # counted: no size_label
    assert entries["someone/mini:latest"].family is None  # outside the library a name is no family
    split = entries["lmstudio:pub/Split-GGUF/split-00001-of-00002.gguf"]
    small = entries["tiny:small"]
    assert split.facts.n_params == small.facts.n_params and split.digest is None
    assert split.size == sum(p.stat().st_size for p in split.path.parent.glob("*.gguf"))  # type: ignore[union-attr]


def test_models_that_cannot_pair_say_why(stores: Stores, cache: FileCache) -> None:
    entries = by_name(list_models(stores, cache))
    assert "embedding model" in entries["embed:cfg"].problem  # type: ignore[operator]
    assert "embedding model" in entries["embed:gguf"].problem  # type: ignore[operator]
    assert "not a GGUF file" in entries["mlx:latest"].problem and entries["mlx:latest"].model is None  # type: ignore[operator]
    assert entries["lmstudio:pub/Some-MLX"].problem == NOT_GGUF


def test_drafts_best_first_and_never_another_vocabulary(stores: Stores, cache: FileCache) -> None:
    scan = find_drafts(stores, cache)
    drafts = {t: [s.name for s in ss] for t, ss in scan.drafts.items()}
    # tiny:big has four files that can draft: small (14x; one blob under two pairable names, offered
    # once under the shorter), its LM Studio copy and split copy, and mini (100 more tokens, within 128).
    # The same family comes first; then ties on score go to the ratio nearest 12x, then the name.
    assert drafts["tiny:big"] == ["tiny:small", "lmstudio:pub/Split-GGUF/split-00001-of-00002.gguf",
                                  "lmstudio:pub/Tiny-GGUF/tiny-small-Q8_0.gguf", "someone/mini:latest"]
    assert all("foreign" not in name for names in drafts.values() for name in names)
    assert drafts["foreign:latest"] == [] and drafts["smollm2:135m"] == []  # nothing else shares their vocabulary
    assert drafts["tiny:small"] == []  # 1.4x smaller: useless; itself: never
    assert not {"embed:cfg", "embed:gguf", "mlx:latest", "lmstudio:pub/Some-MLX"} & set(drafts)
    best = scan.drafts["tiny:big"][0]
    assert best.why.startswith("14x smaller (107.6K vs 1.5M parameters)") and "same architecture (llama)" in best.why


def test_a_cached_rescan_reads_no_gguf(stores: Stores, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "facts.json"
    first = find_drafts(stores, FileCache(path))
    assert first.files_read == 8  # 11 GGUF entries, 8 distinct files (one blob has three names)

    def no_reads(*_: Any, **__: Any) -> None:
        raise AssertionError("a cached rescan read a GGUF header")
    monkeypatch.setattr(catalog, "read_header", no_reads)
    # And the blobs' contents go (keeping the magic resolve checks): the cache must not need them.
    blobs = (stores.ollama or Path()) / "blobs"
    saved = {p: p.read_bytes() for p in blobs.iterdir()}
    try:
        for p, data in saved.items():
            if data.startswith(b"GGUF"):
                p.write_bytes(b"GGUF" + bytes(64))
        again = find_drafts(stores, FileCache(path))
    finally:
        for p, data in saved.items():
            p.write_bytes(data)
    assert again.files_read == 0
    assert again.drafts == first.drafts
    assert [(e.name, e.facts, e.problem) for e in again.entries] == \
        [(e.name, e.facts, e.problem) for e in first.entries]


def test_a_changed_file_is_read_again(stores: Stores, tmp_path: Path) -> None:
    path = tmp_path / "facts.json"
    find_drafts(stores, FileCache(path))
    lm_file = (stores.lmstudio or Path()) / "pub" / "Tiny-GGUF" / "tiny-small-Q8_0.gguf"
    original = lm_file.read_bytes()
    try:
        write_tiny_llama(lm_file, seed=2, vocab="shifted")  # now another vocabulary
        scan = find_drafts(stores, FileCache(path))
    finally:
        lm_file.write_bytes(original)
    assert scan.files_read == 1
    assert "lmstudio:pub/Tiny-GGUF/tiny-small-Q8_0.gguf" not in [s.name for s in scan.drafts["tiny:big"]]


def test_resolved_models_carry_the_config_blob(stores: Stores) -> None:
    m = resolve("smollm2:135m", stores=stores)
    assert m.config == SMOL_CONFIG and m.template == "{{ .Prompt }}"
    assert m == resolve("smollm2:135m", stores=stores)  # equality still holds with a dict field
    assert resolve(str(m.path)).config == {}


@pytest.mark.parametrize(("parts", "name"), [
    (("registry.ollama.ai", "library", "llama3.2", "1b"), "llama3.2:1b"),
    (("registry.ollama.ai", "library", "llama3.2", "latest"), "llama3.2:latest"),
    (("registry.ollama.ai", "user", "model", "tag"), "user/model:tag"),
    (("hf.co", "org", "repo", "Q4_K_M"), "hf.co/org/repo:Q4_K_M"),
    (("Registry.Ollama.AI", "Library", "m", "t"), "m:t"),  # compared case-insensitively, as Ollama does
    (("localhost:5000", "library", "m", "t"), "localhost:5000/library/m:t"),
])
def test_short_names_follow_ollama(parts: tuple[str, str, str, str], name: str) -> None:
    assert ollama_short_name(*parts) == name


# -- ranking -------------------------------------------------------------------------------------
def test_the_size_factor() -> None:
    assert size_factor(2, 10) == 0.0 and size_factor(10, 1.9) == 0.0  # half the target or more: useless
    assert size_factor(2.001, 2.001) == pytest.approx(0.1, abs=1e-3) and size_factor(3.5, 3.5) == pytest.approx(0.55)
    assert size_factor(5, 5) == size_factor(30, 30) == 1.0
    assert size_factor(60, 60) == pytest.approx(2 / 3) and size_factor(120, 120) == pytest.approx(0.5)
    assert size_factor(10, 3) < size_factor(10, 10)  # stored at higher precision: dearer than its size says


def test_ranking_prefers_the_right_size_and_kin() -> None:
    target = Profile("big", 8_000_000_000, 4_900_000_000, "llama", "llama3.1", "Q4_K_M")
    cands = [
        Profile("kin", 1_000_000_000, 800_000_000, "llama", "llama3.2", "Q4_K_M"),
        Profile("kin-f16", 1_000_000_000, 2_200_000_000, "llama", "llama3.2", "F16"),
        Profile("same-family", 1_000_000_000, 700_000_000, "llama", "llama3.1", "Q4_K_M"),
        Profile("tiny", 30_000_000, 20_000_000, "llama", "llama3.1", "Q8_0"),
        Profile("squeezed", 1_000_000_000, 350_000_000, "llama", "llama3.1", "Q2_K"),
        Profile("half", 4_000_000_000, 2_400_000_000, "llama", "llama3.1", "Q4_K_M"),
        Profile("stranger", 1_000_000_000, 700_000_000, "qwen2", "qwen2.5", "Q4_K_M"),
    ]
    ranked = rank_drafts(target, cands)
    names = [s.name for s in ranked]
    assert names[:2] == ["same-family", "squeezed"]
    assert "half" not in names  # half the target: never suggested
    assert names.index("kin") < names.index("stranger")  # same architecture, a sibling family
    assert names.index("stranger") < names.index("tiny")  # 267x smaller: agrees too rarely to beat an 8x draft
    assert names.index("kin-f16") > names.index("kin")  # 2x cheaper only: F16 costs what 2B of Q4 does
    why = {s.name: s.why for s in ranked}
    assert why["same-family"] == "8x smaller (1B vs 8B parameters), same family (llama3.1), " \
                                 "same architecture (llama), Q4_K_M"
    assert "heavily quantised (Q2_K)" in why["squeezed"] and "agrees less" in why["tiny"]
    assert "another family (qwen2.5 vs llama3.1)" in why["stranger"]
    assert "another architecture (qwen2 vs llama)" in why["stranger"]
    assert why["kin-f16"].startswith("only 2.2x smaller (1B vs 8B parameters)")
