"""Pairing without homework: `draft: auto` and `auto: true`, decided from the stores.

Both ask pairing.suggest which of the store's models can draft for which: the files' facts rank
the candidates (same vocabulary, 5-30x smaller, same family), and probe results already on disk
(`sidecar suggest --probe`, keyed by target, draft, backend and threads) decide where they exist.
Nothing is probed here: a load must stay fast, and probing costs a generation per candidate.

- `draft: auto` drafts with the n-gram drafter plus the recommended model, chosen at every load of
  the config (start, reload, SIGHUP after `ollama pull`); with none, the n-gram drafter alone.
  `chosen` on the entry says which and why, for the log, `sidecar check` and /sidecar/status.
- `auto: true` serves, under its own Ollama name, every store model with a recommended draft, so
  clients speed up without changing anything; the name shadows the upstream's. Explicit pairs win,
  and models without a worthwhile draft stay with the upstream.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sidecar.config.entries import PairEntry, build_entry
from sidecar.config.loader import Prepared
from sidecar.config.schema import NAME_RE, AutoDraft, ModelDraft, Pair
from sidecar.pairing.suggest import TargetSuggestion, suggest

log = logging.getLogger("sidecar.pairing")


def expand(prepared: Prepared) -> Prepared:
    """Resolve `draft: auto` choices and add the `auto: true` pairs (blocking: scans the stores)."""
    wants_auto = [name for name, e in prepared.entries.items() if isinstance(e.config.draft, AutoDraft)]
    if not wants_auto and not prepared.config.auto:
        return prepared
    try:
        advice = suggest(prepared.stores, cached=True)
    except Exception as e:  # a store that cannot be read must not stop the explicit pairs
        log.warning("cannot scan the model stores for drafts: %s", e)
        advice = []
    by_path = _by_path(advice)
    for name in wants_auto:
        entry = prepared.entries[name]
        prepared.entries[name] = _with_auto_draft(entry, by_path.get(entry.target.path.resolve()), prepared)
        log.info("pair %s: %s", name, prepared.entries[name].chosen)
    if prepared.config.auto:
        taken = {n.lower() for n in prepared.entries} | {n.lower() for n in prepared.errors}
        for ts in advice:
            d = ts.recommended
            if d is None or ts.target.lower() in taken or not NAME_RE.match(ts.target):
                continue  # explicit pairs win; LM Studio files have no Ollama name to shadow
            try:
                pair = Pair.model_validate({"from": ts.target, "draft": ["ngram", d.model]})
                prepared.entries[ts.target] = build_entry(ts.target, pair, prepared.base, prepared.stores,
                                                          chosen=f"auto: {d.model} ({d.why})", auto=True)
            except Exception as e:  # a model that cannot be resolved is simply not served
                log.warning("auto pair %s not served: %s", ts.target, e)
    return prepared


def _by_path(advice: list[TargetSuggestion]) -> dict[Path, TargetSuggestion]:
    """Suggestions by the target's file, which is how a pair's `from` meets the catalog's names."""
    return {ts.path.resolve(): ts for ts in advice if ts.path is not None}


def _with_auto_draft(entry: PairEntry, ts: TargetSuggestion | None, prepared: Prepared) -> PairEntry:
    d = ts.recommended if ts is not None else None
    if d is None:
        why = "no compatible draft model in the stores looks worth it" if ts is not None and ts.drafts \
            else "no model in the stores shares its vocabulary"
        return build_entry(entry.name, entry.config, prepared.base, prepared.stores,
                           chosen=f"auto: n-gram only ({why})")
    return build_entry(entry.name, entry.config, prepared.base, prepared.stores,
                       model_draft=ModelDraft.model_validate({"from": d.model}),
                       chosen=f"auto: ngram + {d.model} ({d.why})")
