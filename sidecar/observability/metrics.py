"""Prometheus metrics at GET /metrics: requests, latency, tokens, speculation, models, config.

Names follow the conventions people already graph: a `sidecar_` prefix, vLLM's latency names
(`time_to_first_token_seconds`, `inter_token_latency_seconds`) and vLLM's / llama.cpp's
speculative-decoding counters (`spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`), so the usual derived series work:

    acceptance rate          rate(sidecar_spec_decode_num_accepted_tokens_total)
                               / rate(sidecar_spec_decode_num_draft_tokens_total)
    mean acceptance length   1 + rate(..._num_accepted_tokens_total) / rate(..._num_drafts_total)
    per-position acceptance  rate(..._num_accepted_tokens_per_pos_total) / rate(..._num_drafts_total)
    speed-up over plain      rate(sidecar_spec_decode_target_only_seconds_total)
                               / rate(sidecar_decode_seconds_total)
    rows per step (now)      rate(sidecar_batch_rows_total) / rate(sidecar_batch_steps_total)

observability/grafana/sidecar.json graphs these (docs/grafana.md).

Each app gets its own CollectorRegistry (never prometheus_client's global REGISTRY), so tests can
build many apps in one process and a scrape shows exactly one daemon. The API and the runtime
report through the small `observe_*` functions below; each accepts the app, a request or the
Metrics object and does nothing when the app has no metrics, so callers need no `if`.

Label values are bounded (`_Bounded`): model names come from clients, and a scanner sending
random names must not grow the registry without limit.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

PREFIX = "sidecar"

# vLLM's buckets, extended downwards: speculative rounds on a GPU emit tokens milliseconds apart.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0)
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

MAX_LABEL_VALUES = 64  # distinct values per label before new ones are folded into "other"
OTHER = "other"


class GenerationResult(Protocol):
    """The fields of a generation's Outcome (sidecar.runtime.contract) these metrics read."""

    tokens: list[int]
    prompt_tokens: int
    prompt_cached: int
    draft_tokens: int
    draft_accepted_tokens: int
    draft_rounds: int
    accepted_per_pos: list[int]
    drafts_by_source: dict[str, tuple[int, int]]  # source name -> (drafted, accepted)
    fallback: str | None
    eval_seconds: float
    saved_seconds: float  # what drafting saved against plain steps, by the engine's cost model


class _Bounded:
    """Passes label values through until `limit` distinct ones were seen, then answers "other"."""

    def __init__(self, limit: int = MAX_LABEL_VALUES) -> None:
        self.limit = limit
        self.seen: set[str] = set()

    def __call__(self, value: Any) -> str:
        v = "" if value is None else str(value)
        if v in self.seen:
            return v
        if len(self.seen) >= self.limit:
            return OTHER
        self.seen.add(v)
        return v


def fallback_kind(reason: str) -> str:
    """'draft does not pay: acceptance 0.12' -> 'draft_does_not_pay'.

    The engine's fallback strings carry numbers after the colon; only the kind before it is a
    label value, so the series count stays small."""
    head = reason.split(":", 1)[0].strip().lower()
    return re.sub(r"[^a-z0-9]+", "_", head).strip("_") or "unknown"


class RuntimeView(Protocol):
    """What the scrape-time gauges and the load timer read from sidecar.runtime.manager.Runtime."""

    @property
    def pending(self) -> int:
        """Generation requests admitted and not finished: waiting or running."""
        ...

    def status(self) -> Sequence[Any]:
        """A status with `busy` (sequences running in its batch) for every loaded target, each once."""
        ...

    def loaded_entries(self) -> Sequence[tuple[Any, Any]]:
        """(pair entry with a `name`, its loaded target) for every loaded pair."""
        ...

    on_load: list[Callable[[str, float, bool], None]]


