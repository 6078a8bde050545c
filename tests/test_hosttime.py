"""The host's share of a step (engine.hosttime): timed, fitted and exported (tests/test_cost.py prices it
into drafts)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.engine.hosttime import FIT_EVERY, HostTime
from tests.conftest import Daemon, write_config

pytestmark = pytest.mark.model  # the engine modules load llama.cpp; one test starts a daemon (marked)

T = 120


def test_histograms_book_every_step_and_the_share_is_the_recent_steps() -> None:
    h = HostTime()
    h.observe(0.010, 0.002, 1, 1, 0, 0)
    h.observe(0.030, 0.006, 1, 1, 0, 0)
    _, counts, total = h.step.cumulative()
    assert counts[-1] == 2 and total == pytest.approx(0.040)
    assert counts == tuple(sorted(counts))  # cumulative
    assert h.host.cumulative()[1][-1] == 2
    assert h.share == pytest.approx(0.2)


def test_the_fit_recovers_what_drafts_cost_the_host() -> None:
    """Steps whose host time is 0.2 ms + 0.1 ms a sequence + 0.3 ms a drafting sequence + 0.05 ms a
    drafted row: the least-squares fit reads those prices back."""
    h = HostTime()
    for i in range(FIT_EVERY * 8):
        seqs, drafting, rows = 1 + i % 4, i % 3, (i * 7) % 11 if i % 3 else 0
        host = 0.0002 + 0.0001 * seqs + 0.0003 * drafting + 0.00005 * rows
        h.observe(0.01, host, seqs, seqs + rows // 2, drafting, rows)
    p = h.price
    assert p.drafting == pytest.approx(0.0003, rel=0.05)
    assert p.row == pytest.approx(0.00005, rel=0.05)
    assert p.drafting + 4 * p.row == pytest.approx(0.0005, rel=0.05)


@pytest.mark.daemon
def test_a_daemon_exports_its_steps_and_the_host_share(tmp_path: Path, tiny: Path) -> None:
    """After one request: both histograms have samples under the pair's name, /api/ps and
    /sidecar/status give the host's share, and /sidecar/status what the cost model believes."""
    cfg = write_config(tmp_path / "pairs.yaml", f"""
pairs:
  tiny:test:
    from: {tiny}
    draft: ngram
    parameters: {{temperature: 0, num_ctx: 256, num_predict: 16}}
    runtime: {{num_thread: 1}}
""")
    d = Daemon(cfg)
    try:
        r = httpx.post(d.url + "/api/generate", json={"model": "tiny:test", "prompt": "abc", "stream": False},
                       timeout=T)
        assert r.status_code == 200, r.text
        text = httpx.get(d.url + "/metrics", timeout=T).text
        got = {(s.name, s.labels.get("model"), s.labels.get("le")): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
        for name in ("sidecar_step_seconds", "sidecar_step_host_seconds"):
            assert got[(f"{name}_count", "tiny:test", None)] >= 1
            assert got[(f"{name}_bucket", "tiny:test", "+Inf")] == got[(f"{name}_count", "tiny:test", None)]
            assert got[(f"{name}_sum", "tiny:test", None)] > 0
        ps = httpx.get(d.url + "/api/ps", timeout=T).json()["models"]
        share = next(m for m in ps if m["name"] == "tiny:test")["sidecar"]["host_share"]
        assert 0.0 < share <= 1.0
        status = httpx.get(d.url + "/sidecar/status", timeout=T).json()["models"]
        assert 0.0 < status[0]["host_share"] <= 1.0
        cost = status[0]["cost"]
        assert set(cost) == {"host", "tiny:test"}
        assert set(cost["tiny:test"]["device"]) == {"passes", "rows", "prefill", "attention", "changed"}
        assert cost["tiny:test"]["device"]["passes"] + cost["tiny:test"]["device"]["rows"] > 0
    finally:
        d.stop()
