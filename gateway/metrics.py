"""Prometheus metrics of the gateway and of its backend(s), on a per-app registry.

Names follow vLLM's production metrics (https://docs.vllm.ai/en/stable/usage/metrics/,
docs/design/metrics.md) with the prefix ``gateway:`` instead of ``vllm:`` so a
vLLM dashboard ports by renaming the prefix. (Prometheus' naming guide,
https://prometheus.io/docs/practices/naming/, reserves colons for recording
rules; we follow vLLM's precedent deliberately.) Units are in the names:
``_seconds`` histograms, token counters, ``_perc`` fractions in [0, 1].
Counters get the ``_total`` suffix from prometheus-client.

Request-level metrics (histograms, token counters, finish reasons) are
observed by the gateway from each ``RequestRecord`` (gateway/request_log.py).
Engine-level figures come from the backend's ``Stats`` messages: its gauges
are reported as gauges, and its monotonic counters (preemptions, prefix-cache
queries/hits, aborts, ...) are reported *as counters* by a custom collector
that sums them over backend restarts (a value lower than the last one seen
means the backend restarted; the last value is carried into an offset).
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
    app = ObservabilityMiddleware(app, metrics)           # gateway/request_log.py
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

if TYPE_CHECKING:  # pragma: no cover
    from gateway.request_log import RequestRecord

log = logging.getLogger("gateway.metrics")

PREFIX = "gateway:"

# Buckets as in vLLM v1 (vllm/v1/metrics/loggers.py), seconds.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1) + REQUEST_LATENCY_BUCKETS
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

FINISH_REASONS = ("stop", "length", "abort", "error", "content_filter")

StatsSource = Callable[
    [], Awaitable[Any]
]  # -> Stats | list[Stats] | {backend: Stats | (Stats, epoch)} | None


class BackendStatsCollector:
    """Reports the latest backend ``Stats`` per backend: gauges as gauges, monotonic counters as counters.

    Counter values are summed over restarts of a backend: when a counter is
    lower than the last value seen, the last value is added to that
    backend's offset (Prometheus' own reset handling would do the same with
    ``rate()``, but exact ``increase`` checks need a true monotonic series).
    """

    # Stats field -> (metric name without prefix/_total, help)
    COUNTERS = {
        "preemptions": (
            "num_preemptions",
            "Cumulative number of preemptions by the engine (requests evicted and later recomputed).",
        ),
        "prefix_cache_queries": (
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (tokens).",
        ),
        "prefix_cache_hits": (
            "prefix_cache_hits",
            "Prompt tokens served from the prefix cache, counted once their blocks are allocated (tokens).",
        ),
        "aborts": (
            "engine_aborts",
            "Requests aborted inside the engine (client disconnects, gateway aborts).",
        ),
        "requests_finished": (
            "engine_requests_finished",
            "Requests (choices) the engine finished, any reason.",
        ),
        "prompt_tokens": (
            "engine_prompt_tokens",
            "Prompt tokens prefilled by the engine (recomputation after preemption included) (tokens).",
        ),
        "generation_tokens": ("engine_generation_tokens", "Tokens generated by the engine (tokens)."),
        "steps": ("engine_steps", "Engine steps (scheduler iterations) executed."),
    }

    def __init__(self, model_name: Callable[[], str]) -> None:
        self._model_name = model_name
        self._last: dict[str, Any] = {}
        self._offset: dict[str, dict[str, float]] = {}
        self._epoch: dict[str, Any] = {}

    def update(self, stats: Any, backend: str = "0", epoch: Any = None) -> None:
        """Take a new ``Stats`` for ``backend`` (a short id such as "0"), detecting counter resets.

        ``epoch`` (e.g. the supervisor's restart count) marks a new backend
        process: when it changes, every counter restarts from zero even if the
        new process already counted past the old values between two polls.
        """
        prev = self._last.get(backend)
        off = self._offset.setdefault(backend, {k: 0.0 for k in self.COUNTERS})
        new_epoch = epoch is not None and backend in self._epoch and self._epoch[backend] != epoch
        if prev is not None:
            for field in self.COUNTERS:
                old, new = getattr(prev, field, 0) or 0, getattr(stats, field, 0) or 0
                if new_epoch or new < old:  # backend restarted: keep what it had counted
                    off[field] += old
        if epoch is not None:
            self._epoch[backend] = epoch
        self._last[backend] = stats

    def counter_value(self, field: str, backend: str = "0") -> float:
        """Cumulative value of a backend counter (offset + latest)."""
        s = self._last.get(backend)
        return self._offset.get(backend, {}).get(field, 0.0) + (
            getattr(s, field, 0) or 0 if s is not None else 0
        )

    def collect(self) -> Iterable[Any]:
        model = self._model_name()
        labels = ["model_name", "backend"]
        running = GaugeMetricFamily(
            PREFIX + "num_requests_running", "Requests in the engine's running batch.", labels=labels
        )
        waiting = GaugeMetricFamily(
            PREFIX + "num_requests_waiting", "Requests waiting to be scheduled by the engine.", labels=labels
        )
        usage = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", labels=labels
        )
        used = GaugeMetricFamily(
            PREFIX + "kv_cache_blocks_used", "KV-cache blocks in use (blocks).", labels=labels
        )
        total = GaugeMetricFamily(
            PREFIX + "kv_cache_blocks_total", "KV-cache blocks in the pool (blocks).", labels=labels
        )
        cached = GaugeMetricFamily(
            PREFIX + "kv_cache_blocks_cached",
            "Free KV-cache blocks still holding reusable prefix-cache content (blocks).",
            labels=labels,
        )
        counters = {
            f: CounterMetricFamily(PREFIX + name, help_, labels=labels)
            for f, (name, help_) in self.COUNTERS.items()
        }
        for backend, s in sorted(self._last.items()):
            lv = [model, backend]
            running.add_metric(lv, s.running)
            waiting.add_metric(lv, s.waiting)
            usage.add_metric(lv, (s.kv_blocks_used / s.kv_blocks_total) if s.kv_blocks_total else 0.0)
            used.add_metric(lv, s.kv_blocks_used)
            total.add_metric(lv, s.kv_blocks_total)
            cached.add_metric(lv, s.kv_blocks_cached)
            for f, fam in counters.items():
                fam.add_metric(lv, self.counter_value(f, backend))
        yield from (running, waiting, usage, used, total, cached)
        yield from counters.values()


class GatewayMetrics:
    """All gateway metrics on one ``CollectorRegistry`` (one per app; never the global registry).

    Args:
        model_name: value of the ``model_name`` label (settable later with ``set_model_name``).
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
            "Generated tokens of finished requests, as reported in usage (tokens).",
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
            "Requests that reached the backend, by finish reason (stop, length, abort, error, content_filter).",
            t + ["finished_reason"],
            registry=r,
        )
        self.aborts = Counter(
            P + "request_aborts",
            "Requests whose response ended before the backend finished them (client disconnect/cancel).",
            t,
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

    # ------------------------------------------------------------------ configuration

    def set_model_name(self, name: str) -> None:
        """Set the ``model_name`` label value (e.g. from the backend's ``Ready.model_card.name``)."""
        self.model_name = name

    def set_stats_source(self, source: StatsSource | None) -> None:
        """An async callable giving fresh backend ``Stats`` (or a list / {backend_id: Stats}); polled by ``render``."""
        self._stats_source = source

    def update_backend_stats(self, stats: Any, backend: str = "0", epoch: Any = None) -> None:
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
            self.aborts.labels(*tl).inc()
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
        import trio

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

    async def endpoint(self, request: Any) -> Any:
        """Starlette endpoint for ``GET /metrics`` (no auth: bind the port privately or guard upstream)."""
        from starlette.responses import Response

        return Response(await self.render(), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------------- scrape parsing (tests, tools)


def parse_exposition(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse Prometheus text format into ``{(sample_name, sorted label pairs): value}``.

    Used by tests to compare scrapes; ``_created`` samples are skipped.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample_sum(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels`` (0.0 if none; NaN-safe)."""
    total = 0.0
    for (n, lv), v in samples.items():
        if n != name:
            continue
        d = dict(lv)
        if all(d.get(k) == val for k, val in labels.items()) and not math.isnan(v):
            total += v
    return total
