"""Ollama's built-in templates, and which one a GGUF's jinja chat template is (template.Named).

When `ollama create` imports a GGUF (or safetensors) that has a `tokenizer.chat_template`, Ollama
compares that jinja text with the jinja templates in its template/index.json and, when the nearest
is close enough, stores the matching Go template (template/<name>.gotmpl) as the model's TEMPLATE
layer and its parameters (template/<name>.json: the stop words) as a params layer
(server/model.go detectChatTemplate). "Close enough" is a Levenshtein distance under 100, counted
in runes, the first nearest entry winning (template/template.go Named).

The files under ``gotmpl/`` are Ollama's, unchanged (MIT licence, ``gotmpl/LICENSE``), so this
table can be diffed against any Ollama checkout's template/ directory.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

__all__ = ["NamedTemplate", "levenshtein", "named", "named_templates"]

# template/template.go Named: `if score < 100`.
MAX_DISTANCE = 100


@dataclass(frozen=True)
class NamedTemplate:
    """One entry of Ollama's template/index.json with its Go template and parameters."""

    name: str  # e.g. "chatml": the file stem under template/
    jinja: str  # the jinja text this entry stands for
    text: str  # the Go template, CRLF normalised to LF as Ollama's templatesOnce does
    parameters: dict[str, Any] | None  # template/<name>.json (Ollama: `{"stop": [...]}`), None where absent


def levenshtein(a: str, b: str) -> int:
    """Edit distance between two strings, per code point (agnivade/levenshtein compares runes).

    Myers' bit-parallel algorithm (Hyyrö's formulation), one Python int as the bit vector: a GGUF's
    template is compared with every index entry, and a plain O(n*m) table costs seconds in Python
    for a few-kilobyte template where this costs milliseconds.
    """
    if a == b:
        return 0
    if len(a) < len(b):
        a, b = b, a
    m = len(b)
    if m == 0:
        return len(a)
    peq: dict[str, int] = {}
    for i, c in enumerate(b):
        peq[c] = peq.get(c, 0) | (1 << i)
    mask = (1 << m) - 1
    high = 1 << (m - 1)
    vp, vn, score = mask, 0, m
    for c in a:
        eq = peq.get(c, 0)
        x = eq | vn
        d0 = (((x & vp) + vp) ^ vp) | x
        hn = vp & d0
        hp = vn | (~(vp | d0) & mask)
        if hp & high:
            score += 1
        elif hn & high:
            score -= 1
        x = ((hp << 1) | 1) & mask  # row 0 of the table is 0, 1, 2 ...: a 1 shifts in
        vn = x & d0
        vp = ((hn << 1) & mask) | (~(x | d0) & mask)
    return score


@functools.cache
def named_templates() -> tuple[NamedTemplate, ...]:
    """template/index.json in its order (the order decides ties), each with its .gotmpl and .json."""
    root = resources.files(__package__) / "gotmpl"
    out = []
    for item in json.loads((root / "index.json").read_text(encoding="utf-8")):
        name = item["name"]
        text = (root / f"{name}.gotmpl").read_text(encoding="utf-8").replace("\r\n", "\n")
        params_file = root / f"{name}.json"
        params = json.loads(params_file.read_text(encoding="utf-8")) if params_file.is_file() else None
        out.append(NamedTemplate(name, item["template"], text, params))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def named(jinja: str) -> NamedTemplate | None:
    """Ollama's template.Named: the built-in template nearest to this jinja text, if under 100 edits."""
    best: NamedTemplate | None = None
    score = MAX_DISTANCE
    for t in named_templates():
        # A length gap is a lower bound on the distance: skip what cannot beat the best so far.
        if abs(len(t.jinja) - len(jinja)) >= score:
            continue
        d = levenshtein(jinja, t.jinja)
        if d < score:
            best, score = t, d
    return best
