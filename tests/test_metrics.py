"""GET /metrics: the observe_* calls show up under the documented names, per app registry."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from sidecar.engine.decoder import Result
from sidecar.observability import metrics
from tests.conftest import Daemon, write_config
from tests.models import write_tiny_llama
from tests.test_service import log_records

pytestmark = pytest.mark.daemon

Factory = Callable[..., Awaitable[TestClient]]


@dataclass
class FakeEntry:
    name: str


@dataclass
class FakeServed:
    """A loaded target as the collector reads it: its status."""

    busy: int = 0
    steps: int = 0
    rows: int = 0
    tokens: int = 0
    cached_tokens: int = 0
    host_cache_bytes: int = 0
    withdrawn: int = 0
    together: int = 0
    waiting_interactive: int = 0
    waiting_background: int = 0
    step_seconds: tuple[tuple[float, ...], tuple[int, ...], float] | None = None
    host_seconds: tuple[tuple[float, ...], tuple[int, ...], float] | None = None

    def status(self) -> FakeServed:
        return self


@dataclass
class FakeRuntime:
    """What the scrape-time collector reads from sidecar.runtime.manager.Runtime."""

    pending: int = 0
    loaded: list[tuple[FakeEntry, FakeServed]] = field(default_factory=list)
    on_load: list[Callable[[str, float, bool], None]] = field(default_factory=list)

    def loaded_entries(self) -> list[tuple[FakeEntry, FakeServed]]:
        return self.loaded

    def status(self) -> list[FakeServed]:
        return list({id(served): served for _, served in self.loaded}.values())


def make_app(runtime: FakeRuntime | None = None) -> web.Application:
    app = web.Application()
    metrics.setup(app, runtime)

    async def chat(request: web.Request) -> web.Response:
        metrics.observe_request(request, "/api/chat", "tiny:test", 200)
        return web.Response(text="{}")

    app.router.add_post("/api/chat", chat)
    return app


async def scrape(client: TestClient, accept: str = "") -> dict[str, float]:
    r = await client.get("/metrics", headers={"Accept": accept} if accept else {})
    assert r.status == 200
    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples: dict[str, float] = {}
    for fam in text_string_to_metric_families(await r.text()):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def result(**kw: Any) -> Result:
    r = Result(tokens=list(range(10)), prompt_tokens=7, draft_tokens=12, draft_accepted_tokens=8,
               draft_rounds=4, accepted_per_pos=[4, 3, 1], drafter="ngram", eval_seconds=0.5, saved_seconds=0.25)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


async def test_requests_and_generation(aiohttp_client: Factory) -> None:
    client = await aiohttp_client(make_app())
    app = client.app
    for _ in range(2):
        assert (await client.post("/api/chat", data=b"{}")).status == 200
    metrics.observe_request(app, "/api/chat", None, 404)
    clock = metrics.TokenClock(start=100.0)
    for t in (100.25, 100.26, 100.30):
        clock.mark(t)
    assert clock.ttft == pytest.approx(0.25)
    assert clock.itl == pytest.approx([0.01, 0.04])
    metrics.observe_generation(app, "tiny:test", result(), ttft=clock.ttft, itl=clock.itl, e2e=0.5)
    metrics.observe_generation(app, "tiny:test",
                               result(fallback="draft does not pay: acceptance 0.20"))
    metrics.observe_generation(app, "plain:test", result(draft_tokens=0, draft_accepted_tokens=0, draft_rounds=0,
                                                         accepted_per_pos=[], fallback="short output: 3 < 8",
                                                         saved_seconds=-0.75))
    metrics.observe_client_disconnect(app, "/api/chat", "tiny:test")
    s = await scrape(client)

    assert s['sidecar_requests_total{endpoint="/api/chat",model="tiny:test",status="200"}'] == 2
    assert s['sidecar_requests_total{endpoint="/api/chat",model="",status="404"}'] == 1
    assert s['sidecar_generation_tokens_total{model="tiny:test"}'] == 20
    assert s['sidecar_prompt_tokens_total{model="tiny:test"}'] == 14
    assert s['sidecar_spec_decode_num_drafts_total{model="tiny:test"}'] == 8
    assert s['sidecar_spec_decode_num_draft_tokens_total{model="tiny:test"}'] == 24
    assert s['sidecar_spec_decode_num_accepted_tokens_total{model="tiny:test"}'] == 16
    assert s['sidecar_spec_decode_num_accepted_tokens_per_pos_total{model="tiny:test",position="0"}'] == 8
    assert s['sidecar_spec_decode_num_accepted_tokens_per_pos_total{model="tiny:test",position="2"}'] == 2
    assert s['sidecar_spec_decode_fallbacks_total{model="tiny:test",reason="draft_does_not_pay"}'] == 1
    assert s['sidecar_spec_decode_fallbacks_total{model="plain:test",reason="short_output"}'] == 1
    # The speed-up's two sides: 2 x 0.5 s decoded that had taken 2 x 0.75 s stepping plain; a loss
    # larger than the decode time adds nothing (a counter never falls).
    assert s['sidecar_decode_seconds_total{model="tiny:test"}'] == pytest.approx(1.0)
    assert s['sidecar_spec_decode_target_only_seconds_total{model="tiny:test"}'] == pytest.approx(1.5)
    assert s['sidecar_spec_decode_target_only_seconds_total{model="plain:test"}'] == 0
    assert 'sidecar_spec_decode_num_drafts_total{model="plain:test"}' not in s
    assert s['sidecar_time_to_first_token_seconds_count{model="tiny:test"}'] == 1
    assert s['sidecar_time_to_first_token_seconds_bucket{le="0.25",model="tiny:test"}'] == 1
    assert s['sidecar_time_to_first_token_seconds_bucket{le="0.1",model="tiny:test"}'] == 0
    assert s['sidecar_inter_token_latency_seconds_count{model="tiny:test"}'] == 2
    assert s['sidecar_inter_token_latency_seconds_sum{model="tiny:test"}'] == pytest.approx(0.05)
    assert s['sidecar_e2e_request_latency_seconds_count{model="tiny:test"}'] == 1
    assert s['sidecar_client_disconnects_total{endpoint="/api/chat",model="tiny:test"}'] == 1


async def test_models_config_upstream(aiohttp_client: Factory) -> None:
    rt = FakeRuntime()
    client = await aiohttp_client(make_app(rt))
    app = client.app
    s = await scrape(client)
    assert s["sidecar_queue_depth"] == 0
    assert s["sidecar_models_loaded"] == 0
    assert s["sidecar_config_last_reload_successful"] == 1
    assert s['sidecar_config_reloads_total{result="failure"}'] == 0

    # Two pairs riding on one target.
    shared = FakeServed(busy=2, steps=10, rows=35, tokens=40, cached_tokens=900, host_cache_bytes=2**20, withdrawn=4,
                        together=6, waiting_interactive=1, waiting_background=2)
    rt.pending = 3  # the two running on it, and one waiting
    rt.loaded = [(FakeEntry("a:1"), shared), (FakeEntry("b:1"), shared), (FakeEntry("c:1"), FakeServed())]
    metrics.observe_model_load(app, "a:1", 2.0)
    for hook in rt.on_load:  # what the runtime calls when it loads a pair
        hook("c:1", 0.5, False)
    metrics.observe_config_reload(app, ok=True)
    metrics.observe_config_reload(app, ok=False)
    metrics.observe_upstream_error(app, "connect")
    metrics.observe_upstream_error(app, "connect")
    s = await scrape(client)
    assert s["sidecar_queue_depth"] == 1
    assert s["sidecar_models_loaded"] == 2
    assert s['sidecar_model_loaded{model="b:1"}'] == 1
    assert s['sidecar_batch_sequences{model="a:1"}'] == 2
    assert s['sidecar_batch_rows_per_step{model="b:1"}'] == 3.5
    assert (s['sidecar_batch_rows_total{model="a:1"}'], s['sidecar_batch_steps_total{model="a:1"}']) == (35, 10)
    assert s['sidecar_batch_tokens_total{model="b:1"}'] == 40
    assert s['sidecar_prefix_cache_tokens{model="a:1"}'] == 900
    assert s['sidecar_host_cache_bytes{model="a:1"}'] == 2**20
    assert s['sidecar_batch_withdrawn_drafts{model="b:1"}'] == 4
    assert s['sidecar_batch_joint_drafts{model="b:1"}'] == 6
    assert s['sidecar_batch_waiting{class="interactive",model="a:1"}'] == 1
    assert s['sidecar_batch_waiting{class="background",model="b:1"}'] == 2
    assert s['sidecar_batch_rows_per_step{model="c:1"}'] == 0
    assert s['sidecar_model_load_seconds_count{model="a:1"}'] == 1
    assert s['sidecar_model_load_seconds_sum{model="a:1"}'] == 2.0
    assert s['sidecar_model_load_failures_total{model="c:1"}'] == 1
    assert s['sidecar_config_reloads_total{result="success"}'] == 1
    assert s['sidecar_config_reloads_total{result="failure"}'] == 1
    assert s["sidecar_config_last_reload_successful"] == 0
    assert s['sidecar_upstream_errors_total{kind="connect"}'] == 2
    assert "process_cpu_seconds_total" in s  # the standard process collector is kept


async def test_registries_are_per_app(aiohttp_client: Factory) -> None:
    a = await aiohttp_client(make_app())
    b = await aiohttp_client(make_app())
    await a.post("/api/chat", data=b"{}")
    assert 'sidecar_requests_total{endpoint="/api/chat",model="tiny:test",status="200"}' in await scrape(a)
    assert not any(k.startswith("sidecar_requests_total{") for k in await scrape(b))
    assert REGISTRY.get_sample_value("sidecar_queue_depth") is None  # nothing leaks into the global one


async def test_openmetrics_on_request(aiohttp_client: Factory) -> None:
    client = await aiohttp_client(make_app())
    r = await client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["Content-Type"].startswith("application/openmetrics-text")
    assert (await r.text()).rstrip().endswith("# EOF")


def test_without_setup_every_call_is_a_no_op() -> None:
    app = web.Application()
    metrics.observe_request(app, "/api/chat", "x", 200)
    metrics.observe_generation(app, "x", result())
    metrics.observe_model_load(None, "x", 1.0)
    assert metrics.of(app) is None


def test_label_values_are_bounded() -> None:
    m = metrics.Metrics()
    for i in range(metrics.MAX_LABEL_VALUES + 10):
        m.request("/api/chat", f"random-{i}", 404)
    value = m.registry.get_sample_value(
        "sidecar_requests_total", {"endpoint": "/api/chat", "model": metrics.OTHER, "status": "404"})
    assert value == 10


def test_fallback_kind() -> None:
    assert metrics.fallback_kind("draft does not pay: acceptance 0.12") == "draft_does_not_pay"
    assert metrics.fallback_kind("verification too costly on this hardware") == (
        "verification_too_costly_on_this_hardware")
    assert metrics.fallback_kind(":") == "unknown"


async def test_middleware_counts_every_request(aiohttp_client: Factory) -> None:
    app = web.Application(middlewares=[metrics.middleware])
    metrics.setup(app)

    async def show(request: web.Request) -> web.Response:
        metrics.set_model(request, "tiny:test")
        raise web.HTTPBadRequest()

    async def tags(_: web.Request) -> web.Response:
        return web.Response(text="{}")

    app.router.add_post("/api/show", show)
    app.router.add_get("/api/tags", tags)
    client = await aiohttp_client(app)
    await client.get("/api/tags")
    await client.post("/api/show")
    await client.get("/no/such/path/12345")
    s = await scrape(client)
    assert s['sidecar_requests_total{endpoint="/api/tags",model="",status="200"}'] == 1
    assert s['sidecar_requests_total{endpoint="/api/show",model="tiny:test",status="400"}'] == 1
    assert s['sidecar_requests_total{endpoint="unmatched",model="",status="404"}'] == 1


def test_daemon_serves_metrics(daemon: Daemon) -> None:
    """The real app: /metrics is wired, counts requests, and reads the real Runtime at scrape time."""
    r = httpx.post(daemon.url + "/api/generate", timeout=120, json={
        "model": "tiny:test", "prompt": "hi", "stream": False, "options": {"num_predict": 4}})
    assert r.status_code == 200, r.text
    r = httpx.get(daemon.url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    s = {f"{x.name}{sorted(x.labels.items())}": x.value
         for fam in text_string_to_metric_families(r.text) for x in fam.samples}
    generated = [v for k, v in s.items() if k.startswith("sidecar_requests_total")
                 and "('endpoint', '/api/generate')" in k and "('status', '200')" in k]
    assert generated == [1.0], s
    assert s["sidecar_queue_depth[]"] == 0
    assert s["sidecar_models_loaded[]"] >= 1
    assert s["sidecar_model_loaded[('model', 'tiny:test')]"] == 1
    # The Host check is on for the loopback listener, /metrics included.
    assert httpx.get(daemon.url + "/metrics", headers={"Host": "evil.example"}, timeout=10).status_code == 403


# -- the real daemon, driven by clients --------------------------------------------------------------
T = 120
X = TypeVar("X")


@pytest.fixture(scope="module")
def slow_daemon(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, tiny: Path) -> Iterator[Daemon]:
    """The tiny model, and one slow enough that a stream lasts many seconds, with never an end of
    its own and one sequence: a second request waits for the first."""
    slow = model_dir / "endless-wide.gguf"
    if not slow.exists():
        write_tiny_llama(slow, seed=1, end_bias=0.0, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024, n_layer=8)
    cfg = write_config(tmp_path_factory.mktemp("metrics") / "pairs.yaml", f"""
