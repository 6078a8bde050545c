"""The real demo model, SmolLM2-135M-Instruct, through the daemon."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import numpy as np
import ollama
import pytest

from tests.conftest import Daemon

pytestmark = pytest.mark.daemon

MODEL = "smollm2:135m"


def test_chat_answers_coherently(daemon: Daemon) -> None:
    client = ollama.Client(host=daemon.url)
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Which city is the capital of France?"}],
                    options={"temperature": 0, "num_predict": 48})
    assert "Paris" in r.message.content
    assert r.done_reason in ("stop", "length") and r.eval_count > 0


def direct_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with llama-cpp-python's own Llama, same prompt split as the daemon:
    everything but the last prompt token in one eval, then one token per eval."""
    llm = llama_cpp.Llama(str(path), n_ctx=2048, n_batch=512, n_threads=None, flash_attn=False,
                          n_gpu_layers=0, verbose=False)
    llm.eval(prompt[:-1])
    out: list[int] = []
    tok = prompt[-1]
    n_vocab = llm.n_vocab()
    for _ in range(n):
        llm.eval([tok])
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        tok = int(np.argmax(logits))
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
            break
        out.append(tok)
    return out


def test_greedy_over_api_equals_direct_llama_cpp(daemon: Daemon, smollm2: Path) -> None:
    """The daemon's greedy tokens (streamed over HTTP) are llama-cpp-python's greedy tokens."""
    client = ollama.Client(host=daemon.url)
    for question in ("Write a story about a lighthouse keeper.", "Explain how a compiler works."):
        for draft_num_predict in (0, None):  # target-only, then with the pair's n-gram drafter
            options = {"temperature": 0, "num_predict": 96}
            if draft_num_predict is not None:
                options["draft_num_predict"] = draft_num_predict
            chunks = list(client.chat(model=MODEL, messages=[{"role": "user", "content": question}],
                                      options=options, stream=True))
            final = chunks[-1]
            # /api/chat returns no context; the same prompt through /api/generate does.
            gen = client.generate(model=MODEL, prompt=question, options=options)
            cut = len(gen.context) - gen.eval_count  # prompt_eval_count skips the cached prompt tokens
            prompt, output = gen.context[:cut], gen.context[cut:]
            assert output == direct_greedy(smollm2, prompt, 96)
            assert "".join(c.message.content for c in chunks) == gen.response
            assert final.eval_count == len(output)
