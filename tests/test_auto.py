"""Pairing without homework, on a real store through the official client: `draft: auto` picks the
draft the stores hold for the target, `auto: true` serves every store model with one worth pairing
under the model's own name, and explicit pairs win."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

from sidecar.cli import cmd_check
from tests.conftest import Daemon, write_config
from tests.stores import pairing_store

pytestmark = pytest.mark.daemon

T = 300
COPY = ("Repeat this list exactly, one item per line: apples, pears, plums, cherries, "
        "grapes, melons, lemons, limes, figs, dates, kiwis, mangos.")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Path:
    """The pairing store (tests.stores.pairing_store)."""
    d = tmp_path_factory.mktemp("auto")
    pairing_store(d, smollm2)
    return d


def drafted(d: Daemon, model: str) -> float:
    """Tokens drafted for `model` so far (the official client keeps no extra response fields)."""
    key = f'sidecar_spec_decode_num_draft_tokens_total{{model="{model}"}}'
    lines = [ln for ln in httpx.get(d.url + "/metrics", timeout=T).text.splitlines() if ln.startswith(key)]
    return float(lines[0].split()[-1]) if lines else 0.0


def config(store: Path, pairs: str, auto: bool) -> Path:
    return write_config(store / f"pairs-{auto}.yaml", f"""
models: {{ollama: {store / 'ollama'}, lmstudio: {store / 'lmstudio'}}}
auto: {str(auto).lower()}
pairs:{pairs or " {}"}
""")


@pytest.fixture(scope="module")
def daemon(store: Path) -> Iterator[Daemon]:
    explicit = """
  smollm2:mine:
    from: smollm2:x180
    draft: auto
    parameters: {temperature: 0, num_ctx: 512}
    runtime: {num_gpu: 0}
  smollm2:135m:
    from: smollm2:135m
    parameters: {temperature: 0}
    runtime: {num_gpu: 0}
"""
    cfg = config(store, explicit, auto=True)
    d = Daemon(cfg, env={"XDG_CACHE_HOME": str(store / "cache")})
    yield d
    d.stop()


def test_draft_auto_picks_the_aligned_draft(daemon: Daemon, store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = httpx.get(daemon.url + "/sidecar/status", timeout=T).json()
    mine = next(p for p in status["pairs"] if p["name"] == "smollm2:mine")
    assert mine["chosen"].startswith("auto: ngram + smollm2:135m")
    r = ollama.Client(host=daemon.url, timeout=T).generate(model="smollm2:mine", prompt=COPY,
                                                           options={"num_predict": 48})
    assert r.done and drafted(daemon, "smollm2:mine") > 0
    assert cmd_check(argparse.Namespace(config=str(store / "pairs-True.yaml"))) == 0
    assert "auto: ngram + smollm2:135m" in capsys.readouterr().out


def test_auto_true_serves_a_store_model_under_its_own_name(daemon: Daemon) -> None:
    client = ollama.Client(host=daemon.url, timeout=T)
    assert "smollm2:x180" in [m.model for m in client.list().models]  # it has a draft worth pairing
    listed = {m["name"]: m for m in httpx.get(daemon.url + "/api/tags", timeout=T).json()["models"]}
    speculative = listed["smollm2:x180"]["details"]["speculative"]
    assert speculative["auto"] is True and speculative["draft"] == "ngram + smollm2:135m"
    r = client.chat(model="smollm2:x180", messages=[{"role": "user", "content": COPY}],
                    options={"temperature": 0, "num_predict": 48})
    assert r.done and drafted(daemon, "smollm2:x180") > 0
    # The explicit pair of that name wins; a model with another vocabulary has nothing to pair with.
    assert "auto" not in listed["smollm2:135m"]["details"]["speculative"]
    assert "tiny:latest" not in listed


def test_without_a_compatible_draft_auto_means_ngram(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(store, "\n  tiny:auto:\n    from: tiny:latest\n    draft: auto\n", auto=False)
    assert cmd_check(argparse.Namespace(config=str(cfg))) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny:auto"))
    assert "auto: n-gram only" in row and " ngram " in f" {row.split()[2]} "
