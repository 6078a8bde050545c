"""The runtime and the API run on any engine that implements runtime.contract.Engine.

A fake engine (no llama.cpp: bytes for tokens, a canned answer) serves a pair through the real
runtime and app, so everything above the seam is exercised without a model; the llama.cpp engine's
Outcome carries every counter its decoder reports."""

from __future__ import annotations

import ast
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from sidecar.api.app import create_app
from sidecar.config.entries import PairEntry, build_entry
from sidecar.config.schema import Pair
from sidecar.engine.decoder import Result
from sidecar.runtime.contract import (
    Generation,
    Logprob,
    Model,
    ModelStatus,
    Outcome,
    Piece,
    TokenLogprob,
    Vocabulary,
)
from sidecar.runtime.llamacpp import LlamaEngine
from sidecar.runtime.manager import Runtime

pytestmark = pytest.mark.model

Factory = Callable[..., Awaitable[TestClient]]
SIDECAR = Path(__file__).resolve().parents[1] / "sidecar"
ANSWER = ["hm", "</think>", "Hello", " there"]


@dataclass(eq=False)
class FakeModel:
    n_ctx: int
    pairs: dict[str, PairEntry] = field(default_factory=dict)
    prompts: list[list[int]] = field(default_factory=list)

    def fits(self, n_ctx: int, num_gpu: int = -1) -> bool:
        return n_ctx == self.n_ctx

    def vocabulary(self) -> Vocabulary:
        return Vocabulary("", "")

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return list(text.encode())

    def detokenize(self, tokens: Sequence[int]) -> str:
        return bytes(tokens).decode()

    def pair(self, name: str) -> PairEntry | None:
        return self.pairs.get(name)

    def status(self) -> ModelStatus:
        return ModelStatus("fake", self.n_ctx, 1, tuple(sorted(self.pairs)), 0, "measured")


class FakeEngine:
    def __init__(self) -> None:
        self.unloaded: list[Model] = []

    def load_key(self, entry: PairEntry, parallel: int) -> str:
        return f"{entry.target.path}|{parallel}"

    async def load(self, entry: PairEntry, n_ctx: int, parallel: int, num_gpu: int = -1) -> FakeModel:
        return FakeModel(n_ctx)

    async def add_pair(self, model: Model, entry: PairEntry) -> None:
        assert isinstance(model, FakeModel)
        model.pairs[entry.name] = entry

    def rebind_pair(self, model: Model, entry: PairEntry) -> None:
        self._own(model).pairs[entry.name] = entry

    def drop_pair(self, model: Model, name: str) -> None:
        self._own(model).pairs.pop(name, None)

    def unload(self, model: Model) -> None:
        self.unloaded.append(model)

    async def join(self, model: Model, timeout: float) -> None:
        pass

    async def close(self) -> None:
        pass

    async def generate(self, model: Model, pair: str, gen: Generation, stop: Callable[[], bool]
                       ) -> AsyncIterator[Piece]:
        fake = self._own(model)
        fake.prompts.append(gen.tokens)
        for text in ANSWER:
            if gen.logprobs is not None:
                yield (Logprob(TokenLogprob(text, -0.5, text.encode())),)
            yield text
        out = list(b"".join(t.encode() for t in ANSWER))
        yield Outcome(done_reason="stop", tokens=out, prompt_tokens=len(gen.tokens), eval_seconds=0.5,
                      context=gen.tokens + out)

    def status(self) -> dict[str, Any]:
        return {"loaded_weights": 0, "weights": []}

    @staticmethod
    def _own(model: Model) -> FakeModel:
        assert isinstance(model, FakeModel)
        return model


@pytest.fixture
def runtime(tiny: Path) -> Runtime:
    rt = Runtime(FakeEngine(), keep_alive=-1)
    template = ("{{ range .Messages }}<{{ .Role }}>{{ .Content }}{{ if .Thinking }}<think>{{ .Thinking }}</think>"
                "{{ end }}{{ end }}<assistant>{{ if .Think }}<think>{{ end }}")
    rt.set_entries({"fake:test": build_entry("fake:test", Pair.model_validate(
        {"from": str(tiny), "template": template, "parameters": {"num_ctx": 256}}))})
    return rt


