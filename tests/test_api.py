"""Ollama's native API, end to end: the daemon as a process, driven by the official client."""

from __future__ import annotations

import json
import time

import httpx
import ollama
import pytest

from tests.conftest import Daemon

pytestmark = pytest.mark.daemon

TINY = "tiny:test"
TIMEOUT = 120  # generous: CI machines are small and may be busy


def post(url: str, **kw: object) -> httpx.Response:
    return httpx.post(url, timeout=TIMEOUT, **kw)  # type: ignore[arg-type]
GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> ollama.Client:
    return ollama.Client(host=daemon.url)


def ndjson_lines(resp: httpx.Response) -> list[dict]:
    body = resp.content
    assert body.endswith(b"\n")
    assert body.isascii(), "NDJSON must be ASCII-escaped"
    lines = body.split(b"\n")[:-1]
    assert all(lines), "no blank lines in NDJSON"
    return [json.loads(x) for x in lines]


def test_root_and_version(daemon: Daemon) -> None:
    r = httpx.get(daemon.url + "/")
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert httpx.head(daemon.url + "/").status_code == 200
    v = httpx.get(daemon.url + "/api/version").json()["version"]
    assert [int(x) for x in v.split(".")] >= [0, 12]


def test_generate_streaming(client: ollama.Client) -> None:
    chunks = list(client.generate(model=TINY, prompt="hello", options=GREEDY, stream=True))
    assert all(not c.done for c in chunks[:-1])
    final = chunks[-1]
    assert final.done and final.done_reason in ("stop", "length")
    assert final.eval_count == len(chunks) - 1 or final.eval_count >= 1
    for field in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(final, field), int)
    assert final.prompt_eval_count and final.context


def test_generate_not_streaming_matches_stream(client: ollama.Client) -> None:
    streamed = "".join(c.response for c in client.generate(model=TINY, prompt="abc", options=GREEDY, stream=True))
    whole = client.generate(model=TINY, prompt="abc", options=GREEDY, stream=False)
    assert whole.done and whole.response == streamed
    assert whole.done_reason == ("length" if whole.eval_count == 24 else "stop")


def test_chat_streaming_and_not(client: ollama.Client) -> None:
    msgs = [{"role": "user", "content": "hi there"}]
    chunks = list(client.chat(model=TINY, messages=msgs, options=GREEDY, stream=True))
    assert all(c.message.role == "assistant" for c in chunks)
    assert chunks[-1].done and chunks[-1].message.content == ""
    whole = client.chat(model=TINY, messages=msgs, options=GREEDY)
    assert whole.message.content == "".join(c.message.content for c in chunks)


