"""What a person watches: the Grafana dashboard's queries name only metrics a live daemon exports,
and `sidecar top --once` shows a drafting pair's streams, sources and speed-up. A real daemon on
SmolLM2 with the n-gram drafter, a real request, the real CLI in a subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, SMOLLM2_REF, Daemon, write_config

pytestmark = pytest.mark.daemon

DASHBOARD = REPO / "observability" / "grafana" / "sidecar.json"
EDIT = ("Here is a list:\n" + "\n".join(f"- item number {i}: keep it" for i in range(12))
        + "\nRepeat the list exactly as it is.")


@pytest.fixture(scope="module")
def drafting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """SmolLM2 that always drafts (n-gram and the suffix cache), so the counters move."""
    cfg = write_config(tmp_path_factory.mktemp("observe") / "pairs.yaml", f"""
pairs:
  smollm2:top:
    from: {SMOLLM2_REF}
    draft: ngram
    parameters: {{temperature: 0, num_ctx: 1024}}
    runtime: {{num_gpu: 0}}
    speculative: {{adaptive: false, n_max: 8}}
""")
    d = Daemon(cfg)
    yield d
    d.stop()


def chat(d: Daemon, n: int) -> dict[str, Any]:
    r = httpx.post(d.url + "/api/chat", timeout=300, json={
        "model": "smollm2:top", "messages": [{"role": "user", "content": EDIT}], "stream": False,
        "options": {"num_predict": n}})
    assert r.status_code == 200, r.text
    return r.json()


def exported(d: Daemon) -> set[str]:
    """Every series name /metrics exports, with each family's sample suffixes (a counter's _total,
    a histogram's _bucket/_sum/_count) even where no labelled sample exists yet."""
    names: set[str] = set()
    for family in text_string_to_metric_families(httpx.get(d.url + "/metrics", timeout=30).text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ())
        names.update(family.name + s for s in suffixes)
    return names


def dashboard_metrics() -> set[str]:
    """The metric names the dashboard's queries (and its variables) read."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in board["templating"]["list"] if v.get("definition")]
    return {m for e in exprs for m in re.findall(r"\b((?:sidecar|process)_[a-z0-9_]+)\b", e)}


def test_the_dashboard_reads_only_what_the_daemon_exports(drafting: Daemon) -> None:
    r = chat(drafting, 48)
    assert r["draft_tokens"] > 0  # the speculation counters have samples
    names = dashboard_metrics()
    assert len(names) >= 15, names
    base = {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}
    assert base >= {"sidecar_step_seconds", "sidecar_step_host_seconds"}  # the host-share panel is there
    missing = names - exported(drafting)
    assert not missing, missing


def test_the_speedup_counters_add_up(drafting: Daemon) -> None:
    chat(drafting, 48)
    samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(drafting.url + "/metrics").text)
               for s in f.samples if s.labels.get("model") == "smollm2:top"}
    assert samples["sidecar_decode_seconds_total"] > 0
    assert samples["sidecar_spec_decode_target_only_seconds_total"] > 0
    assert samples["sidecar_batch_steps_total"] > 0
    assert samples["sidecar_batch_rows_total"] >= samples["sidecar_batch_steps_total"]


def top_once(d: Daemon, interval: float = 0.5) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar.cli", "top", "--once", "--interval", str(interval)],
                          env={"OLLAMA_HOST": f"127.0.0.1:{d.port}", "COLUMNS": "160", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_top_once_shows_a_drafting_stream(drafting: Daemon, tmp_path: Path) -> None:
    chat(drafting, 16)  # loaded, and the suffix cache has seen the answer's start
    during: list[subprocess.CompletedProcess[str]] = []
    streaming = threading.Thread(target=lambda: chat(drafting, 200))
    streaming.start()
    try:
        during.append(top_once(drafting, interval=1.0))
    finally:
        streaming.join()
    after = top_once(drafting)
    (tmp_path / "top.txt").write_text(during[0].stdout)
    for run in (*during, after):
        assert run.returncode == 0, run.stdout + run.stderr
        out = run.stdout
        assert "smollm2:top" in out and "speed-up" in out and "accepted" in out
        assert re.search(r"\b(ngram|suffix)\b", out), out  # a source row
        assert re.search(r"\d\.\d\d×", out), out  # the speed-up over target-only
    assert "/1" in during[0].stdout or "/2" in during[0].stdout  # busy/parallel streams


def test_top_says_when_there_is_no_daemon() -> None:
    run = subprocess.run([sys.executable, "-m", "sidecar.cli", "top", "--once", "--host", "127.0.0.1:9"],
                         capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert run.returncode == 1 and "cannot read the daemon at http://127.0.0.1:9" in run.stdout
