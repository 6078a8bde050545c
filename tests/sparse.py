"""GGUF files with the header and tensor infos of real models and the data a hole: sparse files.

A 70B Q4_K_M target is 42 GB; here it is a few megabytes of header (the tensor infos of the real
shapes, with llama.cpp's Q4_K_M type mix) followed by a hole of the right length, so the memory
plan (runtime.memory) reads exactly what it would from the real file and no disk is used. The
vocabulary is tests/models.py's tiny SPM one padded with unreachable tokens to the real size, so
llama.cpp can read it (a vocab-only load) and the daemon can resolve the pair and render prompts.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.models import CHATML_TEMPLATE, UNK_ID, tiny_vocab

F32, F16, Q5_0, Q8_0, Q4_K, Q6_K = 0, 1, 6, 8, 12, 14
# A row that is not a whole number of 256-element K-quant blocks (Qwen2.5-72B's 29568-wide FFN) is
# stored in a 32-element type instead (llama-quant.cpp's fallback).
_FALLBACK = {Q4_K: Q5_0, Q6_K: Q8_0}
_ALIGN = 32


@dataclass(frozen=True)
class Arch:
    """The hyperparameters of a published model."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    head_dim: int = 0  # 0: n_embd / n_head
    bias: bool = False  # Qwen2's q/k/v biases
    tied: bool = False  # no output.weight: the token embeddings are the output
    sliding_window: int = 0
    qk_norm: bool = False  # Gemma-3's per-head q/k norms and post norms


# From each model's config.json on Hugging Face.
LLAMA_70B = Arch("llama", 80, 8192, 64, 8, 28672, 128256, 131072)
LLAMA_8B = Arch("llama", 32, 4096, 32, 8, 14336, 128256, 131072)
QWEN_72B = Arch("qwen2", 80, 8192, 64, 8, 29568, 152064, 32768, bias=True)
QWEN_3B = Arch("qwen2", 36, 2048, 16, 2, 11008, 151936, 32768, bias=True, tied=True)
GEMMA3_27B = Arch("gemma3", 62, 5376, 32, 16, 21504, 262208, 131072, head_dim=128, tied=True,
                  sliding_window=1024, qk_norm=True)
GEMMA3_1B = Arch("gemma3", 26, 1152, 4, 1, 6912, 262144, 32768, head_dim=256, tied=True,
                 sliding_window=512, qk_norm=True)


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits (llama-quant.cpp): the layers Q4_K_M stores attn_v and ffn_down in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_tensors(a: Arch) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, ggml shape (ne0 first), ggml type) of every tensor, as llama.cpp's Q4_K_M writes them."""
    hd = a.head_dim or a.n_embd // a.n_head
    q, kv = a.n_head * hd, a.n_head_kv * hd
    embd = Q6_K if a.tied else Q4_K  # a tied embedding is the output too: kept in the output's type
    out: list[tuple[str, tuple[int, ...], int]] = [("token_embd.weight", (a.n_embd, a.n_vocab), embd)]
    for i in range(a.n_layer):
        b = f"blk.{i}."
        hi = Q6_K if _more_bits(i, a.n_layer) else Q4_K
        out += [
            (b + "attn_norm.weight", (a.n_embd,), F32),
            (b + "attn_q.weight", (a.n_embd, q), Q4_K),
            (b + "attn_k.weight", (a.n_embd, kv), Q4_K),
            (b + "attn_v.weight", (a.n_embd, kv), hi),
            (b + "attn_output.weight", (q, a.n_embd), Q4_K),
            (b + "ffn_norm.weight", (a.n_embd,), F32),
            (b + "ffn_gate.weight", (a.n_embd, a.n_ff), Q4_K),
            (b + "ffn_up.weight", (a.n_embd, a.n_ff), Q4_K),
            (b + "ffn_down.weight", (a.n_ff, a.n_embd), hi),
        ]
        if a.bias:
            out += [(b + "attn_q.bias", (q,), F32), (b + "attn_k.bias", (kv,), F32), (b + "attn_v.bias", (kv,), F32)]
        if a.qk_norm:
            out += [(b + "attn_q_norm.weight", (hd,), F32), (b + "attn_k_norm.weight", (hd,), F32),
                    (b + "post_attention_norm.weight", (a.n_embd,), F32),
                    (b + "post_ffw_norm.weight", (a.n_embd,), F32)]
    out.append(("output_norm.weight", (a.n_embd,), F32))
    if not a.tied:
        out.append(("output.weight", (a.n_embd, a.n_vocab), Q6_K))
    return out


