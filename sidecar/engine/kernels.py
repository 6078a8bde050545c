"""Which of llama.cpp's CPU kernels score a token inside a batch exactly as they score it alone.

Greedy speculative output equals the target alone only if a token's logits do not depend on how
many rows share its llama_decode (README, "Losslessness"). Several CPU matmuls in ggml take other
code for a batch than for one row, and sum in another order:
- llamafile's sgemm and AMX-INT8: left out of the build (scripts/backend.sh); `build_warnings`
  names them where a build has them;
- the tiled K-quant matmul, from 8 rows: off for this process (GGML_CPU_TILED_MM, which ggml reads
  at its first use; a value set outside wins);
- the repacked kernels (llama.cpp's extra buffer types): exact for Q4_0, not for Q4_K from 4 rows,
  so `repack_is_exact` keeps K-quant and IQ weights on the CPU off them (engine.llama.Weights).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

os.environ.setdefault("GGML_CPU_TILED_MM", "0")  # before llama_cpp loads ggml

import llama_cpp as C

# Build flags (system_info's "NAME = 1") of kernels that run only for batches.
BATCH_ONLY_KERNELS = {"LLAMAFILE": "llamafile's sgemm", "AMX_INT8": "AMX-INT8"}


def flags_on(info: str) -> set[str]:
    """The flags a build's system_info() shows as "NAME = 1" ("CPU : SSE3 = 1 | AVX = 1 | ...")."""
    return {k.strip() for part in info.split("|") for k, _, v in [part.rpartition(" : ")[2].partition("=")]
            if v.strip() == "1"}


def build_warnings(info: str) -> list[str]:
    """What in a build's system_info() breaks exact greedy equality on the CPU, as sentences."""
    on = flags_on(info)
    return [f"this llama.cpp build has {what} ({flag} = 1): on the CPU, speculative greedy output can part "
            "from target-only output (rebuild with `make rebuild-llama`; README, Losslessness)"
            for flag, what in BATCH_ONLY_KERNELS.items() if flag in on]


def repack_is_exact(file_type: str | None) -> bool:
    """Whether the repacked kernels are exact for weights of `general.file_type`'s name (measured:
    Q4_0 yes, Q4_K_M no); K-quants and IQ types load without them."""
    return not file_type or not (file_type.startswith("IQ") or "_K" in file_type)


# general.file_type's names, from llama.cpp's own enum (LLAMA_FTYPE_MOSTLY_Q4_K_M is "Q4_K_M").
FILE_TYPES = {v: k.split("_", 3)[-1] for k, v in vars(C).items()
              if k.startswith(("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_"))}


def file_type(path: str | Path) -> str | None:
    """`general.file_type`'s name ("Q4_K_M"), as llama.cpp reads the file's header (a vocabulary-only
    load reads no weights). Every Weights asks it, so the kernels a load gets are the file's to decide
    (repack_is_exact) and no caller can forget to. None when the file does not say, or llama.cpp
    cannot read it (the full load then says why). Weights has set up llama.cpp's logging first."""
    params = C.llama_model_default_params()
    params.vocab_only = True
    model = C.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        return None
    try:
        buf = ctypes.create_string_buffer(32)
        if C.llama_model_meta_val_str(model, b"general.file_type", buf, len(buf)) <= 0:
            return None
        return FILE_TYPES.get(int(buf.value)) if buf.value.isdigit() else None
    finally:
        C.llama_model_free(model)