async def test_a_chat_runs_on_another_engine(aiohttp_client: Factory, runtime: Runtime) -> None:
    client = await aiohttp_client(create_app(runtime))
    r = await client.post("/api/chat", json={"model": "fake:test", "stream": False, "logprobs": True,
                                             "messages": [{"role": "user", "content": "hi"}]})
    body = await r.json()
    assert r.status == 200, body
    # The template opened the thinking section: the parser chosen for the pair splits it off.
    assert body["message"] == {"role": "assistant", "content": "Hello there", "thinking": "hm"}
    assert body["eval_count"] == len("hm</think>Hello there") and body["prompt_eval_count"] == len(
        "<user>hi<assistant><think>")
    assert [lp["token"] for lp in body["logprobs"]] == ANSWER
    (model,) = runtime.loaded_models()
    assert isinstance(model, FakeModel) and model.detokenize(model.prompts[0]) == "<user>hi<assistant><think>"

    ps = await (await client.get("/api/ps")).json()
    assert [(m["name"], m["context_length"], m["size_vram"]) for m in ps["models"]] == [("fake:test", 256, 0)]
    assert ps["models"][0]["sidecar"] == {"parallel": 1, "busy": 0, "rows_per_step": 0.0, "cached_tokens": 0,
                                          "restored_tokens": 0}
    status = await (await client.get("/sidecar/status")).json()
    assert status["models"][0] | {"expires_in": None} == {
        "target": "fake", "context_length": 256, "parallel": 1, "pairs": ["fake:test"], "in_flight": 0,
        "busy": 0, "rows_per_step": 0.0, "cached_tokens": 0, "restored_tokens": 0, "host_cache_mib": 0.0,
        "withdrawn_drafts": 0, "joint_drafts": 0, "cost_curve": "measured",
        "expires_in": None}
    assert status["pairs"][0]["capabilities"] == ["completion", "thinking"]


async def test_a_reload_goes_through_the_engine(runtime: Runtime, tiny: Path) -> None:
    entry = runtime.find("fake:test")
    assert entry is not None
    model, _ = await runtime.load(entry)
    runtime.apply({})
    assert runtime.engine.unloaded == [model]  # type: ignore[attr-defined]


async def test_the_llama_engine_is_one_such_engine(tiny: Path) -> None:
    rt = Runtime(LlamaEngine(), keep_alive=-1)
    entry = build_entry("tiny:test", Pair.model_validate(
        {"from": str(tiny), "runtime": {"num_thread": 1, "num_gpu": 0}, "parameters": {"num_ctx": 256}}))
    rt.set_entries({entry.name: entry})
    model, _ = await rt.load(entry)
    try:
        assert model.detokenize(model.tokenize("hello there", add_special=False)) == "hello there"
        assert model.pair("tiny:test") is entry
        s = rt.status()[0]
        assert (s.context_length, s.parallel, s.pairs, s.gpu_layers) == (256, 1, ("tiny:test",), 0)
    finally:
        await rt.unload_all()


def test_the_outcome_carries_every_counter_of_the_decoder() -> None:
    assert {f.name for f in fields(Result)} <= {f.name for f in fields(Outcome)}


def _imports(f: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_llama_cpp_stays_behind_the_seam() -> None:
    """Only the llama.cpp engine's package reads llama.cpp; the API never names an engine."""
    llama = {str(f.relative_to(SIDECAR)) for f in (SIDECAR / "runtime").rglob("*.py")
             if "sidecar.engine.llama" in _imports(f) and "llamacpp" not in f.parts}
    assert not llama, llama
    api = {str(f.relative_to(SIDECAR)): names for f in (SIDECAR / "api").rglob("*.py")
           if (names := {m for m in _imports(f) if m.startswith("sidecar.runtime.llamacpp")})}
    assert not api, api
