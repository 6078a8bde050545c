"""GET /metrics: the observe_* calls show up under the documented names, per app registry."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from sidecar.engine.decoder import Result
from sidecar.observability import metrics
from tests.conftest import Daemon

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
    cached_tokens: int = 0

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
               draft_rounds=4, accepted_per_pos=[4, 3, 1], drafter="ngram")
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
                               result(fallback="slower than target-only: 41.0 vs 52.3 tok/s at acceptance 0.20"))
    metrics.observe_generation(app, "plain:test", result(draft_tokens=0, draft_accepted_tokens=0, draft_rounds=0,
                                                         accepted_per_pos=[], fallback="short output: 3 < 8"))
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
    assert s['sidecar_spec_decode_fallbacks_total{model="tiny:test",reason="slower_than_target_only"}'] == 1
    assert s['sidecar_spec_decode_fallbacks_total{model="plain:test",reason="short_output"}'] == 1
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

    shared = FakeServed(busy=2, steps=10, rows=35, cached_tokens=900)  # two pairs riding on one target
    rt.pending = 3
    rt.loaded = [(FakeEntry("a:1"), shared), (FakeEntry("b:1"), shared), (FakeEntry("c:1"), FakeServed())]
    metrics.observe_model_load(app, "a:1", 2.0)
    for hook in rt.on_load:  # what the runtime calls when it loads a pair
        hook("c:1", 0.5, False)
    metrics.observe_config_reload(app, ok=True)
    metrics.observe_config_reload(app, ok=False)
    metrics.observe_upstream_error(app, "connect")
    metrics.observe_upstream_error(app, "connect")
    s = await scrape(client)
    assert s["sidecar_queue_depth"] == 3
    assert s["sidecar_models_loaded"] == 2
    assert s['sidecar_model_loaded{model="b:1"}'] == 1
    assert s['sidecar_batch_sequences{model="a:1"}'] == 2
    assert s['sidecar_batch_rows_per_step{model="b:1"}'] == 3.5
    assert s['sidecar_prefix_cache_tokens{model="a:1"}'] == 900
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