class _RuntimeCollector:
    """Gauges read from the runtime at scrape time, so nothing has to keep them in step."""

    def __init__(self, runtime: RuntimeView | None) -> None:
        self.runtime = runtime

    def describe(self) -> Iterable[Metric]:
        return []  # no describe-time collection

    def collect(self) -> Iterator[Metric]:
        rt = self.runtime
        queue = GaugeMetricFamily(
            f"{PREFIX}_queue_depth",
            "Generation requests waiting: admitted, not yet generating (loading, or queued for a sequence); "
            "OLLAMA_MAX_QUEUE caps these and the running ones together.",
        )
        loaded = GaugeMetricFamily(f"{PREFIX}_model_loaded", "1 for each pair whose models are in memory.",
                                   labels=["model"])
        targets = GaugeMetricFamily(f"{PREFIX}_models_loaded", "Target models (weights + context) in memory.")
        busy = GaugeMetricFamily(f"{PREFIX}_batch_sequences", "Sequences running in the pair's target's batch.",
                                 labels=["model"])
        width = GaugeMetricFamily(f"{PREFIX}_batch_rows_per_step",
                                  "Mean rows per batched decode of the pair's target since it loaded.",
                                  labels=["model"])
        cached = GaugeMetricFamily(f"{PREFIX}_prefix_cache_tokens",
                                   "Prompt tokens the pair's target took from its prefix cache since it loaded.",
                                   labels=["model"])
        host_cache = GaugeMetricFamily(f"{PREFIX}_host_cache_bytes", "Host memory the pair's target's kept prompts "
                                       "take (runtime.cache_ram).", labels=["model"])
        withdrawn = GaugeMetricFamily(f"{PREFIX}_batch_withdrawn_drafts",
                                      "Drafts the pair's target's shared steps took back since it loaded: "
                                      "another stream in the step could not afford them.", labels=["model"])
        rows = CounterMetricFamily(f"{PREFIX}_batch_rows", "Rows the pair's target's batched decodes held since it "
                                   "loaded; over sidecar_batch_steps_total, the batch's width.", labels=["model"])
        steps = CounterMetricFamily(f"{PREFIX}_batch_steps", "Batched decodes of the pair's target since it loaded.",
                                    labels=["model"])
        emitted = CounterMetricFamily(f"{PREFIX}_batch_tokens", "Tokens the pair's target's sequences emitted since "
                                      "it loaded, counted step by step (generation_tokens counts a request at its "
                                      "end); a target several pairs share counts for each.", labels=["model"])
        together = GaugeMetricFamily(f"{PREFIX}_batch_joint_drafts",
                                     "Model drafts made in joint rounds of the pair's target's steps since it "
                                     "loaded: sequences that draft together where each alone would not.",
                                     labels=["model"])
        waiting = GaugeMetricFamily(f"{PREFIX}_batch_waiting",
                                    "Requests waiting for a free sequence of the pair's target, by class: "
                                    "interactive (streamed) ones are admitted first.", labels=["model", "class"])
        # The step loop keeps these two histograms itself (engine.hosttime), so a step books no
        # Prometheus call; read here, per pair on the target, as the gauges are.
        step_hist = HistogramMetricFamily(f"{PREFIX}_step_seconds",
                                      "Wall seconds of each step (one batched decode) of the pair's target.",
                                      labels=["model"])
        host_hist = HistogramMetricFamily(f"{PREFIX}_step_host_seconds",
                                     "Seconds of each step of the pair's target spent on the host: all but "
                                     "llama_decode and waiting for its results.", labels=["model"])
        if rt is not None:
            # The runtime counts the running requests among the pending ones: those are the
            # sequences in the targets' batches. (Clamped: a sequence whose client just left
            # may still sit in a batch after its request stopped counting.)
            running = sum(st.busy for st in rt.status())
            queue.add_metric([], float(max(0, rt.pending - running)))
            pairs = rt.loaded_entries()
            for entry, served in pairs:
                loaded.add_metric([entry.name], 1.0)
                st = served.status()
                busy.add_metric([entry.name], float(st.busy))
                width.add_metric([entry.name], st.rows / st.steps if st.steps else 0.0)
                cached.add_metric([entry.name], float(st.cached_tokens))
                host_cache.add_metric([entry.name], float(st.host_cache_bytes))
                withdrawn.add_metric([entry.name], float(st.withdrawn))
                together.add_metric([entry.name], float(st.together))
                rows.add_metric([entry.name], float(st.rows))
                steps.add_metric([entry.name], float(st.steps))
                emitted.add_metric([entry.name], float(st.tokens))
                waiting.add_metric([entry.name, "interactive"], float(st.waiting_interactive))
                waiting.add_metric([entry.name, "background"], float(st.waiting_background))
                for family, hist in ((step_hist, st.step_seconds), (host_hist, st.host_seconds)):
                    if hist is not None:
                        bounds, counts, total = hist
                        buckets = [*((repr(b), c) for b, c in zip(bounds, counts[:-1], strict=True)),
                                   ("+Inf", counts[-1])]
                        family.add_metric([entry.name], buckets, sum_value=total)
            targets.add_metric([], float(len({id(lm) for _, lm in pairs})))
        else:
            queue.add_metric([], 0.0)
            targets.add_metric([], 0.0)
        yield from (queue, loaded, targets, busy, width, cached, host_cache, withdrawn, together, rows, steps, emitted,
                    waiting, step_hist, host_hist)


