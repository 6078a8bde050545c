"""Models derived from SmolLM2 for draft suggestion tests, and an Ollama store to hold them.

bench/derive_models.py does the tensor work: `extend` pads SmolLM2 with layers that add exactly
zero to the residual stream (the same function at several times the cost: a draft that always
agrees), and its writer copies quantised tensors as raw bytes, so a derivation takes seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import gguf

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from derive_models import _block_count_key, _layers, _write, extend, scale_tensor_bytes  # noqa: E402

__all__ = ["add_ollama_model", "extend", "inverted_draft"]

MEDIA = "application/vnd.ollama.image."


def inverted_draft(src: Path, dst: Path, n_layers: int = 2) -> Path:
    """SmolLM2's first layers with the final norm's weights negated: every logit changes sign, so its
    argmax is SmolLM2's argmin and it never agrees with a SmolLM2-derived target. It shares the
    vocabulary, so only a probe can tell it is useless; its own family name (`inverted`) is what a
    model sharing a tokenizer with another family would say."""
    reader = gguf.GGUFReader(str(src))
    other, layers = _layers(reader)
    tensors = [(t.name, t, scale_tensor_bytes(t.data, t.tensor_type, -1.0) if t.name == "output_norm.weight"
                else t.data) for t in other]
    tensors += [(t.name, t, t.data) for i in range(n_layers) for t in layers[i]]
    _write(reader, dst, tensors, {_block_count_key(reader): n_layers, gguf.Keys.General.NAME: "Inverted",
                                  gguf.Keys.General.BASENAME: "inverted", gguf.Keys.General.SIZE_LABEL: "35M"})
    return dst


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


def add_ollama_model(root: Path, manifest: str, model: Path, config: dict[str, Any] | None = None) -> None:
    """A model as `ollama pull` leaves it: manifests/<host>/<namespace>/<model>/<tag>, blobs by digest."""
    config = config or {"model_format": "gguf", "model_family": "llama", "capabilities": ["completion"]}
    doc = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
           "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                      **_blob(root, json.dumps(config).encode())},
           "layers": [{"mediaType": MEDIA + "model", **_blob(root, model)}]}
    path = root / "manifests" / manifest
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
