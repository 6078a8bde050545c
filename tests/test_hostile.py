"""Hostile and random input against the real daemon: always a clear answer in the route's error shape.

Whatever a client sends (nesting that blows Python's recursion limit, bodies over the size limit,
bytes that are not UTF-8, the wrong JSON type in any field, absurd options) gets a 4xx in Ollama's
`{"error": "..."}` (OpenAI's envelope under /v1), never a 500 from an unhandled exception, never a
hung model thread: the daemon answers a normal request correctly afterwards. The second half
generates request bodies with hypothesis and checks the same contract on every one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Daemon, write_config

pytestmark = pytest.mark.daemon

TINY = "tiny:test"
T = 60
# Paths that parse a body, with the error shape their clients read.
ROUTES = ["/api/generate", "/api/chat", "/api/show", "/api/embed", "/api/pull", "/api/delete",
          "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/unknown-thing"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Iterator[Daemon]:
    """The tiny model, with an upstream that is down: bodies for other models are parsed to route them."""
    d = tmp_path_factory.mktemp("hostile")
    cfg = write_config(d / "pairs.yaml", f"""
upstream: http://127.0.0.1:9
upstream_kind: ollama
pairs:
  {TINY}:
    from: {tiny}
    parameters: {{temperature: 0, num_ctx: 256, num_predict: 8}}
    runtime: {{num_thread: 1}}
""")
    daemon = Daemon(cfg)
    yield daemon
    daemon.stop()
    assert not daemon.traces(), daemon.traces()


def check_answer(path: str, r: httpx.Response) -> None:
    """2xx with a body that parses, or an error in the route's envelope; never an unhandled 500."""
    if r.status_code < 300:
        if r.headers.get("content-type", "").startswith(("application/json", "application/x-ndjson")):
            for ln in r.text.splitlines():
                assert isinstance(json.loads(ln), dict)
        return
    if path.startswith("/api/unknown") and r.status_code == 404:
        return
    assert 400 <= r.status_code < 600, r.status_code
    body = r.json()
    if path.startswith("/v1/"):
        assert isinstance(body["error"]["message"], str), body
    else:
        assert set(body) == {"error"} and isinstance(body["error"], str), body
    assert r.status_code != 500 or "internal error" not in body_text(body), body
    if r.status_code >= 500:  # only the model failing or the upstream being down may answer 5xx
        assert r.status_code in (502, 503) or "running the model" in body_text(body), (r.status_code, body)


def body_text(body: dict[str, Any]) -> str:
    e = body["error"]
    return e if isinstance(e, str) else str(e.get("message"))