_BLOCK = {F32: (1, 4), F16: (1, 2), Q5_0: (32, 22), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}


def _fit(shape: tuple[int, ...], ggml_type: int) -> int:
    return _FALLBACK.get(ggml_type, ggml_type) if shape[0] % _BLOCK[ggml_type][0] else ggml_type


def nbytes(shape: tuple[int, ...], ggml_type: int) -> int:
    block, size = _BLOCK[ggml_type]
    n = 1
    for d in shape[1:]:
        n *= d
    return n * (shape[0] // block) * size


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _value(v: Any) -> bytes:
    """A typed GGUF value: bool, uint32, float32, string, or an array of one of those."""
    if isinstance(v, bool):
        return struct.pack("<I?", 7, v)
    if isinstance(v, int):
        return struct.pack("<Ii", 5, v) if v < 0 else struct.pack("<II", 4, v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + _string(v)
    items = list(v)
    if items and isinstance(items[0], str):
        return struct.pack("<IIQ", 9, 8, len(items)) + b"".join(_string(s) for s in items)
    if items and isinstance(items[0], float):
        return struct.pack("<IIQ", 9, 6, len(items)) + struct.pack(f"<{len(items)}f", *items)
    return struct.pack("<IIQ", 9, 5, len(items)) + struct.pack(f"<{len(items)}i", *items)


def write_sparse(path: Path, metadata: dict[str, Any], tensors: list[tuple[str, tuple[int, ...], int]]) -> Path:
    """A GGUF v3 file: the header and tensor infos written, the data a hole of the right length."""
    head = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for k, v in metadata.items():
        head += _string(k) + _value(v)
    offset = 0
    for name, shape, t in tensors:
        head += _string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
        head += struct.pack("<IQ", t, offset)
        offset += (nbytes(shape, t) + _ALIGN - 1) // _ALIGN * _ALIGN
    head += b"\0" * (-len(head) % _ALIGN)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + offset)
    return path


def write_model(path: Path, a: Arch, name: str) -> Path:
    """A sparse Q4_K_M GGUF of the published model `a`, loadable vocabulary-only."""
    texts, types = tiny_vocab("bytes", a.n_vocab - 262)
    p = a.arch
    md: dict[str, Any] = {
        "general.architecture": p, "general.name": name, "general.file_type": 15,  # Q4_K_M
        f"{p}.block_count": a.n_layer, f"{p}.context_length": a.n_ctx_train, f"{p}.embedding_length": a.n_embd,
        f"{p}.feed_forward_length": a.n_ff, f"{p}.attention.head_count": a.n_head,
        f"{p}.attention.head_count_kv": a.n_head_kv, f"{p}.rope.freq_base": 500000.0,
        f"{p}.attention.layer_norm_rms_epsilon": 1e-5,
    }
    if a.head_dim:
        md[f"{p}.attention.key_length"] = md[f"{p}.attention.value_length"] = a.head_dim
    if a.sliding_window:
        md[f"{p}.attention.sliding_window"] = a.sliding_window
    md.update({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": texts, "tokenizer.ggml.scores": [0.0] * len(texts),
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.unknown_token_id": UNK_ID,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": texts.index("<|im_end|>"),
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    })
    return write_sparse(path, md, [(n, shape, _fit(shape, t)) for n, shape, t in q4_k_m_tensors(a)])
