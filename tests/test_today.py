"""Today's Ollama for pairs, through the daemon: fill-in-the-middle, logprobs, /api/show, what a
client that gives up gets, and the accounting every request leaves behind."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest

import sidecar
from tests import openapi
from tests.conftest import SMOLLM2_REF, Daemon, write_config
from tests.models import write_tiny_llama

pytestmark = pytest.mark.daemon

T = 120
FIM = "{{- if .Suffix }}<PRE> {{ .Prompt }} <SUF>{{ .Suffix }} <MID>{{ else }}{{ .Prompt }}{{ end }}"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("today")
    endless = write_tiny_llama(d / "endless.gguf", seed=1, end_bias=0.0)
    cfg = write_config(d / "pairs.yaml", f"""
pairs:
  coder:fim:
    from: {endless}
    template: {json.dumps(FIM)}
    parameters: {{temperature: 0, num_ctx: 256, num_predict: 8}}
    runtime: {{num_thread: 1}}
  endless:test:
    from: {endless}
    parameters: {{temperature: 0, num_ctx: 2048}}
    runtime: {{num_thread: 1}}
  smollm2:135m:
    from: {SMOLLM2_REF}
    draft: ngram
    parameters: {{temperature: 0, num_ctx: 1024}}
    speculative: {{adaptive: false}}  # always draft: the test is about the numbers drafts produce
    runtime: {{num_gpu: 0}}
