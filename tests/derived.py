"""Models derived from SmolLM2 for draft suggestion tests, and an Ollama store to hold them.

bench/derive_models.py does the tensor work: `extend` pads SmolLM2 with layers that add exactly
zero to the residual stream (the same function at several times the cost: a draft that always
agrees), and its writer copies quantised tensors as raw bytes, so a derivation takes seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from derive_models import _block_count_key, _layers, _write, extend, scale_tensor_bytes  # noqa: E402

__all__ = ["extend", "inverted_draft"]


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
