"""Every model in the configured stores, described from its files alone, and which can draft for which.

`sidecar suggest` and `draft: auto` must answer for a whole store (50 models, some of 40 GB) in
seconds, so nothing here loads weights: a model is its GGUF header (architecture, size, file
type, tokenizer) plus, in Ollama's store, the manifest's config blob. What a header says is cached
per file (models.cache.FileCache), so a rescan reads manifests and stats files but no GGUF.

Names are the ones clients send: Ollama's shortest form (`llama3.2:1b`, `user/model:tag`,
`hf.co/org/repo:tag`, as its DisplayShortest writes them) and `lmstudio:publisher/repo/file.gguf`.
Models that cannot take part in a pair (embedding-only, safetensors/MLX, unreadable, no usable
vocabulary) are listed with the reason in `problem` rather than dropped, so a listing can say why.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sidecar.models.cache import FileCache
from sidecar.models.gguf import FILE_TYPES, GGUFError, read_header
from sidecar.models.resolve import (
    _SHARD_RE,
    DEFAULT_HOST,
    DEFAULT_NAMESPACE,
    ModelNotFound,
    ResolvedModel,
    Stores,
    _first_shard,
    resolve,
)
from sidecar.pairing.ranking import Profile, Suggestion, human, rank_drafts
from sidecar.pairing.rules import digest_mismatch
from sidecar.pairing.vocab import TOKENS_KEY, FileVocab, Fingerprint, VocabError

FACTS_VERSION = 1
NOT_GGUF = "not a GGUF model (safetensors/MLX): llama.cpp cannot run it"
_BLOB_RE = re.compile(r"^sha256-([0-9a-f]{64})$")


@dataclass(frozen=True)
class FileFacts:
    """What one GGUF's header says about the model; a `problem` means it cannot be paired."""

    size: int = 0  # bytes, all shards
    architecture: str | None = None
    name: str | None = None  # general.name
    basename: str | None = None  # general.basename: the model family as the converter named it
    size_label: str | None = None  # general.size_label, e.g. "135M"
    n_params: int | None = None  # elements of every tensor, summed over the shards
    file_type: str | None = None  # general.file_type's name, e.g. "Q4_K_M"
    embedding: bool = False  # {arch}.pooling_type present: Ollama's test for an embedding model
    vocab: Fingerprint | None = None
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["vocab"] = self.vocab.to_json() if self.vocab else None
        return {"v": FACTS_VERSION, **d}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FileFacts:
        """Raises KeyError/TypeError/ValueError on anything but what to_json wrote."""
        if d["v"] != FACTS_VERSION:
            raise ValueError("another facts version")
        fields = {k: v for k, v in d.items() if k != "v"}
        vocab = fields.pop("vocab")
        return cls(**fields, vocab=Fingerprint.from_json(vocab) if vocab is not None else None)


def _shards(path: Path) -> list[Path]:
    """All files of a split model named like x-00001-of-00003.gguf; just [path] otherwise."""
    m = _SHARD_RE.search(path.name)
    if m is None:
        return [path]
    head, tail = path.name[: m.start(1)], path.name[m.end(1) :]
    return [path.with_name(f"{head}{i:05d}{tail}") for i in range(1, int(m.group(2)) + 1)]


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def read_facts(path: Path) -> FileFacts:
    """One pass over the header: metadata, tensor infos, token texts. Raises OSError only when a
    file cannot be read at all (not worth caching: it may be readable next time)."""
    shards = _shards(path)
    size = sum(p.stat().st_size for p in shards if p.is_file())
    try:
        header = read_header(path, keep_strings=(TOKENS_KEY,), tensors=True)
        meta = header.metadata
        total = sum(t.n_elements for t in header.tensors)
        split = meta.get("split.count", 1)
        for shard in shards[1:] if split == len(shards) else []:
            total += sum(t.n_elements for t in read_header(shard, tensors=True).tensors)
        # Shards not named the usual way: the count is unknown rather than wrong.
        n_params = total if split == len(shards) else None
    except GGUFError as e:
        return FileFacts(size=size, problem=str(e))
    arch = _text(meta.get("general.architecture"))
    ftype = meta.get("general.file_type")
    facts = FileFacts(
        size=size, architecture=arch, name=_text(meta.get("general.name")),
        basename=_text(meta.get("general.basename")), size_label=_text(meta.get("general.size_label")),
        n_params=n_params,
        file_type=FILE_TYPES.get(ftype) if isinstance(ftype, int) else None,
        embedding=f"{arch}.pooling_type" in meta,
    )
    try:
        vocab = FileVocab.from_header(path, header).fingerprint()
    except VocabError as e:
        return replace(facts, problem=f"no usable vocabulary: {e}")
    return replace(facts, vocab=vocab)


