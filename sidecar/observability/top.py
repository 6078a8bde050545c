"""`sidecar top`: a live terminal view of a running daemon, as `htop` is for processes.

Speculation is invisible while it works: its numbers exist (`/metrics`, `/sidecar/status`,
`draft_sources` in every answer), but nothing shows a person what the daemon is doing now. This
reads the daemon's own endpoints on OLLAMA_HOST, twice an interval apart, and shows per loaded
pair what happened in between: its streams and their tokens per second, acceptance and mean
accepted length per draft source, the realised speed-up over target-only, the batch's rows per
step, and, for the daemon, the queue and its memory.

`/sidecar/status` says which pairs are loaded and what their targets run; `/metrics` holds the
counters (tokens, drafts per source, the cost model's target-only seconds), whose differences
over the interval are the rates. Nothing here keeps state in the daemon: a frame is two reads.
rich draws the screen (`--once` prints one frame and exits, for scripts and tests).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

Labels = tuple[tuple[str, str], ...]
TIMEOUT = 5.0


@dataclass
class Snapshot:
    """One read of the daemon: its status document and every sample of /metrics."""

    at: float
    status: dict[str, Any]
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> float:
        """The sample `name` with exactly these labels (0 when the daemon has none yet)."""
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def by(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """Every sample of `name` matching `labels`, keyed by the value of `label`."""
        want = set(labels.items())
        out: dict[str, float] = {}
        for (n, ls), v in self.samples.items():
            d = dict(ls)
            if n == name and want <= set(ls) and label in d:
                out[d[label]] = out.get(d[label], 0.0) + v
        return out


def read(base: str) -> Snapshot:
    """GET /sidecar/status and /metrics from the daemon at `base` (http://host:port)."""
    with urllib.request.urlopen(base + "/sidecar/status", timeout=TIMEOUT) as r:
        status = json.loads(r.read())
    with urllib.request.urlopen(base + "/metrics", timeout=TIMEOUT) as r:
        text = r.read().decode()
    snap = Snapshot(time.monotonic(), status)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            snap.samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return snap


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def frame(base: str, old: Snapshot, new: Snapshot) -> RenderableType:
    """One screen: the daemon's header, then a table of the loaded pairs, one row per draft source."""
    dt = max(new.at - old.at, 1e-9)
    rss = new.value("process_resident_memory_bytes")
    queue = new.value("sidecar_queue_depth")
    st = new.status
    head = Text.assemble(
        ("spec-sidecar ", "bold"), (base, "cyan"),
        f"   queue {queue:.0f}   memory {rss / 2**20:,.0f} MiB   targets {new.value('sidecar_models_loaded'):.0f}",
        f"   config {st.get('config')}",
    )
    error = st.get("last_error")
    table = Table(expand=True, header_style="bold")
    for col, just in (("pair", "left"), ("streams", "right"), ("tok/s", "right"), ("speed-up", "right"),
                      ("rows/step", "right"), ("source", "left"), ("drafted/s", "right"),
                      ("accepted", "right"), ("mean len", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    targets = {p: m for m in st.get("models", []) for p in m.get("pairs", [])}
    for pair in st.get("pairs", []):
        if pair.get("state") != "loaded":
            continue
        name = pair["name"]
        model = targets.get(name, {})

        def delta(metric: str, _name: str = name) -> float:
            return new.value(metric, model=_name) - old.value(metric, model=_name)

        tok_s = delta("sidecar_batch_tokens_total") / dt  # live: finished requests count only at their end
        decode = delta("sidecar_decode_seconds_total")
        speedup = _ratio(delta("sidecar_spec_decode_target_only_seconds_total"), decode)
        if speedup is None:  # nothing finished in the interval: since the daemon started
            speedup = _ratio(new.value("sidecar_spec_decode_target_only_seconds_total", model=name),
                             new.value("sidecar_decode_seconds_total", model=name))
        rows = _ratio(delta("sidecar_batch_rows_total"), delta("sidecar_batch_steps_total"))
        if rows is None:
            rows = model.get("rows_per_step")
        mean_len = _ratio(delta("sidecar_spec_decode_num_accepted_tokens_total"),
                          delta("sidecar_spec_decode_num_drafts_total"))
        if mean_len is None:
            mean_len = _ratio(new.value("sidecar_spec_decode_num_accepted_tokens_total", model=name),
                              new.value("sidecar_spec_decode_num_drafts_total", model=name))
        mean = None if mean_len is None else 1 + mean_len
        streams = f"{model.get('busy', 0)}/{model.get('parallel', '?')}"
        sources = _sources(old, new, name, dt)
        first = sources[0] if sources else ("–", "–", "–")
        table.add_row(name, streams, f"{tok_s:.1f}", _fmt(speedup, ".2f", "×"), _fmt(rows, ".1f"),
                      *first, _fmt(mean, ".2f"))
        for src in sources[1:]:
            table.add_row("", "", "", "", "", *src, "")
    if not table.row_count:
        table.add_row("(no pair loaded)", *[""] * 8)
    parts: list[RenderableType] = [head, table]
    if error:
        parts.append(Text(f"last error: {error}", style="red"))
    return Group(*parts)


def _sources(old: Snapshot, new: Snapshot, pair: str, dt: float) -> list[tuple[str, str, str]]:
    """(source, drafted per second over the interval, acceptance) for each source the pair drafted
    from since the daemon started: the interval's acceptance where it drafted, else the total."""
    drafted = new.by("sidecar_spec_decode_source_draft_tokens_total", "source", model=pair)
    accepted = new.by("sidecar_spec_decode_source_accepted_tokens_total", "source", model=pair)
    drafted0 = old.by("sidecar_spec_decode_source_draft_tokens_total", "source", model=pair)
    accepted0 = old.by("sidecar_spec_decode_source_accepted_tokens_total", "source", model=pair)
    out = []
    for src in sorted(drafted):
        d = drafted[src] - drafted0.get(src, 0.0)
        a = accepted.get(src, 0.0) - accepted0.get(src, 0.0)
        rate = _ratio(a, d) if d > 0 else _ratio(accepted.get(src, 0.0), drafted[src])
        out.append((src, f"{d / dt:.1f}", _fmt(None if rate is None else 100 * rate, ".0f", "%")))
    return out


def base_url(host: str | None, parse: Callable[[str | None], tuple[str, int]]) -> str:
    """http://host:port of the daemon at `host` (OLLAMA_HOST syntax, read by `parse`, the daemon's
    own parser): a wildcard listen address is reached on loopback."""
    h, port = parse(host)
    if h in ("0.0.0.0", "::", ""):
        h = "127.0.0.1"
    return f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}"


def run(base: str, once: bool, interval: float, console: Console | None = None) -> int:
    """Draw frames until interrupted (or one, with `once`); 1 when the daemon cannot be read."""
    console = console or Console()
    try:
        old = read(base)
        time.sleep(interval)
        new = read(base)
        if once:
            console.print(frame(base, old, new))
            return 0
        with Live(frame(base, old, new), console=console, refresh_per_second=4, screen=True) as live:
            while True:
                time.sleep(interval)
                old, new = new, read(base)
                live.update(frame(base, old, new))
    except KeyboardInterrupt:
        return 0
    except (urllib.error.URLError, OSError, ValueError) as e:
        console.print(f"[red]cannot read the daemon at {base}: {e}[/red]")
        return 1
