"""Pair declarations resolved to files: what the runtime serves, and how two versions differ.

A `PairEntry` is one pair of pairs.yaml with its model references resolved (the GGUF files and
the Ollama metadata that travels with them), not loaded. A reload builds new entries and the
runtime compares them with the ones it serves (`same_pair`, `same_engine`) to touch only what
changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.config.schema import Config, ModelDraft, NgramDraft, Pair
from sidecar.models import hf
from sidecar.models.gguf import read_metadata
from sidecar.models.resolve import ResolvedModel, Stores, resolve

DEFAULT_NUM_CTX = 4096
# The smallest window a load makes: llama.cpp pads every stream to 256 cells anyway, so a smaller
# num_ctx saves nothing, and below it n_batch (min(num_batch, num_ctx)) could not hold the cost
# calibration's widest batch (n_max + 1 rows, up to 65): "batch of 65 exceeds n_batch 64".
MIN_NUM_CTX = 256


@dataclass
class PairEntry:
    """A declared pair with its model references resolved (not loaded)."""

    name: str
    config: Pair
    target: ResolvedModel
    draft: ResolvedModel | None
    metadata: dict[str, Any]
    modified: float
    # The draft model the pair drafts with: the one it names, or for `draft: auto` the one
    # pairing.auto chose (`chosen` says which and why).
    model_draft: ModelDraft | None = None
    chosen: str | None = None
    auto: bool = False  # served by `auto: true` under the store model's own name
    base: Path | None = None  # the config file's directory: relative paths in it start there

    @property
    def ngram(self) -> NgramDraft | None:
        return self.config.ngram

    @property
    def draft_label(self) -> str | None:
        """What the pair drafts with, as people name it: None, "ngram", a model, or "ngram + MODEL"."""
        parts = ["ngram"] if self.ngram is not None else []
        if self.model_draft is not None:
            parts.append(self.model_draft.from_)
        return " + ".join(parts) or None

    @property
    def size(self) -> int:
        """The target's bytes on disk (a model folder's weights)."""
        path = self.target.path
        return hf.size(path) if path.is_dir() else path.stat().st_size

    @property
    def params(self) -> dict[str, Any]:
        """Option defaults: the Ollama params layer, then the pair's `parameters`."""
        return {**self.target.params, **self.config.parameters.model_dump(exclude_unset=True, exclude_none=True)}

    @property
    def system(self) -> str:
        """The pair's SYSTEM: its own, else the Ollama layer's."""
        return self.config.system or self.target.system or ""

    @property
    def history(self) -> list[dict[str, Any]]:
        """The pair's MESSAGE lines: its own, else the Ollama layer's."""
        return [m.model_dump() for m in self.config.messages] or list(self.target.messages)

    def num_ctx(self, requested: int | None) -> int:
        """The context length a request gets: asked for, else the pair's, within the model's training.

        0 means the default, as in Ollama (server/routes.go: `if opts.NumCtx == 0` takes the
        server's default); too small a window is raised to the minimum (the runtime logs it)."""
        train = int(self.metadata.get(f"{self.metadata.get('general.architecture', '')}.context_length", 0) or 0)
        n = requested or self.params.get("num_ctx") or DEFAULT_NUM_CTX
        return max(MIN_NUM_CTX, min(n, train) if train else n)


def build_entry(name: str, pair: Pair, base: Path | None = None, stores: Stores | None = None,
                model_draft: ModelDraft | None = None, chosen: str | None = None, auto: bool = False) -> PairEntry:
    """Resolve a pair's models; `model_draft` stands in for the one the pair names (`draft: auto`)."""
    folders = pair.engine == "vllm"
    target = resolve(pair.from_, base=base, stores=stores, folders=folders)
    model_draft = model_draft or pair.model_draft
    draft = resolve(model_draft.from_, base=base, stores=stores, folders=folders) if model_draft is not None else None
    return PairEntry(name, pair, target, draft, metadata_of(target.path), _modified(target.path),
                     model_draft, chosen, auto, base)


def metadata_of(path: Path, *, full: bool = False) -> dict[str, Any]:
    """A GGUF's metadata, or a model folder's under the same keys (models.hf)."""
    return hf.read_metadata(path) if path.is_dir() else read_metadata(path, full=full)


def _modified(path: Path) -> float:
    """When the model last changed: a folder's newest file (a re-converted folder is a new model)."""
    if path.is_dir():
        return max((p.stat().st_mtime for p in path.iterdir() if p.is_file()), default=path.stat().st_mtime)
    return path.stat().st_mtime


def build_entries(config: Config, base: Path, stores: Stores | None = None
                  ) -> tuple[dict[str, PairEntry], dict[str, str]]:
    """Resolve every pair's models; a pair that fails is reported, the others still build."""
    entries: dict[str, PairEntry] = {}
    errors: dict[str, str] = {}
    for name, pair in config.pairs.items():
        try:
            entries[name] = build_entry(name, pair, base, stores)
        except Exception as e:  # ModelNotFound, GGUFError, OSError: each names its file
            errors[name] = str(e)
    return entries, errors


def same_pair(a: PairEntry, b: PairEntry) -> bool:
    """The same declaration resolving to the same files and store metadata: nothing to do."""
    return (a.name == b.name and a.config == b.config and a.target == b.target and a.draft == b.draft
            and a.modified == b.modified and a.model_draft == b.model_draft)


def same_engine(a: PairEntry, b: PairEntry) -> bool:
    """Whether b can ride on the drafter built for a: only its defaults/template/system differ.

    A pair's engine depends on the target, the draft, the speculative settings and the runtime
    settings; `parameters`, `template`, `system` and `messages` are read per request."""
    ca, cb = a.config, b.config
    return (a.name == b.name and a.target.path == b.target.path and a.modified == b.modified
            and (a.draft.path if a.draft else None) == (b.draft.path if b.draft else None)
            and a.model_draft == b.model_draft and ca.ngram == cb.ngram and ca.speculative == cb.speculative
            and ca.runtime == cb.runtime)


@dataclass
class Changes:
    """What applying a new set of pairs did, by pair name (for the reload log line and /sidecar/status)."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        parts = [f"{k} {', '.join(v)}" for k, v in vars(self).items() if v and k != "kept"]
        return "; ".join(parts) or "no pair changed"
