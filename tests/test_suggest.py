"""`sidecar suggest` on a real store: SmolLM2, a padded copy of it that costs ~6x as much (the
target SmolLM2 agrees with on every token), a truncated SmolLM2 with its logits negated (same
vocabulary, never agrees), and a tiny model with another vocabulary; probes run real llama.cpp."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest

import sidecar.pairing.probe as probe
from sidecar.cli import main
from sidecar.config.loader import parse
from sidecar.config.schema import NAME_RE
from sidecar.models.cache import FileCache
from sidecar.pairing.probe import PROMPTS, ProbeCache, ProbeResult, ProbeSettings, predict_speedup
from sidecar.pairing.suggest import (
    DraftAdvice,
    TargetSuggestion,
    configured_stores,
    pairs_snippet,
    spec_name,
    suggest,
)
from tests.stores import pairing_store

pytestmark = pytest.mark.model

TARGET, ALIGNED, FOREIGN = "smollm2:x180", "smollm2:135m", "tiny:latest"
USELESS = "lmstudio:test/Inverted-GGUF/smollm2-inverted-trunc2.gguf"
# One short prompt, a small context, one timing repetition: a cold probe of the store in seconds. One
# thread: on a busy shared machine llama.cpp's threads spend most of a step waiting for each other.
FAST = ProbeSettings(prompts=PROMPTS[:1], n_tokens=32, n_max=4, n_ctx=256, threads=1, n_gpu_layers=0, reps=1)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Path:
    """The store's pairs.yaml (models: naming both stores, no pairs)."""
    d = tmp_path_factory.mktemp("suggest")
    pairing_store(d, smollm2)
    ollama = d / "ollama"
    cfg = d / "pairs.yaml"
    cfg.write_text(f"models:\n  ollama: {ollama}\n  lmstudio: {d / 'lmstudio'}\npairs: {{}}\n")
    return cfg


def fast_probes(mp: pytest.MonkeyPatch, cache_home: Path) -> list[Path]:
    """Probe with FAST settings, caches under cache_home; returns the drafts each real probe measured."""
    mp.setenv("XDG_CACHE_HOME", str(cache_home))
    mp.setattr(probe, "DEFAULT_SETTINGS", FAST)
    calls: list[Path] = []
    measure = probe.measure

    def counted(target: probe.LoadedTarget, draft: Path, settings: ProbeSettings) -> ProbeResult:
        calls.append(draft)
        return measure(target, draft, settings)
    mp.setattr(probe, "measure", counted)
    return calls


@pytest.fixture(scope="module")
def probed(store: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], int, Path]:
    """`sidecar suggest --probe --json`, cold: (output by target, probes run, cache home)."""
    home = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        calls = fast_probes(mp, home)
        t0 = time.perf_counter()
        out = run_cli(["suggest", "--config", str(store), "--probe", "--json"])
        print(f"cold probe: {time.perf_counter() - t0:.1f}s, {len(calls)} probes")
    return {r["target"]: r["drafts"] for r in json.loads(out)}, len(calls), home


