"""The context window: fitting a prompt that is too long, and making room when generation fills it.

Both follow what Ollama (2026) does through llama-server, so a client sees the same behaviour:

* A prompt longer than n_ctx - 1 tokens is cut as Ollama's completionPromptForRequest cuts it
  (llm/llama_server.go): keep its first `num_keep` tokens (+1 when the vocabulary adds a BOS), and
  drop what follows them until the prompt is `contextShiftPromptLimit(n_ctx, n_keep)` tokens, which
  leaves about half of the rest of the window for the answer.
* A full window during generation is shifted as llama-server shifts it (tools/server, "context
  shift"): keep n_keep tokens (num_keep, or the whole prompt for -1, +1 with a BOS; at most
  n_ctx - 4), and drop half of the rest, `(n_past - n_keep) // 2` tokens, right after the kept head.
"""

from __future__ import annotations

from collections.abc import Sequence


def _n_keep(num_keep: int, n_prompt: int, add_bos: bool) -> int:
    """num_keep counts tokens after the BOS, as Ollama's option does; -1 keeps the whole prompt."""
    return (n_prompt if num_keep < 0 else num_keep) + (1 if add_bos else 0)


def prompt_limit(n_ctx: int, n_keep: int) -> int:
    """Ollama's contextShiftPromptLimit: the most prompt tokens a truncated prompt keeps."""
    if n_ctx <= 1:
        return 0
    n_keep = max(0, min(n_keep, n_ctx - 1))
    return n_ctx - max((n_ctx - n_keep) // 2, 1)


def truncate_prompt(prompt: Sequence[int], n_ctx: int, num_keep: int, add_bos: bool) -> list[int]:
    """The prompt Ollama would send for `prompt` (unchanged when it fits in n_ctx - 1 tokens)."""
    if n_ctx <= 1 or len(prompt) <= n_ctx - 1:
        return list(prompt)
    n_keep = min(_n_keep(num_keep, len(prompt), add_bos), n_ctx - 1)
    limit = prompt_limit(n_ctx, n_keep)
    discard = len(prompt) - limit
    return [*prompt[:n_keep], *prompt[n_keep + discard :]]


def shift_span(n_past: int, n_ctx: int, num_keep: int, n_prompt: int, add_bos: bool) -> tuple[int, int]:
    """(keep, discard) of llama-server's context shift for a cache holding n_past tokens.

    The +1 for a BOS applies to num_keep -1 too (where the prompt already holds it), as in
    llama-server. discard is 0 when nothing can be freed; the caller then stops."""
    n_keep = max(0, min(n_ctx - 4, _n_keep(num_keep, n_prompt, add_bos)))
    return n_keep, max(0, (n_past - n_keep) // 2)