class Metrics:
    """Every metric of one daemon, in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 runtime: RuntimeView | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self._model = _Bounded()
        self._endpoint = _Bounded()
        self._kind = _Bounded(16)

        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by endpoint, model and status code.",
                                ["endpoint", "model", "status"], registry=r)
        self.client_disconnects = Counter(f"{PREFIX}_client_disconnects",
                                          "Streams the client closed before the final chunk.",
                                          ["endpoint", "model"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Request arrival to the first generated piece, load time included.",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Time between consecutive streamed pieces (speculative rounds arrive in bursts).",
                             ["model"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Request arrival to the final chunk.",
                             ["model"], buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens processed.", ["model"], registry=r)
        self.prompt_cached = Counter(f"{PREFIX}_prompt_cached_tokens",
                                     "Prompt tokens taken from the prefix cache instead of processed.", ["model"],
                                     registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated.", ["model"],
                                         registry=r)
        self.decode_seconds = Counter(f"{PREFIX}_decode_seconds",
                                      "Seconds from the first generated token to the last (Ollama's eval_duration).",
                                      ["model"], registry=r)
        self.target_only_seconds = Counter(f"{PREFIX}_spec_decode_target_only_seconds",
                                           "What the same tokens had taken stepping plain, by the engine's cost "
                                           "model: decode seconds plus what drafting saved. Over "
                                           "sidecar_decode_seconds_total, the realised speed-up.", ["model"],
                                           registry=r)
        self.num_drafts = Counter(f"{PREFIX}_spec_decode_num_drafts", "Speculative rounds that drafted tokens.",
                                  ["model"], registry=r)
        self.num_draft_tokens = Counter(f"{PREFIX}_spec_decode_num_draft_tokens", "Tokens drafted.", ["model"],
                                        registry=r)
        self.num_accepted_tokens = Counter(f"{PREFIX}_spec_decode_num_accepted_tokens",
                                           "Drafted tokens the target accepted.", ["model"], registry=r)
        self.accepted_per_pos = Counter(f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted drafted tokens by position in the draft (0 = first).",
                                        ["model", "position"], registry=r)
        self.source_draft_tokens = Counter(f"{PREFIX}_spec_decode_source_draft_tokens",
                                           "Tokens drafted, by draft source (ngram, suffix, model).",
                                           ["model", "source"], registry=r)
        self.source_accepted_tokens = Counter(f"{PREFIX}_spec_decode_source_accepted_tokens",
                                              "Drafted tokens the target accepted, by draft source.",
                                              ["model", "source"], registry=r)
        self.fallbacks = Counter(f"{PREFIX}_spec_decode_fallbacks",
                                 "Requests in which speculation switched itself off, by reason kind.",
                                 ["model", "reason"], registry=r)
        self.model_load = Histogram(f"{PREFIX}_model_load_seconds", "Time to load a pair's models.", ["model"],
                                    buckets=LOAD_BUCKETS, registry=r)
        self.model_load_failures = Counter(f"{PREFIX}_model_load_failures", "Model loads that failed.", ["model"],
                                           registry=r)
        self.config_reloads = Counter(f"{PREFIX}_config_reloads", "Configuration reloads by result.", ["result"],
                                      registry=r)
        self.config_last_ok = Gauge(f"{PREFIX}_config_last_reload_successful",
                                    "1 if the last configuration (re)load succeeded.", registry=r)
        self.config_last_ok_time = Gauge(f"{PREFIX}_config_last_reload_success_timestamp_seconds",
                                         "When the configuration last loaded successfully.", registry=r)
        self.upstream_errors = Counter(f"{PREFIX}_upstream_errors", "Failures talking to the upstream Ollama.",
                                       ["kind"], registry=r)
        for result in ("success", "failure"):
            self.config_reloads.labels(result)  # both series exist from the start, at 0
        self.config_last_ok.set(1)
        self.config_last_ok_time.set_to_current_time()
        if runtime is not None:
            r.register(_RuntimeCollector(runtime))  # type: ignore[arg-type]

    # -- what callers report ----------------------------------------------------------------
    def request(self, endpoint: str, model: str | None, status: int | str) -> None:
        self.requests.labels(self._endpoint(endpoint), self._model(model), str(status)).inc()

    def client_disconnect(self, endpoint: str, model: str | None) -> None:
        self.client_disconnects.labels(self._endpoint(endpoint), self._model(model)).inc()

    def generation(self, model: str, result: GenerationResult, ttft: float | None = None,
                   itl: Sequence[float] = (), e2e: float | None = None) -> None:
        m = self._model(model)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        if itl:
            h = self.itl.labels(m)
            for dt in itl:
                h.observe(dt)
        if e2e is not None:
            self.e2e.labels(m).observe(e2e)
        self.prompt_tokens.labels(m).inc(result.prompt_tokens)
        self.prompt_cached.labels(m).inc(result.prompt_cached)
        self.generation_tokens.labels(m).inc(len(result.tokens))
        self.decode_seconds.labels(m).inc(result.eval_seconds)
        # A round that lost adds less than its time; the sum never goes below zero (a counter).
        self.target_only_seconds.labels(m).inc(max(0.0, result.eval_seconds + result.saved_seconds))
        if result.draft_rounds:
            self.num_drafts.labels(m).inc(result.draft_rounds)
            self.num_draft_tokens.labels(m).inc(result.draft_tokens)
            self.num_accepted_tokens.labels(m).inc(result.draft_accepted_tokens)
            for pos, n in enumerate(result.accepted_per_pos):
                if n:
                    self.accepted_per_pos.labels(m, str(pos)).inc(n)
        for source, (drafted, accepted) in result.drafts_by_source.items():
            if drafted:
                self.source_draft_tokens.labels(m, self._kind(source)).inc(drafted)
                self.source_accepted_tokens.labels(m, self._kind(source)).inc(accepted)
        if result.fallback:
            self.fallbacks.labels(m, self._kind(fallback_kind(result.fallback))).inc()

    def model_loaded(self, model: str, seconds: float, ok: bool = True) -> None:
        m = self._model(model)
        if ok:
            self.model_load.labels(m).observe(seconds)
        else:
            self.model_load_failures.labels(m).inc()

    def config_reload(self, ok: bool) -> None:
        self.config_reloads.labels("success" if ok else "failure").inc()
        self.config_last_ok.set(1 if ok else 0)
        if ok:
            self.config_last_ok_time.set_to_current_time()

    def upstream_error(self, kind: str) -> None:
        self.upstream_errors.labels(self._kind(kind)).inc()

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """The scrape body and its content type (OpenMetrics if the scraper asks for it)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


