"""Hot reload end to end: a real daemon process, the real watcher, real edits to pairs.yaml.

One daemon serves the whole module; every test writes the complete config it needs and waits
until /sidecar/status reports that file's hash, so the tests do not depend on their order.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.runtime.llamacpp import LlamaEngine
from sidecar.runtime.manager import Runtime
from sidecar.runtime.reload import Reloader
from tests.conftest import Daemon
from tests.models import write_tiny_llama, write_tiny_pair
from tests.stores import add_ollama_model

pytestmark = pytest.mark.daemon

TIMEOUT = 30.0  # generous: the machine running the suite may be busy
# More tokens than loopback socket buffers hold (~2,600 NDJSON lines measured here): a client
# that stops reading then stalls the generation itself, so the reload lands while it runs.
STREAM_TOKENS = 3000


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The config directory: models beside it, an Ollama store under it."""
    d = tmp_path_factory.mktemp("reload")
    write_tiny_llama(d / "tiny.gguf", seed=1)
    # end_bias 0: the target never emits <|im_end|>, so a stream runs for exactly num_predict tokens.
    write_tiny_pair(d / "pair", seed=3, end_bias=0.0, n_ctx_train=4096)
    add_ollama_model(d / "store", "registry.ollama.ai/reload/model/v1", d / "tiny.gguf", params={"num_predict": 2})
    return d


@pytest.fixture(scope="module")
def daemon(home: Path) -> Iterator[Daemon]:
    cfg = home / "pairs.yaml"
    cfg.write_text(base_config())
    d = Daemon(cfg)
    yield d
    assert d.stop() == 0, d.log()


def base_config(num_predict: int = 3, extra: str = "") -> str:
    return f"""
models:
  ollama: store
pairs:
  tiny:test:
    from: tiny.gguf
    runtime: {{num_thread: 1}}
    parameters:
      temperature: 0
      num_ctx: 256
      num_predict: {num_predict}
{extra}"""


def sha(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def status(d: Daemon) -> dict[str, Any]:
    r = httpx.get(d.url + "/sidecar/status", timeout=10)
    assert r.status_code == 200
    return r.json()


def wait_status(d: Daemon, pred: Callable[[dict[str, Any]], Any], what: str) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT
    while True:
        st = status(d)
        if pred(st) and not st["reloading"]:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"status never showed {what}: {json.dumps(st, indent=1)}\n{d.log()[-4000:]}")
        time.sleep(0.1)


def save(d: Daemon, text: str) -> dict[str, Any]:
    """Write the config in place (as `echo > file` does) and wait until the daemon applied it."""
    cfg = Path(d.log_path).parent / "pairs.yaml"
    cfg.write_text(text)
    return wait_status(d, lambda st: st["config_hash"] == sha(text) and st["last_error"] is None,
                       "the new config applied")


def pair(st: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in st["pairs"] if p["name"] == name)