def still_serves(d: Daemon) -> None:
    r = httpx.post(d.url + "/api/generate", timeout=T, json={
        "model": TINY, "prompt": "hello", "stream": False, "options": {"num_predict": 8}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["done"] is True and body["eval_count"] >= 1
    reference = getattr(still_serves, "reference", None)
    if reference is None:
        still_serves.reference = body["response"]  # type: ignore[attr-defined]
    else:
        assert body["response"] == reference, "greedy output changed after hostile input"


def post_raw(d: Daemon, path: str, content: bytes) -> httpx.Response:
    return httpx.post(d.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=T)


# -- hand-picked hostile input -----------------------------------------------------------------------
def test_reference_answer(daemon: Daemon) -> None:
    still_serves(daemon)


@pytest.mark.parametrize("path", ROUTES)
def test_deep_nesting(daemon: Daemon, path: str) -> None:
    n = 100_000
    for body in ("[" * n + "]" * n, '{"model": "' + TINY + '", "options": ' + "[" * n + "]" * n + "}",
                 '{"model": "x", "a": ' + '{"a": ' * n + "1" + "}" * n + "}"):
        r = post_raw(daemon, path, body.encode())
        check_answer(path, r)
        forwarded = path in ("/api/pull", "/api/delete", "/api/unknown-thing")  # passed on unread; upstream down
        assert r.status_code in ((502,) if forwarded else (400, 404)), (path, r.status_code, r.text[:200])


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/v1/chat/completions", "/api/embed"])
def test_body_over_the_limit(daemon: Daemon, path: str) -> None:
    big = b'{"model": "tiny:test", "prompt": "' + b"a" * (65 * 1024 * 1024) + b'"}'
    r = post_raw(daemon, path, big)
    check_answer(path, r)
    assert r.status_code == 413


def test_huge_prompt_within_the_limit(daemon: Daemon) -> None:
    """Cut to fit (a 5,000-message chat keeps its newest messages), or, with truncate off, a 400."""
    r = httpx.post(daemon.url + "/api/generate", timeout=T, json={
        "model": TINY, "prompt": "ab " * 5_000, "stream": False})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] < 256
    r = httpx.post(daemon.url + "/api/generate", timeout=T, json={
        "model": TINY, "prompt": "ab " * 5_000, "stream": False, "truncate": False})
    assert r.status_code == 400 and "context" in r.json()["error"]
    big_chat = {"model": TINY, "messages": [{"role": "user", "content": "x"}] * 5_000, "stream": False}
    r = httpx.post(daemon.url + "/api/chat", json=big_chat, timeout=T)
    assert r.status_code == 200 and r.json()["prompt_eval_count"] < 256
    r = httpx.post(daemon.url + "/api/chat", json={**big_chat, "truncate": False}, timeout=T)
    assert r.status_code == 400 and "context" in r.json()["error"]
    still_serves(daemon)


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("raw", [b'{"model": "tiny:test", "prompt": "\xff\xfe\xc3"}', b"\xef\xbb\xbf{}", b"\x00" * 10,
                                 b'{"model": "tiny:test", "prompt": "\\ud800"}', b"{", b"null", b"[]", b"1e999",
                                 b'{"model": NaN}', b'{"model": "tiny:test", "options": {"temperature": Infinity}}'])
def test_bytes_that_are_not_a_json_object(daemon: Daemon, path: str, raw: bytes) -> None:
    check_answer(path, post_raw(daemon, path, raw))


VALUES: list[Any] = [None, True, 0, -1, 1.5, 10**30, "", "x", [], [1, "a"], {}, {"a": None}]
GENERATE_FIELDS = ["model", "prompt", "suffix", "system", "template", "context", "raw", "format", "images",
                   "keep_alive", "stream", "options", "think", "_debug_render_only", "truncate", "shift",
                   "logprobs", "top_logprobs"]
CHAT_FIELDS = ["model", "messages", "tools", "format", "keep_alive", "stream", "options", "think", "truncate",
               "shift", "logprobs", "top_logprobs"]
OPENAI_FIELDS = ["model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
                 "temperature", "top_p", "seed", "stop", "frequency_penalty", "presence_penalty", "response_format",
                 "tools", "logprobs", "top_logprobs", "reasoning_effort", "reasoning"]


def cases() -> Iterator[tuple[str, dict[str, Any]]]:
    base = {
        "/api/generate": {"model": TINY, "prompt": "hi", "stream": False, "options": {"num_predict": 4}},
        "/api/chat": {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "stream": False,
                      "options": {"num_predict": 4}},
        "/v1/chat/completions": {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    }
    fields = {"/api/generate": GENERATE_FIELDS, "/api/chat": CHAT_FIELDS, "/v1/chat/completions": OPENAI_FIELDS}
    for path, names in fields.items():
        for name in names:
            for v in VALUES:
                yield path, {**base[path], name: v}


@pytest.mark.parametrize(("path", "body"), list(cases()))
def test_every_field_with_every_type(daemon: Daemon, path: str, body: dict[str, Any]) -> None:
    check_answer(path, httpx.post(daemon.url + path, json=body, timeout=T))


ABSURD: list[tuple[dict[str, Any], int | None]] = [
    ({"num_ctx": 10**9}, 400),
    ({"num_ctx": 0}, 200),  # Ollama accepts it: the default window
    ({"num_ctx": -1}, 400),
    ({"num_predict": -5}, 400),  # Ollama knows -1 (no limit) and -2 (fill the context); below is a 400
    ({"num_predict": -2}, 200),
    ({"num_predict": 10**18}, 200),
    ({"top_k": -1}, 400),
    ({"top_k": 10**12}, 200),
    ({"top_p": 2}, 400),
    ({"min_p": -0.5}, 400),
    ({"temperature": -1}, 400),
    ({"temperature": 1e308}, 200),
    ({"temperature": "NaN"}, 400),
    ({"repeat_penalty": 0}, 400),
    ({"repeat_last_n": -7}, 400),
    ({"repeat_last_n": 10**9, "repeat_penalty": 1.3}, 200),
    ({"presence_penalty": 1e308, "frequency_penalty": -1e308}, 200),
    ({"seed": -5}, 200),
    ({"seed": 10**30}, 200),
    ({"stop": ["", "\u0000", "x" * 10_000] + ["a"] * 1000}, 200),
    ({"stop": "a"}, 400),
    ({"draft_num_predict": -1}, 400),
    ({"draft_num_predict": 10**9}, 200),
    ({"num_batch": -1, "num_gpu": 10**9, "num_thread": -3, "main_gpu": 99, "use_mmap": False}, 200),
    ({"num_gpu": 1e308}, 200),  # a reload with every layer: llama.cpp's count is a C int32, clamped
    ({"num_gpu": -10**30}, 200),  # -1: whatever is loaded
    ({"mirostat": 2, "unknown_option": {"deep": [1]}}, 200),
]


@pytest.mark.parametrize(("options", "status"), ABSURD)
def test_absurd_options(daemon: Daemon, options: dict[str, Any], status: int) -> None:
    r = httpx.post(daemon.url + "/api/generate", timeout=T, json={
        "model": TINY, "prompt": "hi", "stream": False, "options": {"num_predict": 16, **options}})
    check_answer("/api/generate", r)
    assert r.status_code == status, r.text


@pytest.mark.parametrize("context", [[10**9], [-1], [2**31], [0] * 300, [1, 2, 3]])
def test_context_with_bad_token_ids(daemon: Daemon, context: list[int]) -> None:
    r = httpx.post(daemon.url + "/api/generate", timeout=T, json={
        "model": TINY, "prompt": "hi", "context": context, "stream": False})
    check_answer("/api/generate", r)
    assert r.status_code in (200, 400), r.text


@pytest.mark.parametrize("keep_alive", ["1" * 400 + "h", "9999999999999h", 1e308, -1e308, "-", "5", "1h1", 1e300])
def test_absurd_keep_alive(daemon: Daemon, keep_alive: Any) -> None:
    """Whatever it sets, the expiry is one /api/ps can show (one past year 9999 made it a 500)."""
    r = httpx.post(daemon.url + "/api/generate", timeout=T, json={
        "model": TINY, "prompt": "hi", "stream": False, "keep_alive": keep_alive, "options": {"num_predict": 2}})
    check_answer("/api/generate", r)
    assert httpx.get(daemon.url + "/api/ps", timeout=T).status_code == 200


@pytest.mark.parametrize("path", ["/api/generate", "/v1/completions"])
def test_a_lone_surrogate_is_replaced_as_go_does(daemon: Daemon, path: str) -> None:
    """A JavaScript client that cuts a string inside an emoji sends an unpaired surrogate escape:
    Go's decoder takes it as U+FFFD, so the request is answered, not failed at tokenization."""
    r = post_raw(daemon, path, b'{"model": "tiny:test", "prompt": "x\\ud83d", "stream": false, '
                               b'"options": {"num_predict": 2}, "max_tokens": 2}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("template", "error"), [
    ("{{ .Prompt ", "template: :1: unclosed action"),
    ("{{ " + "(" * 2000 + ".Prompt" + ")" * 2000 + " }}", "template: :1: max expression depth exceeded")])
def test_a_template_that_does_not_parse_is_ollamas_500_without_a_trace(daemon: Daemon, template: str,
                                                                        error: str) -> None:
    """Ollama answers a request's template that does not parse with a 500 (server/routes.go,
    GenerateHandler). Nothing of the daemon failed, so the log says what did in one warning;
    the fixture's teardown finds no trace. Parentheses nest deeper in Go (10,000) than here."""
    r = httpx.post(daemon.url + "/api/generate", timeout=T, json={
        "model": TINY, "prompt": "hi", "stream": False, "template": template})
    assert r.status_code == 500 and r.json() == {"error": error}  # Go's own words
    assert not daemon.traces(), daemon.traces()


def test_still_serves_after_hand_picked_input(daemon: Daemon) -> None:
    still_serves(daemon)


# -- property-based: random bodies on every route -----------------------------------------------------
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.text(max_size=8), kids, max_size=4), max_leaves=12)
option_names = st.sampled_from(["num_ctx", "num_predict", "top_k", "top_p", "min_p", "temperature", "seed", "stop",
                                "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty",
                                "draft_num_predict", "num_batch", "typical_p", "bogus"])