@dataclass
class _Scan:
    cache: FileCache
    files_read: int = 0

    def facts(self, path: Path) -> FileFacts:
        try:
            key = self.cache.key(path)
            record = self.cache.get(key)
            if record is not None:
                try:
                    return FileFacts.from_json(record)
                except (KeyError, TypeError, ValueError):
                    pass  # written by another version, or damaged: read the file again
            self.files_read += 1
            facts = read_facts(path)
        except OSError as e:
            return FileFacts(problem=f"cannot read {path}: {e.strerror or e}")
        self.cache.put(key, facts.to_json())
        return facts


@dataclass(frozen=True)
class CatalogEntry:
    """One model as clients name it; `model` is None when its reference does not resolve."""

    name: str
    store: str  # "ollama" or "lmstudio"
    model: ResolvedModel | None
    digest: str | None = None  # "sha256:…" of an Ollama model blob
    family: str | None = None  # lowercase, punctuation dropped: "llama3.2", "smollm2"
    facts: FileFacts = field(default_factory=FileFacts)
    problem: str | None = None  # why it cannot be part of a pair

    @property
    def path(self) -> Path | None:
        return self.model.path if self.model else None

    @property
    def config(self) -> dict[str, Any]:
        return self.model.config if self.model else {}

    @property
    def parameter_size(self) -> str | None:
        n = self.facts.n_params
        return self.facts.size_label or (human(n) if n else None)

    @property
    def quantization(self) -> str | None:
        return self.facts.file_type or _text(self.config.get("file_type"))

    @property
    def size(self) -> int:
        """Bytes of the GGUF, all shards (as cached: an Ollama blob's size is fixed by its digest)."""
        return self.facts.size

    def profile(self) -> Profile:
        return Profile(self.name, self.facts.n_params, self.size, self.facts.architecture, self.family,
                       self.quantization)


def ollama_short_name(host: str, namespace: str, model: str, tag: str) -> str:
    """Ollama's Name.DisplayShortest: the default host and namespace go, the tag always stays."""
    if host.lower() != DEFAULT_HOST:
        return f"{host}/{namespace}/{model}:{tag}"
    if namespace.lower() != DEFAULT_NAMESPACE:
        return f"{namespace}/{model}:{tag}"
    return f"{model}:{tag}"


def _family_key(name: str | None) -> str | None:
    key = re.sub(r"[^a-z0-9.]", "", name.lower()) if name else ""
    return key or None


def _problem(facts: FileFacts, config: dict[str, Any]) -> str | None:
    caps = config.get("capabilities")
    caps = caps if isinstance(caps, list) else []
    if facts.problem:
        return facts.problem
    if facts.embedding or ("embedding" in caps and "completion" not in caps):
        return "an embedding model: it does not generate text"
    return None


def _entry(scan: _Scan, name: str, store: str, model: ResolvedModel, family: str | None = None) -> CatalogEntry:
    m = _BLOB_RE.match(model.path.name)
    facts = scan.facts(model.path)
    return CatalogEntry(name, store, model, f"sha256:{m.group(1)}" if m else None,
                        _family_key(facts.basename or family), facts, _problem(facts, model.config))