pairs:
  tiny:test:
    from: {tiny}
    parameters: {{temperature: 0, num_ctx: 256, num_predict: 4}}
    runtime: {{num_thread: 1}}
  slow:one:
    from: {slow}
    parameters: {{temperature: 0, num_ctx: 1024}}
    runtime: {{num_thread: 1, num_parallel: 1}}
""")
    d = Daemon(cfg)
    # Loaded up front: the tests below time their requests against a generation, not a load.
    r = httpx.post(d.url + "/api/generate", json={"model": "slow:one", "prompt": "a", "stream": False,
                                                  "options": {"num_predict": 1}}, timeout=T)
    assert r.status_code == 200, r.text
    yield d
    d.stop()


def samples(d: Daemon) -> dict[str, float]:
    r = httpx.get(d.url + "/metrics", timeout=T)
    assert r.status_code == 200
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for x in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(x.labels.items()))
            out[f"{x.name}{{{labels}}}" if labels else x.name] = x.value
    return out


def until(fetch: Callable[[], X], check: Callable[[X], bool], what: str, timeout: float = 30) -> X:
    """fetch() until check() holds for what it got."""
    deadline = time.monotonic() + timeout
    while not check(got := fetch()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


def test_refused_requests_carry_the_model_their_body_names(slow_daemon: Daemon) -> None:
    """A body refused before its pair was looked up still names it: the 400 is labelled with the
    pair. Names that are no pair, and bodies that name nothing, stay unlabelled."""
    url = slow_daemon.url
    assert httpx.post(url + "/api/generate", json={"model": "tiny:test", "prompt": "x", "options": "hot"},
                      timeout=T).status_code == 400
    assert httpx.post(url + "/api/chat", json={"model": "TINY:test", "messages": "hi"}, timeout=T).status_code == 400
    assert httpx.post(url + "/api/embed", json={"model": "tiny:test", "input": "x"}, timeout=T).status_code == 400
    assert httpx.post(url + "/api/generate", json={"model": "nope:x", "prompt": "x", "options": "hot"},
                      timeout=T).status_code == 400
    assert httpx.post(url + "/api/generate", content=b"{not json", timeout=T).status_code == 400
    s = samples(slow_daemon)
    assert s['sidecar_requests_total{endpoint="/api/generate",model="tiny:test",status="400"}'] == 1
    assert s['sidecar_requests_total{endpoint="/api/chat",model="tiny:test",status="400"}'] == 1
    assert s['sidecar_requests_total{endpoint="/api/embed",model="tiny:test",status="400"}'] == 1
    assert s['sidecar_requests_total{endpoint="/api/generate",model="",status="400"}'] == 2
    assert not any('model="nope:x"' in k for k in s)


def test_queue_depth_counts_only_the_waiting(slow_daemon: Daemon) -> None:
    depth = "sidecar_queue_depth"
    running = 'sidecar_batch_sequences{model="slow:one"}'
    second: dict[str, Any] = {}

    def queued() -> None:
        r = httpx.post(slow_daemon.url + "/api/generate", timeout=T, json={
            "model": "slow:one", "prompt": "b", "stream": False, "options": {"num_predict": 2}})
        second["status"] = r.status_code

    body = {"model": "slow:one", "prompt": "a", "options": {"num_predict": -1}}
    with httpx.stream("POST", slow_daemon.url + "/api/generate", json=body, timeout=T) as first:
        lines = first.iter_lines()  # kept: an iterator dropped closes the stream
        next(lines)  # generating: it holds the pair's one sequence
        s = samples(slow_daemon)
        assert (s[running], s[depth]) == (1, 0)
        t = threading.Thread(target=queued)
        t.start()
        s = until(lambda: samples(slow_daemon), lambda s: s[depth] > 0, "the second request to queue")
        assert (s[running], s[depth]) == (1, 1)
    t.join(T)  # closing the first stream let the second run
    assert second["status"] == 200
    until(lambda: samples(slow_daemon), lambda s: s[depth] == 0, "an empty queue")


@pytest.mark.parametrize("stream", [True, False])
def test_an_aborted_generation_counts_its_tokens(slow_daemon: Daemon, stream: bool) -> None:
    """A client that leaves mid-generation (closing a stream, or timing out on a whole answer):
    what was generated until the engine stopped counts, and the summary line says as much."""
    tokens = 'sidecar_generation_tokens_total{model="slow:one"}'
    before = samples(slow_daemon).get(tokens, 0)
    rid = uuid.uuid4().hex
    body = {"model": "slow:one", "prompt": "a", "stream": stream, "options": {"num_predict": -1}}
    received = 0
    if stream:
        with httpx.stream("POST", slow_daemon.url + "/api/generate", json=body, timeout=T,
                          headers={"X-Request-Id": rid}) as r:
            for _ in zip(range(20), r.iter_lines(), strict=False):
                received += 1
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up on a generation that does not end
            httpx.post(slow_daemon.url + "/api/generate", json=body, headers={"X-Request-Id": rid},
                       timeout=httpx.Timeout(T, read=1.5))

    def summaries() -> list[dict[str, Any]]:
        return [rec for rec in log_records(slow_daemon) if rec.get("request_id") == rid and rec["event"] == "request"]

    [line] = until(summaries, bool, "the aborted request's summary line")
    counted = samples(slow_daemon)[tokens] - before
    assert line["status"] == "aborted" and line["done_reason"] == "cancel", line
    assert line["tokens"] == counted >= max(received, 1)
    assert counted < 10 * 1024  # stopped, not run to its length limit
