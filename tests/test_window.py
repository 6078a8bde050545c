"""The context window as Ollama handles it, through the daemon: chat truncation, prompt cutting,
context shift during generation (lossless under speculation), and the switches that turn each off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sidecar.engine.llama import Weights
from tests.conftest import SMOLLM2_REF, Daemon, write_config
from tests.models import write_tiny_llama

pytestmark = pytest.mark.daemon

T = 300
NUM_CTX = 256


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Iterator[tuple[Daemon, Path]]:
    d = tmp_path_factory.mktemp("window")
    tiny = write_tiny_llama(d / "endless.gguf", seed=1, end_bias=0.0)
    cfg = write_config(d / "pairs.yaml", f"""
pairs:
  tiny:window:
    from: {tiny}
    system: You are terse.
    parameters: {{temperature: 0, num_ctx: {NUM_CTX}}}
    runtime: {{num_thread: 1}}
  smollm2:window:
    from: {SMOLLM2_REF}
    draft: ngram
    parameters: {{temperature: 0, num_ctx: 128}}
    runtime: {{num_gpu: 0}}
    speculative: {{adaptive: false}}  # always draft: on a busy machine the planner may judge drafts too costly
""")
    daemon = Daemon(cfg)
    yield daemon, tiny
    daemon.stop()


def chatml(messages: list[dict[str, str]]) -> str:
    """The tiny model's ChatML template, by hand (tests/models.py CHATML_TEMPLATE)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
        "<|im_start|>assistant\n"


def test_a_long_chat_keeps_the_system_message_and_the_newest_turns(setup: tuple[Daemon, Path]) -> None:
    """server/prompt.go chatPrompt: drop the oldest messages until the prompt fits in num_ctx
    tokens; the system messages and the last message always stay."""
    d, tiny = setup
    system = {"role": "system", "content": "You are terse."}
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message number {i} " * 3}
               for i in range(40)]
    r = httpx.post(d.url + "/api/chat", timeout=T, json={
        "model": "tiny:window", "messages": history, "_debug_render_only": True})
    rendered = r.json()["_debug_info"]["rendered_template"]
    w = Weights(tiny, n_gpu_layers=0)
    try:
        def fits(i: int) -> bool:
            return len(w.tokenize(chatml([system, *history[i:]]), add_special=True, parse_special=True)) <= NUM_CTX
        first = next(i for i in range(len(history)) if fits(i))
        assert first > 0 and not fits(first - 1)
    finally:
        w.close()
    assert rendered == chatml([system, *history[first:]])
    r = httpx.post(d.url + "/api/chat", timeout=T, json={
        "model": "tiny:window", "messages": history, "truncate": False, "_debug_render_only": True})
    assert r.json()["_debug_info"]["rendered_template"] == chatml([system, *history])
    r = httpx.post(d.url + "/api/chat", timeout=T, json={
        "model": "tiny:window", "messages": history, "truncate": False, "stream": False})
    assert r.status_code == 400 and "context" in r.json()["error"]
    ok = httpx.post(d.url + "/api/chat", timeout=T, json={
        "model": "tiny:window", "messages": history, "stream": False, "options": {"num_predict": 4}})
    assert ok.status_code == 200 and ok.json()["prompt_eval_count"] <= NUM_CTX


def test_generation_shifts_the_window_and_goes_on(setup: tuple[Daemon, Path]) -> None:
    d, _ = setup
    body = {"model": "tiny:window", "prompt": "go", "stream": False, "options": {"num_predict": 3 * NUM_CTX}}
    r = httpx.post(d.url + "/api/generate", timeout=T, json=body).json()
    assert r["eval_count"] == 3 * NUM_CTX and r["done_reason"] == "length"
    r = httpx.post(d.url + "/api/generate", timeout=T, json={**body, "shift": False}).json()
    assert r["eval_count"] < NUM_CTX and r["done_reason"] == "length"  # stopped where the window filled


def test_speculation_stays_lossless_across_shifts(setup: tuple[Daemon, Path]) -> None:
    """SmolLM2 with n-gram drafts in a 128-token window: the same answer with and without drafting."""
    d, _ = setup
    body = {"model": "smollm2:window", "prompt": "Repeat after me: the cat sat on the mat. " * 3, "raw": True,
            "stream": False, "options": {"num_predict": 300}}
    plain = httpx.post(d.url + "/api/generate", timeout=T, json={
        **body, "options": {**body["options"], "draft_num_predict": 0}}).json()
    spec = httpx.post(d.url + "/api/generate", timeout=T, json=body).json()
    assert plain["prompt_eval_count"] + plain["eval_count"] > 128  # the window was shifted
    assert plain["response"] == spec["response"]
    assert spec["draft_tokens"] > 0  # it did draft
