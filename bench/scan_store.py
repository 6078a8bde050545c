"""How long finding every model's drafts takes: a store scan cold (no cached facts) and cached.

Builds, in a temporary directory, an Ollama store with SmolLM2 and the models derived from it and
an LM Studio folder of hard links to them (each link is its own file to the scanner: its facts are
keyed by path, size and mtime), then times `find_drafts` (read every GGUF's tokenizer header,
check vocabularies pairwise, rank) from an empty facts cache and again from the cache it wrote.

    .venv/bin/python bench/scan_store.py [--links 24] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_spec import OUT, ensure_models  # noqa: E402
from derive_models import smollm2_path  # noqa: E402

from sidecar.models.cache import FileCache  # noqa: E402
from sidecar.models.resolve import Stores  # noqa: E402
from sidecar.pairing.catalog import find_drafts  # noqa: E402
from tests.stores import add_ollama_model  # noqa: E402


def build(root: Path, links: int) -> tuple[Stores, int]:
    files = [smollm2_path(), *(OUT / n for n in ("smollm2-trunc8.gguf", "smollm2-x120-eps0.gguf",
                                                 "smollm2-x120-one1.gguf"))]
    for f, tag in zip(files, ("135m", "trunc8", "x120", "x120-one1"), strict=True):
        add_ollama_model(root / "ollama", f"registry.ollama.ai/library/smollm2/{tag}", f)
    for i in range(links):
        d = root / "lmstudio" / "bench" / f"Model{i}-GGUF"
        d.mkdir(parents=True)
        os.link(files[i % len(files)], d / f"model{i}.gguf")
    return Stores(ollama=root / "ollama", lmstudio=root / "lmstudio"), len(files) + links


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--links", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    ensure_models(OUT)
    cold, cached, found = [], [], 0
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory(dir=OUT) as d:  # on the models' file system: hard links
            stores, n_files = build(Path(d), args.links)
            facts = Path(d) / "facts.json"
            first = find_drafts(stores, FileCache(facts))
            second = find_drafts(stores, FileCache(facts))
            assert second.files_read == 0
            cold.append(first.seconds)
            cached.append(second.seconds)
            found = sum(len(v) for v in first.drafts.values())
    print(f"# scan_store: {n_files} GGUF files ({len(first.entries)} models), median of {args.reps}\n")
    print("| scan | seconds | files read |")
    print("|---|---|---|")
    print(f"| cold (no cached facts) | {statistics.median(cold):.3f} | {first.files_read} |")
    print(f"| cached | {statistics.median(cached):.4f} | 0 |")
    print(f"\n{found} (target, draft) suggestions")


if __name__ == "__main__":
    main()
