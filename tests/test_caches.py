"""The daemon's suffix caches: one per pair by default, one per vocabulary with `global`, none with
`off`, and a `cache_file` that carries what was learnt across a restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.config.entries import PairEntry, build_entry
from sidecar.config.schema import Pair
from sidecar.engine.llama import Weights
from sidecar.runtime.llamacpp.caches import SuffixCaches
from tests.conftest import SMOLLM2_REF

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def weights(smollm2: Path) -> Iterator[Weights]:
    w = Weights(smollm2, n_gpu_layers=0)
    yield w
    w.close()


def entry(name: str, base: Path | None = None, **speculative: Any) -> PairEntry:
    return build_entry(name, Pair.model_validate({"from": SMOLLM2_REF, "draft": "ngram",
                                                  "speculative": speculative}), base)


def test_scopes(weights: Weights) -> None:
    caches = SuffixCaches()
    a, b = caches.for_pair(entry("a:x"), weights), caches.for_pair(entry("b:x"), weights)
    assert a is not None and b is not None and a is not b  # `pair`: each its own
    assert caches.for_pair(entry("a:x"), weights) is a  # and it outlives the pair's engine
    g1 = caches.for_pair(entry("c:x", cache="global"), weights)
    g2 = caches.for_pair(entry("d:x", cache="global"), weights)
    assert g1 is not None and g1 is g2 and g1 is not a  # `global`: one per vocabulary
    assert caches.for_pair(entry("e:x", cache="off"), weights) is None
    model_only = build_entry("f:x", Pair.model_validate({"from": SMOLLM2_REF, "draft": SMOLLM2_REF}))
    assert caches.for_pair(model_only, weights) is None  # the cache drafts beside an n-gram drafter


def test_a_cache_file_carries_the_cache_across_a_restart(weights: Weights, tmp_path: Path) -> None:
    learnt = list(range(100, 160))
    caches = SuffixCaches()
    cache = caches.for_pair(entry("a:x", tmp_path, cache_file="suffix.npz"), weights)
    assert cache is not None
    cache.add(learnt)
    caches.save()
    assert (tmp_path / "suffix.npz").is_file()  # relative to the config file's directory
    again = SuffixCaches().for_pair(entry("a:x", tmp_path, cache_file="suffix.npz"), weights)
    assert again is not None and again.size == cache.size
    assert again.lookup(learnt[:10], 8).tokens == learnt[10:18]