def run_cli(argv: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return buf.getvalue()


def test_drafts_ranked_from_facts_never_another_vocabulary(store: Path, tmp_path: Path) -> None:
    results = {r.target: r for r in suggest(configured_stores(store), facts=FileCache(tmp_path / "facts.json"))}
    assert set(results) == {TARGET, ALIGNED, FOREIGN, USELESS}
    names = {t: [d.model for d in r.drafts] for t, r in results.items()}
    assert names[TARGET] == [ALIGNED, USELESS]  # same family first, though the other is smaller
    assert names[ALIGNED] == [USELESS] and names[FOREIGN] == [] and names[USELESS] == []
    assert all(d.agreement is None and d.predicted_speedup is None for r in results.values() for d in r.drafts)
    first, second = results[TARGET].drafts
    assert first.why.startswith("6x smaller (134.5M vs 771.7M parameters), same family (smollm2)")
    assert "another family (inverted vs smollm2)" in second.why and first.score > second.score
    # Unprobed, only a promising best candidate becomes a pair: SmolLM2 for its padded copy.
    snippet = parse(pairs_snippet(list(results.values())))
    assert list(snippet.pairs) == ["smollm2:x180-spec"]
    assert snippet.pairs["smollm2:x180-spec"].from_ == TARGET
    assert snippet.pairs["smollm2:x180-spec"].draft_label == ALIGNED


def test_probe_tells_the_aligned_draft_from_the_useless_one(probed: tuple[dict[str, Any], int, Path]) -> None:
    by_target, probes, _ = probed
    assert probes == 3  # two drafts for the padded target, the inverted one for SmolLM2
    aligned, useless = by_target[TARGET]
    assert aligned["model"] == ALIGNED and useless["model"] == USELESS
    assert aligned["agreement"] >= 0.95  # the same function: every greedy token agrees
    assert useless["agreement"] <= 0.05 and useless["predicted_speedup"] <= 1.0
    assert useless["why"].startswith("would not pay: predicted") and "drafting needs 1.05x" in useless["why"]
    assert aligned["predicted_speedup"] > useless["predicted_speedup"]
    only = by_target[ALIGNED]
    assert [d["model"] for d in only] == [USELESS] and only[0]["predicted_speedup"] <= 1.0
    assert by_target[FOREIGN] == []


def test_json_shape(probed: tuple[dict[str, Any], int, Path]) -> None:
    for drafts in probed[0].values():
        for d in drafts:
            assert set(d) == {"model", "agreement", "predicted_speedup", "why"}
            assert isinstance(d["agreement"], float) and isinstance(d["predicted_speedup"], float)
            assert isinstance(d["why"], str) and d["why"]


def test_a_rerun_reads_the_probe_cache(store: Path, probed: tuple[dict[str, Any], int, Path],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fast_probes(monkeypatch, probed[2])

    def no_load(*_: Any, **__: Any) -> None:
        raise AssertionError("a cached probe loaded a model")
    monkeypatch.setattr(probe, "Weights", no_load)
    t0 = time.perf_counter()
    again = json.loads(run_cli(["suggest", "--config", str(store), "--probe", "--json"]))
    print(f"cached rerun: {time.perf_counter() - t0:.2f}s")
    assert calls == [] and {r["target"]: r["drafts"] for r in again} == probed[0]
    table = run_cli(["suggest", "--config", str(store), "--probe"])
    header, *rows = table.split("\n\n")[0].splitlines()
    assert header.split() == ["TARGET", "DRAFT", "AGREEMENT", "SPEED-UP", "WHY"]
    at = next(i for i, row in enumerate(rows) if row.startswith(TARGET))
    assert rows[at].split()[:2] == [TARGET, ALIGNED] and rows[at + 1].split()[0] == USELESS  # listed last
    snippet = parse(table.split("\n\n", 1)[1])  # a pair only where the best draft measured to pay
    assert ("smollm2:x180-spec" in snippet.pairs) == (not probed[0][TARGET][0]["why"].startswith("would not pay"))


def test_the_probe_cache_ignores_damage(tmp_path: Path) -> None:
    cache = ProbeCache(tmp_path / "probes")
    key = {"target": "a", "draft": "b"}
    result = ProbeResult(0.5, 1.0, 32, (0.0, 0.01, 0.012, 0.015), 0.002)
    assert cache.get(key) is None
    cache.put(key, result)
    assert cache.get(key) == result and cache.get({**key, "draft": "c"}) is None
    (file,) = (tmp_path / "probes").iterdir()
    for damage in ("{", "[]", '{"format": "spec-sidecar/probe", "key": {"target": "a", "draft": "b"}}'):
        file.write_text(damage)
        assert cache.get(key) is None
    cache.put(key, result)  # and a damaged file is simply replaced
    assert cache.get(key) == result


def test_the_predicted_speedup() -> None:
    # A GPU-like flat verify curve: 4 rows cost what one does. With a = 0.8 and a draft at 5% of a
    # target step, k = 3 gives (1 - 0.8^4) / 0.2 = 2.952 tokens for 3 * 0.05 + 1 steps (the planner's
    # price of a round, engine.adaptive.round_seconds).
    flat = (0.0, *[1.0] * 9)
    s, k = predict_speedup(0.8, flat[:5], 0.05)
    assert k == 3 and s == pytest.approx(2.952 / 1.15, rel=1e-4)
    assert predict_speedup(0.0, flat, 0.05)[0] < 1.0  # nothing accepted: every round loses
    cpu = (0.0, 1.0, 1.4, 1.8, 2.4, 2.9)  # verifying costs rows: only near-certain agreement pays
    assert predict_speedup(0.6, cpu, 0.25)[0] < 1.0 < predict_speedup(1.0, cpu, 0.1)[0]


def test_snippet_names_and_choice() -> None:
    assert spec_name("llama3.2:1b") == "llama3.2:1b-spec"
    assert spec_name("hf.co/org/Repo-GGUF:Q4_K_M") == "hf.co/org/Repo-GGUF:Q4_K_M-spec"
    assert spec_name("lmstudio:pub/Repo-GGUF/model Q4_K_M.gguf") == "pub/Repo-GGUF:model-Q4_K_M-spec"
    assert spec_name("lmstudio:Some One/.repo/-x.gguf") == "Some-One/repo:x-spec"
    assert all(NAME_RE.match(spec_name(n)) for n in ("a:b", "user/m:t", "lmstudio:p/r/f.gguf", "lmstudio:a b/c/.d"))
    good, weak = DraftAdvice("d:1", 0.9, "x"), DraftAdvice("d:2", 0.3, "x")
    paid = DraftAdvice("d:3", 0.3, "x", 0.9, 1.4, 3, True)
    lost = DraftAdvice("d:4", 0.9, "x", 0.1, 0.7, 1, False)
    results = [TargetSuggestion("t:good", [good]), TargetSuggestion("t:weak", [weak]),
               TargetSuggestion("t:paid", [paid, lost], probed=True), TargetSuggestion("t:lost", [lost], True),
               TargetSuggestion("t:unprobed", [good], probed=True), TargetSuggestion("t:none", [])]
    config = parse(pairs_snippet(results))
    assert {n: (p.from_, p.draft_label) for n, p in config.pairs.items()} == {
        "t:good-spec": ("t:good", "d:1"), "t:paid-spec": ("t:paid", "d:3")}
    assert "predicted 1.40x on this machine drafting 3 a round" in pairs_snippet(results)
    assert pairs_snippet(results[1:2]).startswith("# no pair to suggest")


def test_a_broken_config_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "pairs.yaml"
    bad.write_text("models:\n  ollama: [1]\n")
    assert main(["suggest", "--config", str(bad)]) == 1
    assert f"{bad}:2: models.ollama" in capsys.readouterr().err
