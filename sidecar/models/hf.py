"""A Hugging Face model folder (config.json, tokenizer files, safetensors) as the daemon reads it.

vLLM loads such folders; llama.cpp does not. The rest of the daemon knows models by GGUF
metadata keys (the chat template, the architecture, the context length), so a folder's
metadata is read into the same keys, and templates, capabilities and /api/show work the same
for a vLLM pair as for a llama.cpp one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG = "config.json"


def is_folder(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG).is_file()


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read: {e}") from None
    return data if isinstance(data, dict) else {}


def _token_text(v: Any) -> str:
    """tokenizer_config.json writes a special token as text or as an AddedToken mapping."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else ""


def read_metadata(folder: Path) -> dict[str, Any]:
    """config.json and tokenizer_config.json under the GGUF keys the daemon reads."""
    config = _json(folder / CONFIG)
    tok = _json(folder / "tokenizer_config.json")
    arch = str(config.get("model_type") or "unknown")
    meta: dict[str, Any] = {
        "general.architecture": arch,
        "general.name": folder.name,
        "general.type": "model",
    }
    for key, gguf in (("max_position_embeddings", "context_length"), ("num_hidden_layers", "block_count"),
                      ("hidden_size", "embedding_length"), ("num_attention_heads", "attention.head_count"),
                      ("vocab_size", "vocab_size")):
        if isinstance(config.get(key), int):
            meta[f"{arch}.{gguf}"] = config[key]
    template = tok.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if isinstance(template, str) and template:
        meta["tokenizer.chat_template"] = template
    elif (folder / "chat_template.jinja").is_file():
        meta["tokenizer.chat_template"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for key in ("bos_token", "eos_token"):
        if _token_text(tok.get(key)):
            meta[f"tokenizer.{key}"] = _token_text(tok[key])
    meta["tokenizer.ggml.add_bos_token"] = bool(tok.get("add_bos_token", False))
    return meta


def size(folder: Path) -> int:
    """The bytes of the weights (what /api/tags and /api/ps call the size)."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")) or sum(
        p.stat().st_size for p in folder.iterdir() if p.is_file())