""")
    daemon = Daemon(cfg)
    yield daemon
    daemon.stop()


def post(d: Daemon, path: str, **body: object) -> httpx.Response:
    return httpx.post(d.url + path, timeout=T, json=body)


# -- fill in the middle ---------------------------------------------------------------------------
def test_suffix_renders_prompt_and_suffix(daemon: Daemon) -> None:
    """server/routes_generate_test.go: `<PRE> def add( <SUF>    return c <MID>`."""
    r = post(daemon, "/api/generate", model="coder:fim", prompt="def add(", suffix="    return c",
             _debug_render_only=True)
    assert r.json()["_debug_info"]["rendered_template"] == "<PRE> def add( <SUF>    return c <MID>"
    r = post(daemon, "/api/generate", model="coder:fim", prompt="def add(", suffix="    return c", stream=False)
    assert r.status_code == 200 and r.json()["eval_count"] == 8
    assert "insert" in ollama.Client(host=daemon.url).show("coder:fim").capabilities


def test_suffix_without_the_insert_capability(daemon: Daemon) -> None:
    r = post(daemon, "/api/generate", model="endless:test", prompt="def add(", suffix="x")
    assert r.status_code == 400
    assert r.json() == {"error": "registry.ollama.ai/library/endless:test does not support insert"}
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x")
    with pytest.raises(openai.BadRequestError, match="does not support insert"):
        client.completions.create(model="endless:test", prompt="def add(", suffix="x")
    ok = client.completions.create(model="coder:fim", prompt="def add(", suffix="    return c", max_tokens=4)
    assert ok.choices[0].text


# -- logprobs -------------------------------------------------------------------------------------
def test_logprobs_in_ollamas_shape(daemon: Daemon) -> None:
    body = post(daemon, "/api/generate", model="endless:test", prompt="hi", stream=False, logprobs=True,
                top_logprobs=3, options={"num_predict": 12}).json()
    openapi.check(openapi.GENERATE_RESPONSE, body)
    lps = body["logprobs"]
    assert len(lps) == body["eval_count"] == 12
    assert "".join(lp["token"] for lp in lps) == body["response"]
    for lp in lps:
        assert len(lp["top_logprobs"]) == 3 and lp["logprob"] <= 0
        assert lp["top_logprobs"][0]["token"] == lp["token"]  # greedy: the emitted token is the likeliest
    with httpx.stream("POST", daemon.url + "/api/generate", timeout=T, json={
            "model": "endless:test", "prompt": "hi", "logprobs": True, "top_logprobs": 3,
            "options": {"num_predict": 12}}) as s:
        chunks = [json.loads(line) for line in s.iter_lines()]
    assert [lp for c in chunks for lp in c.get("logprobs", [])] == lps  # streamed deltas concatenate to it
    bare = post(daemon, "/api/chat", model="endless:test", messages=[{"role": "user", "content": "hi"}],
                stream=False, logprobs=True, options={"num_predict": 4}).json()
    openapi.check(openapi.CHAT_RESPONSE, bare)
    assert len(bare["logprobs"]) == 4 and all("top_logprobs" not in lp for lp in bare["logprobs"])
    assert "logprobs" not in post(daemon, "/api/generate", model="endless:test", prompt="hi", stream=False,
                                  options={"num_predict": 4}).json()


@pytest.mark.parametrize("top", [21, -1])
def test_top_logprobs_out_of_range(daemon: Daemon, top: int) -> None:
    r = post(daemon, "/api/generate", model="endless:test", prompt="hi", logprobs=True, top_logprobs=top)
    assert r.status_code == 400 and r.json() == {"error": "top_logprobs must be between 0 and 20"}


def test_logprobs_under_speculation_are_the_targets(daemon: Daemon) -> None:
    """From the verify rows: the same numbers as target-only decoding (CPU build), with drafts accepted."""
    text = "Copy this line exactly: the quick brown fox jumps over the lazy dog. " * 3
    body = {"model": "smollm2:135m", "prompt": text, "raw": True, "stream": False, "logprobs": True,
            "top_logprobs": 2}
    plain = post(daemon, "/api/generate", **body, options={"num_predict": 48, "draft_num_predict": 0}).json()
    spec = post(daemon, "/api/generate", **body, options={"num_predict": 48}).json()
    assert spec["draft_accepted_tokens"] > 0
    assert spec["response"] == plain["response"] and spec["logprobs"] == plain["logprobs"]


def test_openai_logprobs(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x")
    r = client.chat.completions.create(model="endless:test", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, logprobs=True, top_logprobs=2, temperature=0)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content
    chunks = list(client.chat.completions.create(model="endless:test", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, logprobs=True, stream=True, temperature=0))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]


# -- /api/show, /api/version ----------------------------------------------------------------------
def test_show_returns_the_go_template_and_full_arrays_when_verbose(daemon: Daemon) -> None:
    client = ollama.Client(host=daemon.url)
    assert client.show("coder:fim").template == FIM
    # Served with the GGUF's jinja; shown as the Go template `ollama create` detects for it.
    chatml = (Path(sidecar.__file__).parent / "templates" / "gotmpl" / "chatml.gotmpl").read_text()
    assert client.show("smollm2:135m").template == chatml
    short = post(daemon, "/api/show", model="smollm2:135m").json()["model_info"]
    full = post(daemon, "/api/show", model="smollm2:135m", verbose=True).json()["model_info"]
    for info in (short, full):
        assert "tokenizer.chat_template" not in info and "general.name" not in info
    assert short["tokenizer.ggml.tokens"] == []
    assert len(full["tokenizer.ggml.tokens"]) == 49152 and full["tokenizer.ggml.tokens"][:2] == ["<|endoftext|>",
                                                                                               "<|im_start|>"]
    assert len(full["tokenizer.ggml.token_type"]) == 49152 and len(full["tokenizer.ggml.merges"]) > 0
    r = post(daemon, "/api/show", model="smollm2:135m", verbose="yes")
    assert r.status_code == 400 and "ShowRequest.verbose of type bool" in r.json()["error"]


def test_version_is_a_current_ollama(daemon: Daemon) -> None:
    major, minor, _ = (int(x) for x in httpx.get(daemon.url + "/api/version").json()["version"].split("."))
    assert (major, minor) >= (0, 13)


# -- clients that go away -------------------------------------------------------------------------
def _abandon(daemon: Daemon, body: dict[str, object], after: float) -> None:
    """Send a request and close the connection `after` seconds later, before any answer."""
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(daemon.url + "/api/generate", timeout=after, json=body)


def aborted_lines(daemon: Daemon, want: int, seconds: float = 30.0) -> int:
    """The "aborted" summary lines once there are `want` (or the deadline passes): an aborted
    request's line is written once its generation's cancel Outcome is in, a step or so later."""
    deadline = time.monotonic() + seconds
    while (n := daemon.log().count('"status": "aborted"')) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def test_a_non_streaming_request_stops_when_its_client_goes(daemon: Daemon) -> None:
    warm = post(daemon, "/api/generate", model="endless:test", prompt="hi", stream=False,
                options={"num_predict": 64, "draft_num_predict": 0}).json()
    per_token = warm["eval_duration"] / warm["eval_count"] / 1e9
    n = 10 * 2048  # Ollama bounds open-ended output at ten windows; shifts keep this model going that long
    body = {"model": "endless:test", "prompt": "go on", "stream": False, "options": {"num_predict": -1}}
    _abandon(daemon, body, after=1.0)
    t0 = time.monotonic()
    r = post(daemon, "/api/generate", model="endless:test", prompt="hi", stream=False, options={"num_predict": 4})
    assert r.status_code == 200
    assert time.monotonic() - t0 < 0.25 * n * per_token  # the abandoned one did not run on
    assert aborted_lines(daemon, 1) >= 1 and '"path": "/api/generate"' in daemon.log()


def test_a_queued_request_whose_client_went_never_runs(daemon: Daemon) -> None:
    """Behind a long request, a second one waits in the model's queue; both clients give up."""
    before = daemon.log().count('"status": "aborted"')
    long = {"model": "endless:test", "prompt": "first", "stream": False, "options": {"num_predict": -1}}
    first = threading.Thread(target=_abandon, args=(daemon, long, 1.5))
    first.start()
    time.sleep(0.3)
    _abandon(daemon, {**long, "prompt": "second"}, after=0.6)
    first.join(T)
    t0 = time.monotonic()
    assert post(daemon, "/api/generate", model="endless:test", prompt="hi", stream=False,
                options={"num_predict": 4}).status_code == 200
    assert time.monotonic() - t0 < 2  # neither abandoned request ran on (20,480 tokens each)
    assert aborted_lines(daemon, before + 2) == before + 2
    time.sleep(0.5)
    assert aborted_lines(daemon, before + 2) == before + 2  # and no third
    metrics = httpx.get(daemon.url + "/metrics").text
    assert 'sidecar_client_disconnects_total{endpoint="/api/generate",model="endless:test"}' in metrics


