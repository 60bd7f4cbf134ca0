"""Prometheus metrics of the gateway and of its backend(s), on a per-app registry.

Names follow vLLM's production metrics (https://docs.vllm.ai/en/stable/usage/metrics/,
docs/design/metrics.md) with the prefix ``gateway:`` instead of ``vllm:`` so a
vLLM dashboard ports by renaming the prefix. (Prometheus' naming guide,
https://prometheus.io/docs/practices/naming/, reserves colons for recording
rules; we follow vLLM's precedent deliberately.) Units are in the names:
``_seconds`` histograms, token counters, ``_perc`` fractions in [0, 1].
Counters get the ``_total`` suffix from prometheus-client.

Request-level metrics (histograms, token counters, finish reasons) are
observed by the gateway from each ``RequestRecord`` (``gateway.observability.record``).
Engine-level figures come from the backend's ``Stats`` messages
(``gateway.observability.backend_stats``).
``render()`` first asks the configured stats source for a fresh ``Stats``, so
a scrape after traffic has settled shows the backend's exact counts.

A ``tenant`` label is added to request counters only when
``tenant_label=True`` (``--metrics-tenant-label``, off by default: use it
only when the number of tenants is bounded by configuration); past
``max_tenants`` distinct values further tenants are reported as "other".
Histograms never carry a tenant label.

Wiring (gateway/server.py builds it, gateway/app.py ``build_app`` routes and wraps)::

    metrics = GatewayMetrics(card.name, tenant_label=settings.observability.metrics_tenant_label)
    metrics.set_stats_source(pool.stats)                  # async () -> {backend: (Stats, restarts)}
    routes.append(Route("/metrics", metrics.endpoint))
    app = ObservabilityMiddleware(app, metrics)           # gateway/observability/middleware.py
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from backend.protocol import Stats
from gateway.observability.backend_stats import PREFIX, BackendStatsCollector, StatsSource
from gateway.observability.record import RequestRecord

log = logging.getLogger("gateway.metrics")

# Buckets as in vLLM v1 (vllm/v1/metrics/loggers.py), seconds.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1) + REQUEST_LATENCY_BUCKETS
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

FINISH_REASONS = ("stop", "length", "tool_calls", "abort", "error", "content_filter")


_FAIL_OPEN_HELP = (
    "Requests admitted without rate limits because Redis did not answer (--limits-fail-open; 0 when off)."
)


class _ReadCounter:
    """A counter whose value is read from its owner at scrape time (one sample, no labels)."""

    def __init__(self, name: str, documentation: str, read: Callable[[], int]) -> None:
        self.name, self.documentation, self.read = name, documentation, read

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.documentation)]

    def collect(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.documentation, value=self.read())]


class GatewayMetrics:
    """All gateway metrics on one ``CollectorRegistry`` (one per app; never the global registry).

    Args:
        model_name: value of the ``model_name`` label (the pool's stats source keeps it current).
        tenant_label: add a ``tenant`` label to request counters (bounded tenant sets only).
        max_tenants: distinct tenant label values before further ones become "other".
        registry: registry to use (a new one by default).
    """

    def __init__(
        self,
        model_name: str = "",
        *,
        tenant_label: bool = False,
        max_tenants: int = 100,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.tenant_label = tenant_label
        self.max_tenants = max_tenants
        self._tenants: set[str] = set()
        self._stats_source: StatsSource | None = None
        self.stats_timeout_s = 2.0
        r = self.registry
        P = PREFIX
        m = ["model_name"]
        t = ["model_name", "tenant"] if tenant_label else ["model_name"]
        tt = ["tenant"] if tenant_label else []

        # ---- request-level histograms (seconds / tokens), vLLM names
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "Time to first token: request arrival at the gateway -> first generated token received from the backend (seconds). One observation per request that produced a token.",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds",
            "Inter-token latency: time between successive token-carrying backend outputs of a request (seconds).",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "End-to-end request latency: arrival -> last byte of the response (seconds).",
            m,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            P + "request_queue_time_seconds",
            "Backend queue time: arrival in the engine -> first scheduled (seconds).",
            m,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            P + "request_prefill_time_seconds",
            "Backend prefill time: first scheduled -> first token (seconds).",
            m,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.decode_time = Histogram(
            P + "request_decode_time_seconds",
            "Backend decode time: first token -> finish (seconds).",
            m,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.inference_time = Histogram(
            P + "request_inference_time_seconds",
            "Backend inference time: prefill + decode (seconds).",
            m,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.req_prompt_tokens = Histogram(
            P + "request_prompt_tokens",
            "Prompt tokens per request (tokens).",
            m,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.req_generation_tokens = Histogram(
            P + "request_generation_tokens",
            "Generated tokens per request, all choices (tokens).",
            m,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )

        # ---- request-level counters
        self.prompt_tokens = Counter(
            P + "prompt_tokens",
            "Prompt tokens of finished requests, as reported in usage (tokens).",
            t,
            registry=r,
        )
        self.generation_tokens = Counter(
            P + "generation_tokens",
            "Generated tokens of finished requests: every token the backend generated for them, as billed (tokens a client never received included) (tokens).",
            t,
            registry=r,
        )
        self.cached_tokens = Counter(
            P + "prompt_tokens_cached",
            "Prompt tokens of finished requests served from the prefix cache (usage cached_tokens) (tokens).",
            t,
            registry=r,
        )
        self.request_success = Counter(
            P + "request_success",
            "Requests that reached the backend, by finish reason (stop, length, tool_calls, abort, error, content_filter).",
            t + ["finished_reason"],
            registry=r,
        )
        self.aborts = Counter(
            P + "request_aborts",
            "Requests whose response ended before the backend finished them, by reason: client_disconnect (the client went away or the request was cancelled) or slow_reader (a stream whose client stopped reading, stopped after its token backlog).",
            t + ["reason"],
            registry=r,
        )
        self.http_requests = Counter(
            P + "http_requests", "HTTP responses by route and status code.", ["path", "status"], registry=r
        )
        self.rate_limited = Counter(
            P + "rate_limited_requests",
            "429 responses by kind: the error type (requests: RPM/concurrency, tokens: TPM, insufficient_quota: daily quota).",
            tt + ["kind"],
            registry=r,
        )
        self.content_filter_blocks = Counter(
            P + "content_filter_blocks",
            "Content-filter blocks: stage=input (400 content_filter) or output (finish_reason content_filter).",
            tt + ["stage"],
            registry=r,
        )
        self.in_flight = Gauge(
            P + "http_requests_in_flight", "HTTP requests being handled by the gateway now.", registry=r
        )

        # ---- engine-level, from backend Stats
        self.backend = BackendStatsCollector(lambda: self.model_name)
        r.register(self.backend)
        self._fail_open: Callable[[], int] = lambda: 0
        r.register(
            _ReadCounter(P + "rate_limiter_fail_open_admissions", _FAIL_OPEN_HELP, lambda: self._fail_open())
        )

    # ------------------------------------------------------------------ configuration

    def set_fail_open_source(self, read: Callable[[], int]) -> None:
        """Where ``gateway:rate_limiter_fail_open_admissions_total`` is read (``Admission.fail_open_admitted``)."""
        self._fail_open = read

    def set_stats_source(self, source: StatsSource | None) -> None:
        """An async callable giving fresh backend ``Stats`` (or a list / {backend_id: Stats}); polled by ``render``."""
        self._stats_source = source

    def set_backend_models(self, models: dict[str, str]) -> None:
        """The ``model_name`` label of each backend's engine figures: ``{backend id: served model name}``
        (a backend not named there gets ``model_name``)."""
        self.backend.backend_models = dict(models)

    def update_backend_stats(self, stats: Stats, backend: str = "0", epoch: int | None = None) -> None:
        """Feed one backend ``Stats`` (from a poll or an unsolicited message); ``epoch``: see ``BackendStatsCollector.update``."""
        self.backend.update(stats, backend, epoch)

    # ------------------------------------------------------------------ labels

    def _tenant(self, tenant: str | None) -> str:
        tv = tenant or "anonymous"
        if tv in self._tenants:
            return tv
        if len(self._tenants) >= self.max_tenants:
            return "other"
        self._tenants.add(tv)
        return tv

    def _t(self, rec: RequestRecord) -> list[str]:
        model = rec.model or self.model_name
        return [model, self._tenant(rec.tenant)] if self.tenant_label else [model]

    def _tt(self, rec: RequestRecord) -> list[str]:
        return [self._tenant(rec.tenant)] if self.tenant_label else []

    # ------------------------------------------------------------------ observations (called by RequestRecord / middleware)

    def request_started(self, rec: RequestRecord) -> None:
        """A request arrived (middleware)."""
        self.in_flight.inc()

    def observe_ttft(self, rec: RequestRecord, seconds: float) -> None:
        """First token of a request (called once per request by ``RequestRecord.on_tokens``)."""
        self.ttft.labels(rec.model or self.model_name).observe(seconds)

    def observe_itl(self, rec: RequestRecord, seconds: float) -> None:
        """One inter-token gap of a request."""
        self.itl.labels(rec.model or self.model_name).observe(seconds)

    def finish_request(self, rec: RequestRecord) -> None:
        """The response of ``rec`` is complete (middleware, once per request)."""
        self.in_flight.dec()
        status = rec.status or 500
        self.http_requests.labels(rec.route, str(status)).inc()
        if status == 429:
            self.rate_limited.labels(*self._tt(rec), rec.error_type or rec.error_code or "unknown").inc()
        if status == 400 and rec.error_code == "content_filter":
            self.content_filter_blocks.labels(*self._tt(rec), "input").inc()
        if not rec.submitted:
            return
        model = rec.model or self.model_name
        tl = self._t(rec)
        reason = rec.finish_reason or "error"
        self.request_success.labels(*tl, reason).inc()
        if reason == "abort":
            self.aborts.labels(*tl, rec.abort_reason or "client_disconnect").inc()
        if reason == "content_filter":
            self.content_filter_blocks.labels(*self._tt(rec), "output").inc()
        self.e2e.labels(model).observe(rec.e2e_s)
        if rec.prompt_tokens is not None:
            self.prompt_tokens.labels(*tl).inc(rec.prompt_tokens)
            self.req_prompt_tokens.labels(model).observe(rec.prompt_tokens)
        self.generation_tokens.labels(*tl).inc(rec.completion_tokens)
        self.req_generation_tokens.labels(model).observe(rec.completion_tokens)
        if rec.cached_tokens:
            self.cached_tokens.labels(*tl).inc(rec.cached_tokens)
        if rec.queue_s is not None:
            self.queue_time.labels(model).observe(rec.queue_s)
        if rec.prefill_s is not None:
            self.prefill_time.labels(model).observe(rec.prefill_s)
        if rec.decode_s is not None:
            self.decode_time.labels(model).observe(rec.decode_s)
        if rec.prefill_s is not None or rec.decode_s is not None:
            self.inference_time.labels(model).observe((rec.prefill_s or 0.0) + (rec.decode_s or 0.0))

    # ------------------------------------------------------------------ exposition

    async def refresh(self) -> None:
        """Poll the stats source (if any) once, within ``stats_timeout_s``; failures are logged, not raised."""
        if self._stats_source is None:
            return
        try:
            with trio.move_on_after(self.stats_timeout_s):
                got = await self._stats_source()
                if got is None:
                    return
                if isinstance(got, dict):
                    for b, s in got.items():
                        if isinstance(s, tuple):  # (Stats, epoch)
                            self.update_backend_stats(s[0], str(b), s[1])
                        else:
                            self.update_backend_stats(s, str(b))
                elif isinstance(got, (list, tuple)):
                    for i, s in enumerate(got):
                        self.update_backend_stats(s, str(i))
                else:
                    self.update_backend_stats(got)
        except Exception:  # a dead backend must not break /metrics
            log.warning("backend stats poll failed", exc_info=True)

    async def render(self) -> bytes:
        """Refresh backend stats and return the text exposition format (bytes)."""
        await self.refresh()
        return generate_latest(self.registry)

    async def endpoint(self, request: Request) -> Response:
        """Starlette endpoint for ``GET /metrics`` (no auth: bind the port privately or guard upstream)."""
        return Response(await self.render(), media_type=CONTENT_TYPE_LATEST)