def generate(d: Daemon, model: str, **options: Any) -> dict[str, Any]:
    r = httpx.post(d.url + "/api/generate", json={"model": model, "prompt": "hi", "stream": False,
                                                  "options": options}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_status_reports_the_config_in_force(daemon: Daemon, home: Path) -> None:
    text = base_config()
    st = save(daemon, text)
    assert st["config"] == str(home / "pairs.yaml")
    assert st["config_hash"] == sha(text) and st["loaded_at"].endswith("Z")
    assert st["last_error"] is None and st["watching"] is True
    assert set(st["reloads"]) == {"attempted", "applied", "failed", "unchanged"}
    assert pair(st, "tiny:test")["state"] in ("loaded", "unloaded")
    # Admin routes live outside /api/, where an Ollama client never looks.
    assert httpx.get(daemon.url + "/api/sidecar/status").status_code == 404


def test_an_edit_during_a_stream(daemon: Daemon, home: Path) -> None:
    """The stream finishes on the pair it started with; the next request gets the new pair; the
    old drafter is freed only after the stream is through."""
    old = base_config(extra="""
  spec:test:
    from: pair/tiny-target-s3.gguf
    draft: {from: pair/tiny-draft-s3-e0.01.gguf, num_thread: 1}
    runtime: {num_thread: 1}
    parameters: {temperature: 0, num_ctx: 4096}
""")
    new = base_config(extra="""
  spec:test:
    from: pair/tiny-target-s3.gguf
    draft: none
    runtime: {num_thread: 1}
    parameters: {temperature: 0, num_ctx: 4096, num_predict: 7}
""")
    save(daemon, old)
    body = {"model": "spec:test", "prompt": "hello", "options": {"num_predict": STREAM_TOKENS}}
    with httpx.stream("POST", daemon.url + "/api/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert not json.loads(next(lines))["done"]
        # Not reading on: the server blocks on a full socket, so generation is still under way.
        st = save(daemon, new)
        assert st["last_changes"]["changed"] == ["spec:test"]
        target = next(m for m in st["models"] if m["target"].endswith("tiny-target-s3.gguf"))
        assert target["in_flight"] == 1
        held = {Path(w["path"]).name for w in st["weights"]}
        assert "tiny-draft-s3-e0.01.gguf" in held, "the draft was freed under a running stream"
        rest = [json.loads(x) for x in lines]
    final = rest[-1]
    assert final["done"] and final["eval_count"] == STREAM_TOKENS and "error" not in final
    wait_status(daemon, lambda st: all("tiny-draft" not in w["path"] for w in st["weights"]),
                "the old draft freed after the stream")
    after = generate(daemon, "spec:test")
    assert after["eval_count"] == 7 and after["draft_tokens"] == 0
    assert "freed draft tiny-draft-s3-e0.01.gguf of spec:test" in daemon.log()


def test_a_broken_edit_keeps_the_last_good_config(daemon: Daemon, home: Path) -> None:
    good = base_config(num_predict=3)
    st = save(daemon, good)
    failed = st["reloads"]["failed"]
    broken = good + "    colour: blue\n"  # an unknown key, in tiny:test
    (home / "pairs.yaml").write_text(broken)
    line = broken.splitlines().index("    colour: blue") + 1
    st = wait_status(daemon, lambda st: st["last_error"] and "colour" in st["last_error"], "the error")
    assert f"{home / 'pairs.yaml'}:{line}: pairs.tiny:test.colour: unknown key" in st["last_error"]
    assert st["config_hash"] == sha(good) and st["reloads"]["failed"] == failed + 1
    assert generate(daemon, "tiny:test")["eval_count"] == 3  # still the old pair
    assert "config reload failed, keeping the last good config" in daemon.log()
    save(daemon, base_config(num_predict=4))
    assert generate(daemon, "tiny:test")["eval_count"] == 4


def test_a_pair_whose_model_is_missing(daemon: Daemon, home: Path) -> None:
    """A new pair waits until its model can be found; a changed one keeps its last working form."""
    save(daemon, base_config(num_predict=3))
    text = base_config(num_predict=4).replace("from: tiny.gguf", "from: not-there.gguf") + """
  new:test:
    from: llama3.1:70b
"""
    (home / "pairs.yaml").write_text(text)
    st = wait_status(daemon, lambda st: st["config_hash"] == sha(text), "the edit applied")
    assert "not-there.gguf" in pair(st, "tiny:test")["error"] and "previous" in pair(st, "tiny:test")["error"]
    assert pair(st, "new:test")["state"] == "error"
    assert "not found in the Ollama store" in pair(st, "new:test")["error"] and str(home / "store") in st["last_error"]
    assert generate(daemon, "tiny:test")["eval_count"] == 3  # the previous declaration
    r = httpx.post(daemon.url + "/api/generate", json={"model": "new:test", "prompt": "x"})
    assert r.status_code == 404
    save(daemon, base_config(num_predict=4))
    assert generate(daemon, "tiny:test")["eval_count"] == 4


def test_an_atomic_rename_save(daemon: Daemon, home: Path) -> None:
    save(daemon, base_config(num_predict=3))
    text = base_config(num_predict=5)
    tmp = home / ".pairs.yaml.tmp"
    tmp.write_text(text)
    os.replace(tmp, home / "pairs.yaml")  # what editors and `sed -i` do
    wait_status(daemon, lambda st: st["config_hash"] == sha(text), "the renamed file applied")
    assert generate(daemon, "tiny:test")["eval_count"] == 5


def test_deleting_and_recreating_the_file(daemon: Daemon, home: Path) -> None:
    save(daemon, base_config(num_predict=3))
    (home / "pairs.yaml").unlink()
    st = wait_status(daemon, lambda st: st["last_error"] and "missing" in st["last_error"], "the missing file")
    assert generate(daemon, "tiny:test")["eval_count"] == 3
    assert pair(st, "tiny:test")["state"] in ("loaded", "unloaded")
    text = base_config(num_predict=6)
    (home / "pairs.yaml").write_text(text)
    wait_status(daemon, lambda st: st["config_hash"] == sha(text) and st["last_error"] is None, "the new file")
    assert generate(daemon, "tiny:test")["eval_count"] == 6


def test_pairs_sharing_a_target_load_it_once(daemon: Daemon) -> None:
    shared = base_config(extra="""
  also:test:
    from: tiny.gguf
    runtime: {num_thread: 1}
    system: a different system prompt, the same model
    parameters: {temperature: 0, num_ctx: 256, num_predict: 2}
""")
    save(daemon, shared)
    generate(daemon, "tiny:test")
    generate(daemon, "also:test")
    st = status(daemon)
    tiny = [m for m in st["models"] if m["target"].endswith("/tiny.gguf")]
    assert len(tiny) == 1 and tiny[0]["pairs"] == ["also:test", "tiny:test"]
    assert [w["refs"] for w in st["weights"] if w["path"].endswith("/tiny.gguf")] == [1]
    assert pair(st, "tiny:test")["state"] == pair(st, "also:test")["state"] == "loaded"
    # Removing one pair leaves the other loaded, untouched.
    st = save(daemon, base_config())
    assert st["last_changes"]["removed"] == ["also:test"] and "tiny:test" in st["last_changes"]["kept"]
    assert pair(st, "tiny:test")["state"] == "loaded"
    assert [m["pairs"] for m in st["models"] if m["target"].endswith("/tiny.gguf")] == [["tiny:test"]]


def test_sighup_reloads_and_rereads_the_model_store(daemon: Daemon, home: Path) -> None:
    """The config file does not change, the Ollama model behind a pair does: SIGHUP picks it up."""
    text = base_config(extra="""
  store:test:
    from: reload/model:v1
    runtime: {num_thread: 1}
    parameters: {temperature: 0, num_ctx: 256}
""")
    st = save(daemon, text)
    assert generate(daemon, "store:test")["eval_count"] == 2  # the params layer's num_predict
    add_ollama_model(home / "store", "registry.ollama.ai/reload/model/v1", home / "tiny.gguf",
                     params={"num_predict": 5})
    before = st
    daemon.proc.send_signal(signal.SIGHUP)
    st = wait_status(daemon, lambda st: st["reloads"]["applied"] > before["reloads"]["applied"], "the reload")
    assert st["triggers"]["signal"] == before["triggers"]["signal"] + 1
    assert st["triggers"]["file"] == before["triggers"]["file"]  # the store is not the config
    assert st["last_changes"]["changed"] == ["store:test"]
    show = httpx.post(daemon.url + "/api/show", json={"model": "store:test"}).json()
    assert "num_predict" in show["parameters"] and "5" in show["parameters"]
    assert generate(daemon, "store:test")["eval_count"] == 5


async def test_triggers_coalesce_into_one_single_flight_reload(tmp_path: Path) -> None:
    """A burst of file events and signals is one reload; a trigger during a reload, one more."""
    cfg = tmp_path / "pairs.yaml"
    cfg.write_text("pairs: {}\n")
    reloader = Reloader(cfg, Runtime(LlamaEngine()), debounce=0.05, watch=False)
    reloader.load_initial()
    calls: list[str] = []
    real = reloader.reload

    async def counted(source: str = "signal") -> bool:
        calls.append(source)
        if len(calls) == 1:
            reloader.trigger("file")  # arrives while the first reload runs
        return await real(source)

    reloader.reload = counted  # type: ignore[method-assign]
    await reloader.start()
    try:
        for source in ("file", "signal", "file", "signal"):
            reloader.trigger(source)
        deadline = time.monotonic() + 10
        while len(calls) < 2 or reloader.reloading:
            assert time.monotonic() < deadline, calls
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # nothing else may follow
    finally:
        await reloader.stop()
    assert calls == ["signal", "file"]  # a signal in the burst makes it a full (signal) reload
    assert reloader.reloads["attempted"] == 2 and reloader.reloads["unchanged"] == 1
    assert reloader.triggers == {"file": 3, "signal": 2}


async def test_apply_diffs_pair_by_pair(home: Path) -> None:
    """Runtime.apply in-process: what it keeps, rebinds, drops and unloads."""
    from sidecar.config.entries import build_entry
    from sidecar.config.schema import Pair

    def entry(name: str, **fields: Any) -> Any:
        spec = {"from": "tiny.gguf", "runtime": {"num_thread": 1}, "parameters": {"num_ctx": 256}, **fields}
        return build_entry(name, Pair.model_validate(spec), home)

    rt = Runtime(LlamaEngine())
    a1, b1 = entry("a:1", draft="ngram"), entry("b:1")
    assert rt.apply({"a:1": a1, "b:1": b1}).added == ["a:1", "b:1"]
    lm, _ = await rt.load(a1)
    assert (await rt.load(b1))[0] is lm  # one target, one context for both pairs
    engine = lm.pairs["a:1"]

    same = rt.apply({"a:1": entry("a:1", draft="ngram"), "b:1": entry("b:1")})
    assert same.kept == ["a:1", "b:1"] and rt.find("a:1") is a1  # the very same entry object

    a2 = entry("a:1", draft="ngram", system="new defaults only")
    assert rt.apply({"a:1": a2, "b:1": b1}).changed == ["a:1"]
    assert lm.pairs["a:1"] is engine and engine.entry is a2  # the drafter is kept, rebound

    a3 = entry("a:1")  # the drafter changes: the old engine goes, the target stays
    assert rt.apply({"a:1": a3, "b:1": b1}).changed == ["a:1"]
    assert "a:1" not in lm.pairs and rt.loaded_models() == [lm]
    # A request that began before the reload loads its own (old) pair; the next one displaces it.
    await rt.load(a2)
    assert lm.pairs["a:1"].entry is a2
    await rt.load(a3)
    assert lm.pairs["a:1"].entry is a3

    assert rt.apply({}).removed == ["a:1", "b:1"]
    assert rt.loaded_models() == []
    await asyncio.to_thread(lm.batcher.join, 10)
    assert not lm.batcher.alive and rt.engine.weights.count == 0
