"""`sidecar top`'s frame from two reads of a daemon: rates are the counters' differences over the
interval, and with nothing finished in it the totals since the daemon started stand in. Pure: the
reads are built here (tests/test_observe.py runs the command against a real daemon)."""

from __future__ import annotations

import pytest
from rich.console import Console

from sidecar.observability.top import Snapshot, frame

pytestmark = pytest.mark.pure

STATUS = {
    "config": "/etc/spec-sidecar/pairs.yaml", "last_error": None,
    "pairs": [{"name": "smollm2:135m", "state": "loaded"}, {"name": "big:70b", "state": "unloaded"}],
    "models": [{"pairs": ["smollm2:135m"], "busy": 2, "parallel": 4, "rows_per_step": 3.0}],
}


def snap(at: float, **counters: float) -> Snapshot:
    s = Snapshot(at, STATUS)
    m = (("model", "smollm2:135m"),)
    for name, v in counters.items():
        if name.startswith("src_"):
            kind, source = name[4:].split("_", 1)
            metric = f"sidecar_spec_decode_source_{kind}_tokens_total"
            s.samples[(metric, (("model", "smollm2:135m"), ("source", source)))] = v
        else:
            s.samples[(f"sidecar_{name}", m)] = v
    s.samples[("sidecar_queue_depth", ())] = 3
    s.samples[("process_resident_memory_bytes", ())] = 512 * 2**20
    return s


def render(old: Snapshot, new: Snapshot) -> str:
    console = Console(record=True, width=160)
    console.print(frame("http://127.0.0.1:11434", old, new))
    return console.export_text()


def test_a_frame_shows_the_intervals_rates_per_pair_and_source() -> None:
    old = snap(10.0, batch_tokens_total=100, decode_seconds_total=2, spec_decode_target_only_seconds_total=2,
               batch_rows_total=30, batch_steps_total=10, spec_decode_num_drafts_total=4,
               spec_decode_num_accepted_tokens_total=8, src_draft_ngram=10, src_accepted_ngram=8)
    new = snap(12.0, batch_tokens_total=300, decode_seconds_total=4, spec_decode_target_only_seconds_total=7,
               batch_rows_total=90, batch_steps_total=20, spec_decode_num_drafts_total=14,
               spec_decode_num_accepted_tokens_total=38, src_draft_ngram=50, src_accepted_ngram=38,
               src_draft_suffix=20, src_accepted_suffix=20)
    out = render(old, new)
    row = next(line for line in out.splitlines() if "smollm2:135m" in line)
    # 200 tokens in 2 s; (7-2)/(4-2) = 2.50x; 60 rows over 10 steps; 2/4 streams; ngram 40 drafted in 2 s, 75%
    for cell in ("2/4", "100.0", "2.50×", "6.0", "ngram", "20.0", "75%", "4.00"):
        assert cell in row, (cell, row)
    suffix = next(line for line in out.splitlines() if "suffix" in line)
    assert "10.0" in suffix and "100%" in suffix
    assert "queue 3" in out and "memory 512 MiB" in out and "big:70b" not in out


def test_an_idle_interval_falls_back_to_the_totals() -> None:
    both = {"batch_tokens_total": 300, "decode_seconds_total": 4, "spec_decode_target_only_seconds_total": 6,
            "spec_decode_num_drafts_total": 10, "spec_decode_num_accepted_tokens_total": 20,
            "src_draft_ngram": 40, "src_accepted_ngram": 30}
    row = next(line for line in render(snap(0, **both), snap(1, **both)).splitlines() if "smollm2:135m" in line)
    for cell in ("0.0", "1.50×", "3.0", "75%", "3.00"):  # rows per step: the status's mean since load
        assert cell in row, (cell, row)
