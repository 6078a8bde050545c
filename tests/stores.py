"""Model stores on disk for the tests: an Ollama store as `ollama pull` leaves it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MEDIA = "application/vnd.ollama.image."


def _blob(root: Path, content: bytes | Path) -> dict[str, Any]:
    """A blob named by its digest; a model file is hard-linked in (copied across file systems)."""
    h = hashlib.sha256()
    if isinstance(content, bytes):
        h.update(content)
    else:
        with open(content, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    digest = "sha256:" + h.hexdigest()
    path = root / "blobs" / digest.replace(":", "-")
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif not path.exists():
        try:
            os.link(content, path)
        except OSError:
            shutil.copyfile(content, path)
    return {"digest": digest, "size": path.stat().st_size}


def add_ollama_model(root: Path, manifest: str, gguf: Path | bytes, *, template: str | None = None,
                     system: str | None = None, params: dict[str, Any] | None = None,
                     messages: list[dict[str, str]] | None = None, extra: Sequence[tuple[str, bytes]] = (),
                     config: dict[str, Any] | None = None) -> Path:
    """Write a model into an Ollama store as `ollama pull` leaves it.

    `manifest` is the path under manifests/ (host/namespace/model/tag), spelled out so tests do not
    lean on the name parser they test. `config` adds to the config blob (renderer, parser,
    capabilities, model_family)."""
    layers = [{"mediaType": MEDIA + "model", **_blob(root, gguf)}]
    if template is not None:
        layers.append({"mediaType": MEDIA + "template", **_blob(root, template.encode())})
    if system is not None:
        layers.append({"mediaType": MEDIA + "system", **_blob(root, system.encode())})
    if params is not None:
        layers.append({"mediaType": MEDIA + "params", **_blob(root, json.dumps(params).encode())})
    if messages is not None:
        layers.append({"mediaType": MEDIA + "messages", **_blob(root, json.dumps(messages).encode())})
    layers += [{"mediaType": MEDIA + kind, **_blob(root, body)} for kind, body in extra]
    config = {"model_format": "gguf", "model_family": "llama", "file_type": "F32", **(config or {})}
    doc = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
           "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                      **_blob(root, json.dumps(config).encode())},
           "layers": layers}
    path = root / "manifests" / manifest
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def pairing_store(d: Path, smollm2: Path) -> None:
    """The store the pairing tests share, under d: in an Ollama store, SmolLM2 padded with 180 zero
    layers (5x its cost and file, so the ranking puts SmolLM2 in its best size range: the target),
    SmolLM2 itself (its draft) and a tiny model with another vocabulary; in an LM Studio folder, a
    draft of SmolLM2's vocabulary that never agrees."""
    from tests.derived import extend, inverted_draft
    from tests.models import write_tiny_llama

    padded = extend(smollm2, d / "files" / "x180.gguf", extra_layers=180)
    root = d / "ollama"
    add_ollama_model(root, "registry.ollama.ai/library/smollm2/x180", padded)
    add_ollama_model(root, "registry.ollama.ai/library/smollm2/135m", smollm2)
    add_ollama_model(root, "registry.ollama.ai/library/tiny/latest", write_tiny_llama(d / "files" / "tiny.gguf"))
    inverted_draft(smollm2, d / "lmstudio" / "test" / "Inverted-GGUF" / "smollm2-inverted-trunc2.gguf")
