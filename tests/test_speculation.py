"""Pairing rules, fallback and the speculation counters, on real models and the real daemon."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.decoder import Decoder, Request, Result
from sidecar.engine.drafters import ModelDrafter
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.sampling import SamplingParams
from sidecar.pairing.rules import IncompatibleDraft, check_pair
from tests.conftest import SMOLLM2_REF, Daemon, write_config
from tests.models import write_tiny_llama
from tests.prices import Fixed

pytestmark = pytest.mark.daemon


@pytest.fixture(scope="module")
def stranger(model_dir: Path) -> Path:
    """Same vocabulary as the tiny target, unrelated weights: its guesses are almost never right."""
    return write_tiny_llama(model_dir / "stranger.gguf", seed=77)


@pytest.fixture(scope="module")
def shifted(model_dir: Path) -> Path:
    """A vocabulary whose token texts differ from the tiny models' from some id on."""
    return write_tiny_llama(model_dir / "shifted.gguf", seed=3, vocab="shifted")


def test_pairing_rejects_a_different_vocabulary(tiny: Path, shifted: Path) -> None:
    a, b = Weights(tiny, n_gpu_layers=0), Weights(shifted, n_gpu_layers=0)
    try:
        with pytest.raises(IncompatibleDraft) as e:
            check_pair(a, b)
        msg = str(e.value)
        assert tiny.name in msg and shifted.name in msg and "token" in msg
    finally:
        a.close()
        b.close()


def test_pairing_accepts_the_same_vocabulary(tiny_pair: tuple[Path, Path]) -> None:
    a, b = (Weights(p, n_gpu_layers=0) for p in tiny_pair)
    check_pair(a, b)
    a.close()
    b.close()


def test_a_draft_that_never_agrees_falls_back(tiny_endless: Path, stranger: Path) -> None:
    # A target that never ends its output, so there are enough rounds to judge the draft.
    tw, dw = Weights(tiny_endless, n_gpu_layers=0), Weights(stranger, n_gpu_layers=0)
    ctx, dctx = Context(tw, ContextParams(n_ctx=512, n_threads=1)), Context(dw, ContextParams(n_ctx=512, n_threads=1))
    try:
        config = SpeculativeConfig(n_max=4, p_min=0.0)
        # A flat curve, as on an ideal GPU (verifying 5 rows costs what 1 does, and a batch costs
        # the plain steps after it nothing), and a draft token at a tenth of a target step: drafting
        # pays a priori, and only the draft's acceptance can switch it off.
        cost = Fixed(config.n_max + 1)  # the planner learns no times (tests/prices.py)
        cost.t_step = [0.0] + [0.01] * (config.n_max + 1)
        cost.t_draft = 0.001
        prompt = tw.tokenize("fallback please", add_special=True, parse_special=False)
        events = list(Decoder(ctx, ModelDrafter(dctx), config, cost).generate(
            Request(prompt, SamplingParams(temperature=0), num_predict=200)))
        result = events[-1]
        assert isinstance(result, Result)
        assert len(result.tokens) == 200
        assert result.draft_rounds >= 1, "the draft should have been tried"
        assert result.fallback, "speculation should have been switched off"
        assert result.draft_accepted_tokens < result.draft_tokens
        # Nearly every round after the first few ran target-only.
        assert result.draft_rounds < 40
    finally:
        for x in (dctx, ctx, dw, tw):
            x.close()


def test_daemon_reports_pairing_errors_and_keeps_serving(tmp_path: Path, tiny: Path, shifted: Path) -> None:
    cfg = write_config(tmp_path / "pairs.yaml", f"""
pairs:
  bad:pair:
    from: {tiny}
    draft: {shifted}
  good:pair:
    from: {tiny}
""")
    check = subprocess.run([sys.executable, "-m", "sidecar.cli", "check", "--config", str(cfg)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode != 0
    assert "bad:pair" in check.stdout and "token" in check.stdout
    d = Daemon(cfg)
    try:
        r = httpx.post(d.url + "/api/generate", json={"model": "bad:pair", "prompt": "x", "stream": False},
                       timeout=60)
        assert r.status_code == 500 and "cannot speculate" in r.json()["error"]
        ok = httpx.post(d.url + "/api/generate", json={
            "model": "good:pair", "prompt": "x", "stream": False, "options": {"num_predict": 4}}, timeout=60)
        assert ok.status_code == 200 and ok.json()["done"]
    finally:
        d.stop()


def test_final_chunk_carries_speculation_counters(daemon: Daemon) -> None:
    """SmolLM2 with the n-gram drafter, asked to edit code it must mostly copy: drafts are proposed
    and accepted. The daemon's pair drafts whenever the cost model says it pays, which depends on
    this machine's verify curve, so the counters are checked on a pair that always drafts too."""
    code = (
        "def load_settings(path):\n    with open(path) as handle:\n        lines = handle.read().splitlines()\n"
        "    settings = {}\n    for line in lines:\n        if not line or line.startswith('#'):\n"
        "            continue\n        key, value = line.split('=', 1)\n"
        "        settings[key.strip()] = value.strip()\n    return settings\n"
    )
    edit = (f"Here is a Python function:\n\n{code}\nRename `settings` to `config` everywhere. "
            "Reply with the complete edited function only.")

    def chat(url: str, model: str, content: str, n: int) -> dict:
        # Raw HTTP: the official client's response models drop fields they do not know.
        return httpx.post(url + "/api/chat", timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": content}], "stream": False,
            "options": {"temperature": 0, "num_predict": n}}).json()

    r = chat(daemon.url, "smollm2:135m", edit, 64)
    for key in ("draft_tokens", "draft_accepted_tokens", "draft_rounds", "fallback"):
        assert key in r
    assert r["draft_tokens"] >= r["draft_accepted_tokens"] >= 0
    cfg = write_config(daemon.log_path.parent / "always.yaml", f"""
pairs:
  smollm2:always:
    from: {SMOLLM2_REF}
    draft: ngram
    speculative: {{adaptive: false, n_max: 4}}
""")
    always = Daemon(cfg)
    try:
        r = chat(always.url, "smollm2:always", edit, 64)
    finally:
        always.stop()
    assert r["draft_rounds"] > 0 and r["draft_tokens"] >= r["draft_accepted_tokens"] > 0
    assert r["fallback"] is None
    off = chat(daemon.url, "smollm2:135m", "hi", 8)
    assert off["draft_rounds"] == 0 and "short output" in off["fallback"]
