"""`sidecar suggest`: which model in the stores can draft for which, best first, and a pairs.yaml to match.

Without a probe the order is pairing.ranking's, from the files' facts alone (seconds for a whole
store). With one, each target's top candidates (at most `top`) are measured on this machine
(pairing.probe): drafts predicted to pay come first, fastest first, then the candidates not
probed, in ranking order, and last the probed drafts that would not pay, each saying why.

Suggested pairs are named after the target with `-spec` appended to its tag (`llama3.1:8b` ->
`llama3.1:8b-spec`; an LM Studio file `lmstudio:pub/Repo-GGUF/x-Q4_K_M.gguf` -> `pub/Repo-GGUF:x-Q4_K_M-spec`):
a name of Ollama's form that sits next to the target's own rather than shadowing it. The daemon's
`auto: true` will serve such pairs under the target's own name; the snippet is for users who prefer
explicit pairs, and a distinct name keeps the two from claiming one name, and keeps the plain model
one name away for comparison.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from sidecar.config.loader import ConfigError, parse, read_bytes, stores_of
from sidecar.engine.llama import EngineError
from sidecar.models.cache import FileCache
from sidecar.models.resolve import Stores
from sidecar.pairing.catalog import find_drafts
from sidecar.pairing.probe import MIN_GAIN, ProbeCache, Prober, ProbeResult, ProbeSettings

TOP = 3  # candidates probed per target: each probe costs about one generation
PROMISING = 0.5  # ranking score a best candidate needs to be suggested unprobed (>= ~3.7x smaller, same family)
SPEC_SUFFIX = "-spec"
_LMSTUDIO_RE = re.compile(r"^lmstudio:([^/]+)/([^/]+)/(.+?)(?:\.gguf)?$", re.IGNORECASE)
_BAD = re.compile(r"[^A-Za-z0-9_.\-]")  # what Ollama's name parts cannot hold
# How a prediction was priced (pairing.probe.Prober), as the reason says it.
_PRICED = {"probe": "", "served": ", priced by what serving measured",
           "files": ", priced from the file sizes until a quiet machine times it"}


@dataclass(frozen=True)
class DraftAdvice:
    """One candidate draft for a target: the ranking's view, and the probe's where it ran."""

    model: str  # as clients name it
    score: float  # pairing.ranking's score from the files' facts
    why: str
    agreement: float | None = None  # per-position greedy acceptance, when probed
    predicted_speedup: float | None = None
    best_k: int | None = None  # draft length the prediction peaks at
    pays: bool | None = None  # None: not probed (or not asked to)

    def to_json(self) -> dict[str, Any]:
        speedup = self.predicted_speedup
        return {"model": self.model, "agreement": None if self.agreement is None else round(self.agreement, 4),
                "predicted_speedup": None if speedup is None else round(speedup, 3), "why": self.why}


@dataclass(frozen=True)
class TargetSuggestion:
    target: str  # as clients name it
    drafts: list[DraftAdvice]  # best first
    probed: bool = False  # whether the top candidates were measured
    path: Path | None = None  # the target's GGUF, as the store listing resolved it

    @property
    def recommended(self) -> DraftAdvice | None:
        """The draft to pair with: the best, if measured to pay or, unprobed, if it looks promising."""
        best = self.drafts[0] if self.drafts else None
        if best is None or best.pays is False:
            return None
        if best.pays is None and (self.probed or best.score < PROMISING):
            return None
        return best

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "drafts": [d.to_json() for d in self.drafts]}


def configured_stores(path: Path) -> Stores:
    """The stores pairs.yaml names under `models:` (the usual places when it names none).

    Reads the file without resolving its pairs: a pair whose model is missing does not stop a
    listing of what is there. Raises ConfigError for a file that cannot be used."""
    data = read_bytes(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return stores_of(parse(text, str(path)), text, path)


def _measured(d: DraftAdvice, r: ProbeResult) -> DraftAdvice:
    s, k, a = r.speedup, r.best_k, r.agreement
    seen = f"agrees on {a:.0%} of {r.positions} tokens (runs of {r.mean_run:.1f}){_PRICED[r.timings]}"
    if r.pays():
        why = f"predicted {s:.2f}x drafting {k} a round; {seen}; {d.why}"
    else:
        why = f"would not pay: predicted {s:.2f}x, drafting needs {MIN_GAIN:.2f}x; {seen}; {d.why}"
    return replace(d, agreement=a, predicted_speedup=s, best_k=k, pays=r.pays(), why=why)


def _probe_target(name: str, path: Path, drafts: list[DraftAdvice], paths: dict[str, Path],
                  settings: ProbeSettings | None, cache: ProbeCache | None, top: int,
                  progress: Callable[[str], None] | None, measure: bool = True) -> list[DraftAdvice]:
    """The top candidates with their probe results; `measure` False uses only cached results
    (what the daemon does at load: probing is `sidecar suggest --probe`'s work)."""
    measured: list[DraftAdvice] = []
    unmeasured: list[DraftAdvice] = []
    with Prober(path, settings, cache) as prober:
        for d in drafts[:top]:
            try:
                result = prober.cached(paths[d.model])
                if measure and result is None:
                    if progress is not None:
                        progress(f"probing {d.model} as a draft for {name}")
                    result = prober.probe(paths[d.model])
                if result is None:
                    unmeasured.append(d)
                    continue
                measured.append(_measured(d, result))
            except (EngineError, OSError, ValueError) as e:  # ValueError: IncompatibleDraft among others
                measured.append(replace(d, pays=False, why=f"probe failed: {e}; {d.why}"))
    if not measure:
        paying = sorted((d for d in measured if d.pays), key=lambda d: -(d.predicted_speedup or 0.0))
        losing = [d for d in measured if not d.pays]
        return paying + unmeasured + drafts[top:] + losing
    paying = sorted((d for d in measured if d.pays), key=lambda d: -(d.predicted_speedup or 0.0))
    losing = sorted((d for d in measured if not d.pays), key=lambda d: -(d.predicted_speedup or 0.0))
    rest = [replace(d, why=f"not probed (only the top {top} are); {d.why}") for d in drafts[top:]]
    return paying + rest + losing


def suggest(stores: Stores, *, probe: bool = False, cached: bool = False, settings: ProbeSettings | None = None,
            facts: FileCache | None = None, probes: ProbeCache | None = None, top: int = TOP,
            progress: Callable[[str], None] | None = None) -> list[TargetSuggestion]:
    """Every model that can be a target, with its compatible drafts best first.

    `probe` measures the top candidates; `cached` (without `probe`) uses the probe results already
    on disk and measures nothing. `facts` and `probes` default to the caches under
    storage.cache_dir(); `progress` hears of each probe before it runs (a cached one is not
    announced: it takes no time)."""
    scan = find_drafts(stores, facts)
    paths = {e.name: p for e in scan.entries if (p := e.path) is not None}
    out = []
    for target, ranked in scan.drafts.items():
        drafts = [DraftAdvice(s.name, s.score, s.why) for s in ranked]
        if (probe or cached) and drafts:
            drafts = _probe_target(target, paths[target], drafts, paths, settings, probes, top, progress, probe)
        out.append(TargetSuggestion(target, drafts, probe, paths.get(target)))
    return out


def spec_name(target: str) -> str:
    """The suggested pair's name: the target's, with `-spec` on its tag (module docstring)."""
    m = _LMSTUDIO_RE.match(target)
    if m is None:
        return f"{target}{SPEC_SUFFIX}"
    publisher, repo, file = (_BAD.sub("-", part).lstrip(".-") or "model" for part in m.groups())
    return f"{publisher}/{repo}:{file}{SPEC_SUFFIX}"


def pairs_snippet(results: list[TargetSuggestion]) -> str:
    """A pairs.yaml fragment: one pair per target with a recommended draft."""
    chosen = [(r, d) for r in results if (d := r.recommended) is not None]
    if not chosen:
        return "# no pair to suggest: no target has a draft that looks (or was measured) to pay\n"
    lines = ["# pairs suggested by `sidecar suggest`; `from` and `draft` resolve in the same stores", "pairs:"]
    for r, d in chosen:
        if d.predicted_speedup is not None and d.agreement is not None:
            lines.append(f"  # agreement {d.agreement:.0%}, predicted {d.predicted_speedup:.2f}x on this machine "
                         f"drafting {d.best_k} a round")
        pair = yaml.safe_dump({spec_name(r.target): {"from": r.target, "draft": d.model}}, sort_keys=False)
        lines += ["  " + line for line in pair.splitlines()]
    return "\n".join(lines) + "\n"


def format_table(results: list[TargetSuggestion]) -> str:
    """One row per (target, draft), the target named on its first row only."""
    rows = [("TARGET", "DRAFT", "AGREEMENT", "SPEED-UP", "WHY")]
    for r in results:
        if not r.drafts:
            rows.append((r.target, "-", "-", "-", "no model in the stores shares its vocabulary and is small enough"))
        for i, d in enumerate(r.drafts):
            agreement = "-" if d.agreement is None else f"{d.agreement:.0%}"
            speedup = "-" if d.predicted_speedup is None else f"{d.predicted_speedup:.2f}x"
            rows.append((r.target if i == 0 else "", d.model, agreement, speedup, d.why))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
                     for row in rows)