options = st.dictionaries(option_names, json_value, max_size=5).map(
    # Usually a short generation (the property is about answers, not about waiting for 2k tokens).
    lambda o: o if "num_predict" in o else {**o, "num_predict": 8})
model = st.sampled_from([TINY, "TINY:TEST", "tiny", "other:model", ""]) | json_value
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]) | json_value},
                                optional={"content": st.text(max_size=40) | json_value, "images": json_value})
field_values = {
    "model": model, "prompt": st.text(max_size=40) | json_value, "system": json_value, "template": json_value,
    "raw": json_value, "context": st.lists(st.integers(-5, 2000), max_size=5) | json_value, "stream": json_value,
    "keep_alive": st.sampled_from(["5m", "0", "-1", 0, "1h"]) | json_value, "format": json_value,
    "messages": st.lists(message, max_size=3) | json_value, "options": options | json_value, "think": json_value,
    "max_tokens": st.integers(-3, 16) | json_value, "temperature": json_value, "stop": json_value,
    "verbose": json_value, "name": model, "input": json_value, "tools": json_value, "suffix": json_value,
    "truncate": json_value, "shift": json_value, "logprobs": json_value,
    "top_logprobs": st.integers(-3, 40) | json_value, "reasoning_effort": json_value,
}
body = st.fixed_dictionaries({}, optional=field_values).map(
    lambda b: b if "max_tokens" in b else {**b, "max_tokens": 8})
paths = st.sampled_from(["/api/generate", "/api/chat", "/api/show", "/api/embed", "/api/nothing",
                         "/v1/chat/completions", "/v1/completions"])


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(path=paths, payload=body)
def test_random_bodies_get_well_formed_answers(daemon: Daemon, path: str, payload: dict[str, Any]) -> None:
    r = httpx.post(daemon.url + path, json=payload, timeout=T)
    check_answer(path, r)
    if r.status_code == 200 and path in ("/api/generate", "/api/chat") and r.headers["content-type"].startswith(
            "application/x-ndjson"):
        final = json.loads(r.text.splitlines()[-1])
        assert final.get("done") is True or "error" in final


def test_still_serves_after_random_input(daemon: Daemon) -> None:
    still_serves(daemon)
    assert math.isfinite(httpx.get(daemon.url + "/api/ps", timeout=T).json()["models"][0]["size"])