def test_a_stop_while_a_request_runs_unloads_once_it_is_done(daemon: Daemon) -> None:
    """`ollama stop` (keep_alive 0, no prompt) while a request streams: Ollama keeps the model
    loaded, and in /api/ps with its expiry now, until its requests end (server/sched.go,
    expireRunner), and the running request does not push the expiry out again."""
    client = ollama.Client(host=daemon.url)
    body = {"model": "endless:test", "prompt": "go on", "keep_alive": -1, "options": {"num_predict": 1_000_000}}
    with httpx.stream("POST", daemon.url + "/api/generate", json=body, timeout=T) as running:
        lines = running.iter_lines()  # kept: a dropped iterator closes the response
        assert json.loads(next(lines))["done"] is False
        assert client.generate(model="endless:test", prompt="", keep_alive=0).done_reason == "unload"
        listed = {m.model: m for m in client.ps().models}
        assert "endless:test" in listed and listed["endless:test"].expires_at is not None
        assert listed["endless:test"].expires_at.timestamp() <= time.time() + 1
    deadline = time.monotonic() + 30  # the client left: its request stops within a step, then the model goes
    while "endless:test" in [m.model for m in client.ps().models]:
        assert time.monotonic() < deadline, "the stopped model stayed loaded after its request"
        time.sleep(0.1)


def test_keep_alive_stays_until_a_request_names_another(daemon: Daemon) -> None:
    """The model keeps the last keep_alive a request named (the runner's sessionDuration,
    server/sched.go useLoadedRunner): a request that names none does not bring the default back."""
    client = ollama.Client(host=daemon.url)

    def expires(**keep_alive: object) -> float:
        client.generate(model="endless:test", prompt="x", options={"num_predict": 2}, **keep_alive)  # type: ignore[arg-type]
        listed = {m.model: m for m in client.ps().models}
        return listed["endless:test"].expires_at.timestamp() - time.time()  # type: ignore[union-attr]

    assert expires(keep_alive=-1) > 1e9  # forever: year 2318
    assert expires() > 1e9
    assert 50 < expires(keep_alive="1m") <= 60
    assert 50 < expires() <= 60
    assert client.generate(model="endless:test", prompt="", keep_alive=0).done_reason == "unload"


def test_a_load_while_a_request_runs_moves_the_expiry_when_it_ends(daemon: Daemon) -> None:
    """A load (no prompt) beside a running request sets the keep_alive but not the expiry: Ollama
    moves expiresAt only when the runner's last request ends (server/sched.go, processCompleted)."""
    client = ollama.Client(host=daemon.url)

    def expires() -> float:
        listed = {m.model: m for m in client.ps().models}
        return listed["endless:test"].expires_at.timestamp() - time.time()  # type: ignore[union-attr]

    client.generate(model="endless:test", prompt="x", options={"num_predict": 2}, keep_alive="1m")
    body = {"model": "endless:test", "prompt": "go on", "options": {"num_predict": 1_000_000}}
    with httpx.stream("POST", daemon.url + "/api/generate", json=body, timeout=T) as running:
        lines = running.iter_lines()  # kept: a dropped iterator closes the response
        assert json.loads(next(lines))["done"] is False
        assert client.generate(model="endless:test", prompt="", keep_alive="10m").done_reason == "load"
        assert expires() <= 60
    deadline = time.monotonic() + 30  # the client left: its request stops within a step and the expiry moves
    while expires() <= 60:
        assert time.monotonic() < deadline, "the expiry did not move when the request ended"
        time.sleep(0.1)
    assert 500 < expires() <= 600
    assert client.generate(model="endless:test", prompt="", keep_alive=0).done_reason == "unload"


def test_errors_and_unloads_are_counted_under_the_pairs_name(daemon: Daemon) -> None:
    post(daemon, "/api/generate", model="endless:test", prompt="x", options={"top_k": "many"})
    post(daemon, "/api/generate", model="endless:test", keep_alive=0)
    metrics = httpx.get(daemon.url + "/metrics").text
    assert 'sidecar_requests_total{endpoint="/api/generate",model="endless:test",status="400"}' in metrics
    assert 'sidecar_requests_total{endpoint="/api/generate",model="endless:test",status="200"}' in metrics