def _ollama_entries(scan: _Scan, root: Path) -> list[CatalogEntry]:
    """Manifests sit exactly four levels down: manifests/<host>/<namespace>/<model>/<tag>."""
    manifests = root / "manifests"
    out = []
    for node in sorted(manifests.glob("*/*/*/*")) if manifests.is_dir() else []:
        if not node.is_file():
            continue
        host, namespace, model, tag = node.relative_to(manifests).parts
        name = ollama_short_name(host, namespace, model, tag)
        try:
            resolved = resolve(name, ollama_root=root)
        except ModelNotFound as e:
            out.append(CatalogEntry(name, "ollama", None, problem=str(e)))
            continue
        # Library names are families (llama3.2:1b, llama3.2:3b); elsewhere a name is anyone's choice.
        library = host.lower() == DEFAULT_HOST and namespace.lower() == DEFAULT_NAMESPACE
        out.append(_entry(scan, name, "ollama", resolved, model if library else None))
    return out


def _lmstudio_entries(scan: _Scan, roots: list[Path]) -> list[CatalogEntry]:
    """GGUFs exactly two levels below a root, as LM Studio finds them; a split model is its first shard."""
    out: dict[str, CatalogEntry] = {}
    for root in roots:
        for repo in sorted(p for p in root.glob("*/*") if p.is_dir()) if root.is_dir() else []:
            rel = f"{repo.parent.name}/{repo.name}"
            ggufs = sorted(p for p in repo.glob("*.gguf") if "mmproj" not in p.name.lower() and _first_shard(p))
            if not ggufs and (any(repo.glob("*.safetensors")) or (repo / "config.json").is_file()):
                name = f"lmstudio:{rel}"
                out.setdefault(name, CatalogEntry(name, "lmstudio", None, problem=NOT_GGUF))
            for path in ggufs:
                name = f"lmstudio:{rel}/{path.name}"
                if name not in out:  # the first root wins, as in resolve
                    out[name] = _entry(scan, name, "lmstudio", ResolvedModel(name, path))
    return list(out.values())


def _list(stores: Stores, cache: FileCache | None) -> tuple[list[CatalogEntry], int]:
    scan = _Scan(FileCache() if cache is None else cache)
    entries = _ollama_entries(scan, stores.ollama_root()) + _lmstudio_entries(scan, stores.lmstudio_roots())
    scan.cache.save(prune=True)  # the listing saw every file in the stores: the rest is gone
    return entries, scan.files_read


def list_models(stores: Stores, cache: FileCache | None = None) -> list[CatalogEntry]:
    """Every model in the stores, Ollama's first; `cache` defaults to the one under cache_dir()."""
    return _list(stores, cache)[0]


@dataclass(frozen=True)
class DraftScan:
    entries: list[CatalogEntry]
    drafts: dict[str, list[Suggestion]]  # every pairable model's name -> its drafts, best first
    files_read: int  # GGUF headers read; 0 when every file was in the cache
    seconds: float


def find_drafts(stores: Stores, cache: FileCache | None = None) -> DraftScan:
    """For every model that can be a target, the models that can draft for it, best first.

    A file listed under several names is offered as a draft once, under its shortest name, and
    never for itself."""
    start = time.perf_counter()
    entries, files_read = _list(stores, cache)
    pairable = [(e, e.facts.vocab) for e in entries if e.problem is None and e.facts.vocab is not None]
    by_file: dict[str, tuple[CatalogEntry, Fingerprint]] = {}
    for e, vocab in sorted(pairable, key=lambda ev: (len(ev[0].name), ev[0].name)):
        by_file.setdefault(e.digest or str(e.path), (e, vocab))
    drafts: dict[str, list[Suggestion]] = {}
    for target, t_vocab in pairable:
        t_file = target.digest or str(target.path)
        candidates = [d.profile() for f, (d, d_vocab) in by_file.items()
                      if f != t_file and digest_mismatch(t_vocab, d_vocab) is None]
        drafts[target.name] = rank_drafts(target.profile(), candidates)
    return DraftScan(entries, drafts, files_read, time.perf_counter() - start)