METRICS = web.AppKey("sidecar_metrics", Metrics)

Target = web.Application | web.Request | Metrics | None


def of(target: Target) -> Metrics | None:
    """The Metrics of an app (or of a request's app); None when metrics were never set up."""
    if target is None or isinstance(target, Metrics):
        return target
    app = target.app if isinstance(target, web.Request) else target
    return app.get(METRICS)


async def handle_metrics(request: web.Request) -> web.Response:
    m = of(request)
    if m is None:
        raise web.HTTPNotFound()
    body, content_type = m.exposition(request.headers.get("Accept", ""))
    return web.Response(body=body, headers={"Content-Type": content_type})


MODEL = web.RequestKey("sidecar_metrics_model", str) if hasattr(web, "RequestKey") else "sidecar.metrics.model"


def set_model(request: web.Request, model: str) -> None:
    """Label this request's `sidecar_requests_total` sample with the pair it resolved to."""
    request[MODEL] = model  # type: ignore[index]


def model_of(request: web.Request) -> str | None:
    """The pair this request's sample is labelled with (set_model), if any yet."""
    return request.get(MODEL)  # type: ignore[call-overload, no-any-return]


def _endpoint(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
    """Count every request by route, model (see set_model) and final status.

    The model label is a pair's name or empty, never a name as a client wrote it: empty for
    requests that name no pair (forwarded, unknown, no body), so scanners cannot crowd the
    pairs out of the bounded label values. The app labels a refused request by the pair its body
    names even when it was refused before the pair was looked up (api.app.refusals).

    Outermost, so the guards' 403s count too (a burst of them is a rebinding attempt). The route's
    pattern, not the raw path, is the endpoint label: paths are client input."""
    status: int = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as e:
        status = e.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client closed the connection (nginx's convention)
        raise
    finally:
        observe_request(request, _endpoint(request), model_of(request), status)


def setup(app: web.Application, runtime: RuntimeView | None = None) -> Metrics:
    """Give the app its own registry and GET /metrics (Ollama has no such route, so it is free).

    Queue depth and loaded models are read from the runtime when Prometheus scrapes, and model
    loads are timed through its `on_load` callbacks `(pair, seconds, ok)`."""
    m = Metrics(runtime=runtime)
    app[METRICS] = m
    if runtime is not None:
        runtime.on_load.append(m.model_loaded)
    app.router.add_get("/metrics", handle_metrics)
    return m


# -- the calls the API and runtime make; each is a no-op without metrics ----------------------
def observe_request(target: Target, endpoint: str, model: str | None, status: int | str) -> None:
    """One finished request. `model` must be a served pair's name (or None), never raw input."""
    if (m := of(target)) is not None:
        m.request(endpoint, model, status)


def observe_generation(target: Target, model: str, result: GenerationResult, ttft: float | None = None,
                       itl: Sequence[float] = (), e2e: float | None = None) -> None:
    """One generation's tokens, speculation counters, fallback and latencies: a finished one, or one
    its client left (its abort's `cancel` Outcome, without `e2e`: it had no final chunk)."""
    if (m := of(target)) is not None:
        m.generation(model, result, ttft, itl, e2e)


def observe_client_disconnect(target: Target, endpoint: str, model: str | None) -> None:
    if (m := of(target)) is not None:
        m.client_disconnect(endpoint, model)


def observe_model_load(target: Target, model: str, seconds: float, ok: bool = True) -> None:
    if (m := of(target)) is not None:
        m.model_loaded(model, seconds, ok)


def observe_config_reload(target: Target, ok: bool) -> None:
    if (m := of(target)) is not None:
        m.config_reload(ok)


def observe_upstream_error(target: Target, kind: str) -> None:
    """kind: connect | timeout | reset | status | other."""
    if (m := of(target)) is not None:
        m.upstream_error(kind)


class TokenClock:
    """Arrival times of streamed pieces, turned into TTFT and inter-token latencies.

    Create it with the request's start (`time.perf_counter()` at handler entry), call `mark()` for
    every piece sent, and pass `ttft` / `itl` to observe_generation."""

    def __init__(self, start: float | None = None) -> None:
        self.start = time.perf_counter() if start is None else start
        self.first: float | None = None
        self.last: float | None = None
        self.itl: list[float] = []

    def mark(self, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self.last is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
