"""Pairing decisions that survive a busy machine: a probe there keeps its agreement (greedy decoding
makes it the same under any load) but caches none of its timings, the right draft still comes
first, `sidecar suggest` shows what is cached without --probe, and what serving measured overturns
a verdict taken on stale timings."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

import sidecar.engine.timing as timing
import sidecar.pairing.probe as probe
from sidecar.cli import main
from sidecar.pairing.costs import ServedCosts
from sidecar.pairing.probe import ProbeCache, Prober, ProbeResult
from tests.stores import pairing_store
from tests.test_suggest import ALIGNED, FAST, TARGET, USELESS

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Path:
    d = tmp_path_factory.mktemp("noise")
    pairing_store(d, smollm2)
    cfg = d / "pairs.yaml"
    cfg.write_text(f"models:\n  ollama: {d / 'ollama'}\n  lmstudio: {d / 'lmstudio'}\npairs: {{}}\n")
    return cfg


def suggest_json(store: Path, *flags: str) -> dict[str, list[dict[str, Any]]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["suggest", "--config", str(store), "--json", *flags]) == 0
    return {r["target"]: r["drafts"] for r in json.loads(buf.getvalue())}


@pytest.fixture(scope="module")
def busy(store: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict[str, Any]]], Path]:
    """`sidecar suggest --probe --json` while every core looks taken: (output by target, cache home)."""
    home = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(home))
        mp.setattr(probe, "DEFAULT_SETTINGS", FAST)
        mp.setattr(timing, "cores_taken", lambda *_: True)
        return suggest_json(store, "--probe"), home


def test_a_busy_probe_keeps_the_agreement_and_caches_no_timings(busy: tuple[dict[str, Any], Path]) -> None:
    by_target, home = busy
    aligned, useless = by_target[TARGET]  # the right draft still comes first
    assert aligned["model"] == ALIGNED and useless["model"] == USELESS
    assert aligned["agreement"] >= 0.95 and useless["agreement"] <= 0.05
    assert aligned["predicted_speedup"] >= probe.MIN_GAIN > useless["predicted_speedup"]
    assert "priced from the file sizes until a quiet machine times it" in aligned["why"]
    records = [json.loads(f.read_text())["value"] for f in (home / "spec-sidecar" / "probes").iterdir()]
    assert len(records) == 3 and all(set(r) == {"agreement", "mean_run", "positions"} for r in records)


def test_suggest_shows_cached_probe_results(store: Path, busy: tuple[dict[str, Any], Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    by_target, home = busy
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.setattr(probe, "DEFAULT_SETTINGS", FAST)

    def no_load(*_: Any, **__: Any) -> None:
        raise AssertionError("suggest without --probe loaded a model")
    monkeypatch.setattr(probe, "Weights", no_load)
    assert suggest_json(store) == by_target  # the agreement and the verdict, without measuring anything


def test_what_serving_measured_overturns_a_stale_verdict(tmp_path: Path) -> None:
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    target.write_bytes(b"t" * 6000)
    draft.write_bytes(b"d" * 1000)
    prober = Prober(target, FAST, ProbeCache(tmp_path / "probes"), ServedCosts(tmp_path / "served"))
    # The busy-machine curve, t(1) = 0.22 s and t(2) = 0.76 s, once cached as if quiet.
    stale = ProbeResult(1.0, 32.0, 32, (0.0, 0.22, 0.76, 1.3, 1.9, 2.4), 0.04)
    prober.cache.put(prober.key(draft), stale)
    assert prober.cached(draft) == stale and not stale.pays()
    # Serving the target measured its curve on a quiet machine, and the draft's step.
    prober.served.put_target(target, (0.0, 0.2, 0.24, 0.28, 0.32, 0.36, 0.4, 0.44, 0.48, 0.52), FAST.n_threads)
    verdict = prober.cached(draft)
    assert verdict is not None and verdict.timings == "served" and verdict.pays()
    assert verdict.agreement == stale.agreement and verdict.t_draft == pytest.approx(0.04)
    prober.served.put_draft(draft, 0.05, FAST.n_threads)
    again = prober.cached(draft)
    assert again is not None and again.t_draft == pytest.approx(0.05)