def test_raw_wire_format(daemon: Daemon) -> None:
    r = post(daemon.url + "/api/generate", json={"model": TINY, "prompt": "x", "options": GREEDY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = ndjson_lines(r)
    assert [k for k in lines[0]] == ["model", "created_at", "response", "done"]
    final = lines[-1]
    assert final["done"] is True and "context" in final
    assert final["created_at"].endswith("Z")
    for k in ("draft_tokens", "draft_accepted_tokens", "draft_rounds", "fallback"):
        assert k in final
    chat = post(daemon.url + "/api/chat", json={
        "model": TINY, "messages": [{"role": "user", "content": "x"}], "options": GREEDY, "stream": False})
    body = chat.json()
    assert chat.headers["content-type"].startswith("application/json")
    assert "context" not in body and body["message"]["role"] == "assistant"


def test_characters_split_across_tokens_arrive_whole(client: ollama.Client, tiny_bytes) -> None:  # type: ignore[no-untyped-def]
    """A model that emits raw bytes: the streamed text is exactly its bytes decoded as UTF-8."""
    from sidecar.engine.llama import Weights

    w = Weights(tiny_bytes, n_gpu_layers=0)
    multibyte = 0
    try:
        for seed in range(6):
            opts = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "seed": seed, "num_predict": 60}
            chunks = list(client.generate(model="tiny:bytes", prompt="héllo ✓ 日本", options=opts, stream=True))
            final = chunks[-1]
            out = final.context[len(final.context) - final.eval_count:]  # prompt_eval_count skips cached tokens
            expected = b"".join(w.piece(t) for t in out).decode("utf-8", "replace")
            assert "".join(c.response for c in chunks) == expected
            multibyte += sum(1 for ch in expected if ord(ch) > 127 and ch != "\ufffd")
    finally:
        w.close()
    assert multibyte > 0, "the model should have produced some multi-byte characters"


def test_stop_strings_never_emitted(client: ollama.Client) -> None:
    full = client.generate(model=TINY, prompt="stop test", options={**GREEDY, "num_predict": 40}).response
    assert len(full) > 4
    stop = full[5:8]
    cut = client.generate(model=TINY, prompt="stop test", options={**GREEDY, "num_predict": 40, "stop": [stop]})
    assert cut.response == full[: full.index(stop)]
    assert cut.done_reason == "stop"


def test_list_show_ps(client: ollama.Client) -> None:
    names = [m.model for m in client.list().models]
    assert TINY in names and "smollm2:135m" in names
    show = client.show(TINY)
    assert show.modelinfo is not None and show.modelinfo["general.architecture"] == "llama"
    assert show.details.format == "gguf"
    client.generate(model=TINY, prompt="load me", options=GREEDY)
    assert TINY in [m.model for m in client.ps().models]


def test_keep_alive_load_and_unload(client: ollama.Client) -> None:
    loaded = client.generate(model=TINY, prompt="", keep_alive=-1)
    assert loaded.done and loaded.done_reason == "load"
    ps = {m.model: m for m in client.ps().models}
    assert TINY in ps
    unloaded = client.generate(model=TINY, prompt="", keep_alive=0)
    assert unloaded.done_reason == "unload"
    assert TINY not in [m.model for m in client.ps().models]
    chat_load = client.chat(model=TINY, messages=[])
    assert chat_load.done_reason == "load" and chat_load.message.role == "assistant"


def test_keep_alive_expires(client: ollama.Client) -> None:
    client.generate(model=TINY, prompt="short stay", options=GREEDY, keep_alive="1s")
    assert TINY in [m.model for m in client.ps().models]
    deadline = time.monotonic() + 10
    while TINY in [m.model for m in client.ps().models]:
        assert time.monotonic() < deadline, "model did not unload after keep_alive"
        time.sleep(0.2)


def test_keep_alive_zero_unloads_after_request(client: ollama.Client) -> None:
    r = client.generate(model=TINY, prompt="one shot", options=GREEDY, keep_alive=0)
    assert r.done
    deadline = time.monotonic() + 5
    while TINY in [m.model for m in client.ps().models]:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_debug_render_only(daemon: Daemon) -> None:
    r = post(daemon.url + "/api/chat", json={
        "model": TINY, "messages": [{"role": "user", "content": "Hi"}], "_debug_render_only": True})
    assert r.status_code == 200
    assert r.json()["_debug_info"]["rendered_template"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_template_and_system_overrides(daemon: Daemon) -> None:
    r = post(daemon.url + "/api/generate", json={
        "model": TINY, "prompt": "P", "system": "S", "template": "[{{ .System }}|{{ .Prompt }}]",
        "_debug_render_only": True})
    assert r.json()["_debug_info"]["rendered_template"] == "[S|P]"


@pytest.mark.parametrize(("path", "body", "status", "message"), [
    ("/api/generate", {"model": "nope:1", "prompt": "x"}, 404, "model 'nope:1' not found"),
    ("/api/generate", {"model": "", "prompt": "x"}, 404, "model '' not found"),
    ("/api/chat", {"messages": []}, 400, "model is required"),
    ("/api/show", {}, 400, "model is required"),
    ("/api/show", {"model": "nope:1"}, 404, "model 'nope:1' not found"),
    ("/api/generate", {"model": TINY, "prompt": 5}, 400, "cannot unmarshal number"),
    ("/api/generate", {"model": TINY, "prompt": "x", "options": {"top_k": "many"}}, 400,
     'option "top_k" must be of type integer'),
    ("/api/generate", {"model": TINY, "prompt": "x", "options": {"stop": "x"}}, 400,
     'option "stop" must be of type array'),
    ("/api/generate", {"model": TINY, "prompt": "x", "raw": True, "system": "s"}, 400,
     "raw mode does not support template, system, or context"),
    ("/api/generate", {"model": TINY, "prompt": "x", "keep_alive": "3600"}, 400, "missing unit"),
    ("/api/generate", {"model": TINY, "prompt": "x", "format": "yaml"}, 400, "invalid format"),
    ("/api/chat", {"model": TINY, "messages": [{"role": "user", "content": "x"}], "think": "lots"}, 400,
     "invalid think value"),
])
def test_errors_have_ollamas_shape(daemon: Daemon, path: str, body: dict, status: int, message: str) -> None:
    r = post(daemon.url + path, json=body)
    assert r.status_code == status
    assert r.headers["content-type"].startswith("application/json")
    assert message in r.json()["error"]


def test_malformed_bodies(daemon: Daemon) -> None:
    for raw, msg in ((b"", "missing request body"), (b"{not json", "invalid character 'n'"),
                     (b"[1,2]", "cannot unmarshal")):
        r = post(daemon.url + "/api/generate", content=raw)
        assert r.status_code == 400 and msg in r.json()["error"]


def test_prompt_longer_than_context(daemon: Daemon) -> None:
    """Cut to fit, as Ollama cuts it; with `truncate: false` the client's 400."""
    r = post(daemon.url + "/api/generate", json={"model": TINY, "prompt": "long " * 400, "stream": False,
                                                 "options": {"num_predict": 4}})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] < 256, r.text
    r = post(daemon.url + "/api/generate", json={"model": TINY, "prompt": "long " * 400, "stream": False,
                                                 "truncate": False})
    assert r.status_code == 400 and "context" in r.json()["error"]
    # ...and the daemon keeps serving.
    ok = post(daemon.url + "/api/generate", json={"model": TINY, "prompt": "x", "options": GREEDY,
                                                         "stream": False})
    assert ok.status_code == 200 and ok.json()["done"]


def test_unknown_route_is_gin_404(daemon: Daemon) -> None:
    r = httpx.get(daemon.url + "/api/nothing-here")
    assert r.status_code == 404 and r.text == "404 page not found"


def test_disconnect_stops_generation(daemon: Daemon) -> None:
    """A client that goes away frees the model within a decode step, not after num_predict tokens."""
    n = 1500
    opts = {"temperature": 0, "num_predict": 32, "draft_num_predict": 0}
    warm = post(daemon.url + "/api/generate", json={
        "model": "smollm2:135m", "prompt": "Count from one to ten.", "stream": False, "options": opts}).json()
    per_token = warm["eval_duration"] / warm["eval_count"] / 1e9
    body = {"model": "smollm2:135m", "prompt": "Count from one to ten thousand.", "options": {**opts, "num_predict": n}}
    with httpx.stream("POST", daemon.url + "/api/generate", json=body, timeout=300) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert json.loads(next(lines))["done"] is False
    t0 = time.monotonic()
    r2 = post(daemon.url + "/api/generate", json={
        "model": "smollm2:135m", "prompt": "hi", "stream": False, "options": {"num_predict": 4}})
    assert r2.status_code == 200 and r2.json()["done"]
    # The next request did not wait for the abandoned one's remaining tokens.
    assert time.monotonic() - t0 < 0.25 * n * per_token


def test_requests_for_one_model_queue(daemon: Daemon) -> None:
    """Concurrent requests for the same model are served one after another, all complete."""
    import concurrent.futures

    def one(i: int) -> dict:
        return post(daemon.url + "/api/generate", json={
            "model": TINY, "prompt": f"q{i}", "stream": False, "options": GREEDY}).json()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(8)))
    assert all(r["done"] for r in results)


def test_ollama_keep_alive_sets_the_default(tmp_path, tiny) -> None:  # type: ignore[no-untyped-def]
    from tests.conftest import write_config

    cfg = write_config(tmp_path / "pairs.yaml", f"pairs:\n  tiny:ka:\n    from: {tiny}\n")
    d = Daemon(cfg, env={"OLLAMA_KEEP_ALIVE": "1s"})
    try:
        client = ollama.Client(host=d.url)
        client.generate(model="tiny:ka", prompt="x", options=GREEDY)
        assert "tiny:ka" in [m.model for m in client.ps().models]
        deadline = time.monotonic() + 10
        while "tiny:ka" in [m.model for m in client.ps().models]:
            assert time.monotonic() < deadline, "OLLAMA_KEEP_ALIVE=1s was not applied"
            time.sleep(0.2)
    finally:
        d.stop()
