"""``python -m gateway serve``: start (or connect to) backends, then serve HTTP with hypercorn's Trio worker.

Settings: ``gateway.settings`` (defaults < ``--config`` TOML < ``LLM_GATEWAY_*`` environment < flags);
a bad one is a message and exit status 2.

Lifecycle:
1. Backends, per model (``[[models]]`` / ``--serve-model``; without any, the one default model of
   ``--model``, ``--backends``, ``--backend-url``): without a backend URL, ``replicas`` (``--backends``)
   processes ``python -m backend --model PATH --listen unix:SOCK`` plus the model's engine options are
   spawned (socket in a temp dir); with one or more backend URLs the gateway connects to them. Every model's
   backends start at once and the gateway waits for every backend's first ``Ready``. A first start that
   fails for good (the backend cannot load its model: ``BackendStartError``, gateway/backends/supervisor.py)
   ends the process: one line ``python -m gateway serve: error: cannot load model PATH: REASON`` on stderr,
   exit status 1, its backends stopped; nothing retries it.
2. Text, per model (``gateway.launch``): tokenizer + chat template from the model's ``tokenizer``, else its
   path, else the backend's ``ModelCard.model_path``; the ``ModelCatalog`` (gateway/catalog.py) is built.
   Tenancy (database, usage ledger) starts; the app is built (``gateway.app.build_app``: every route and the
   middleware order).
3. HTTP: ``hypercorn.trio.serve`` on ``--host``/``--port``; a curl example is printed when ready. Before
   it, the soft open-file limit is raised to the hard one (logged) and connections are bounded
   (``gateway.connections``: a closed idle connection is released at once, at most ``max_connections``
   open, ``max_connections_per_client`` per client address, a refusal in the API's shape beyond; ``accept``
   EMFILE logged once per 10 s); an idle kept-alive connection closes after ``keep_alive_timeout`` s.
4. SIGINT/SIGTERM before HTTP serves (a backend loading, a restart backoff, the tokenizer): stop at once, every
   backend process SIGTERMed (SIGKILL after 3 s) and reaped, exit 0. After that: drain. The listener stays open
   and every new request (new connection or kept-alive) is answered 503 ``server_shutting_down``
   (``gateway.middleware.drain.DrainGate``; the probes and monitoring still answer), while in-flight requests
   run on for up to ``--drain-timeout`` seconds; when the time is up, every request still running ends its
   answer (a stream: an error event, 503 ``server_shutting_down``, and ``[DONE]``; ``DrainGate.cut``) within
   ``CUT_GRACE_S``; when the last one ends hypercorn stops (1 s more grace, then the rest is cancelled),
   then backends get ``Shutdown`` (bounded wait, then SIGKILL). A
   second signal exits at once, if it comes ``DUPLICATE_SIGNAL_S`` or more after the first: a signal sent to a
   process group reaches the gateway twice when a parent forwards it too (``make serve``, a shell), and that is
   one request to stop.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from functools import partial

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio import serve as hyper_serve

from auth.errors import StoreUnavailable
from backend import cpu_isa
from backend.model_path import default_model_path
from backend.protocol import ModelCard, Stats
from gateway.app import build_app
from gateway.backends.address import link_credentials
from gateway.backends.pool import BackendPool
from gateway.backends.routing import routing_config
from gateway.backends.supervisor import BackendStartError, BackendSupervisor, SpawnSpec
from gateway.catalog import ModelCatalog
from gateway.connections import ConnectionCaps, default_total, install, quiet_accept_errors, raise_nofile
from gateway.filters import TenantFilters
from gateway.launch import StartupError, _load_tokenizer, served_model
from gateway.observability.access_log import configure_access_log
from gateway.observability.metrics import GatewayMetrics
from gateway.options import model_engine
from gateway.sections import ModelSettings
from gateway.settings import Settings, SettingsError, configure_logging, engine_argv, load_settings
from gateway.state import Gateway
from gateway.tenants import Tenants
from ratelimit.errors import StoreError

__all__ = [
    "StartupError",
    "_load_tokenizer",
    "backend_pool",
    "main",
    "serve",
]  # StartupError: its home was here
log = logging.getLogger("gateway")


def backend_pool(settings: Settings, model: str | None, served: ModelSettings | None = None) -> BackendPool:
    """The backends of one model: one supervisor per ``--backend-url``, else ``--backends`` spawned ones
    serving ``model`` with the engine options. ``served``: a ``[[models]]`` entry, whose ``backend_url``,
    ``replicas``, ``path`` and engine options (``options.model_engine``) are used instead; its supervisors
    are named ``<name>-backend-<i>`` (the default model's ``backend-<i>``)."""
    b = settings.backend
    urls = served.backend_url if served is not None else b.backend_url
    prefix = f"{served.name}-" if served is not None else ""
    if urls:
        sups = [
            BackendSupervisor(
                url=u,
                name=f"{prefix}backend-{i}",
                request_buffer=b.request_buffer,
                max_failures=b.max_failures,
                credentials=link_credentials(b.backend_secret_file, b.backend_tls_ca_file),
            )
            for i, u in enumerate(urls)
        ]
    else:
        engine = model_engine(settings.engine, served) if served is not None else settings.engine
        spec = SpawnSpec(
            model=(served.path if served is not None else model) or default_model_path(),
            extra_args=engine_argv(engine),
            startup_timeout=b.backend_startup_timeout,
        )
        sups = [
            BackendSupervisor(
                spawn=spec,
                name=f"{prefix}backend-{i}",
                request_buffer=b.request_buffer,
                max_failures=b.max_failures,
            )
            for i in range(served.replicas if served is not None else b.backends)
        ]
    return BackendPool(sups, wait_timeout=b.backend_wait, routing=routing_config(b))


def _mode(card: ModelCard | None) -> str:
    """A native model's serving mode for the banner: ``float32, int4 generated rows`` or ``float32, dense``."""
    if card is None:
        return "mode unknown"
    weights = {"int4": "int4 rows", "mixed": "int4 generated rows"}.get(card.weights, "dense")
    return f"{card.dtype}, {weights} on {card.device}"


def _banner(gw: Gateway, tenancy: Tenants, settings: Settings) -> str:
    base = f"http://{settings.http.host}:{settings.http.port}"
    name = gw.model_names()[0] if gw.model_names() else "model"
    key = tenancy.default_key
    served = ", ".join(
        f"{m.name!r} ({_mode(m.card_or_none)}; {', '.join(s.url for s in m.pool.supervisors)})"
        if m.pool
        else repr(m.name)
        for m in gw.catalog
    )
    return (
        f"Gateway ready on {base} (models: {served})\n"
        f'  curl {base}/v1/chat/completions -H "Authorization: Bearer $API_KEY" '
        f"-H 'Content-Type: application/json' "
        f'-d \'{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 100}}\'\n'
        + (
            f"  API_KEY={key}  (tenant 'default', created now; shown once)"
            if key
            else "  API_KEY: a tenant key (create one: POST /admin/v1/tenants/{id}/keys with the admin key)"
        )
    )


class _Config(Config):
    """hypercorn's ``Config`` whose TCP listeners carry ``TCP_USER_TIMEOUT`` (Linux, tcp(7)).

    Accepted connections inherit it from the listener. The kernel then drops a connection whose sent data
    stays unacknowledged for ``send_timeout`` seconds, a client that stops reading included (zero-window
    probes count, unlike keep-alive probes): hypercorn's write to it fails, the request sees a disconnect
    and gives back its concurrency slot and KV blocks. Without it a client that neither reads nor closes
    would hold its request (hypercorn's writes are shielded from cancellation) for as long as it likes.
    """

    def __init__(self, *, send_timeout: float) -> None:
        super().__init__()
        self.send_timeout = send_timeout

    def create_sockets(self) -> Sockets:
        sockets = super().create_sockets()
        ms = int(self.send_timeout * 1000)
        if ms > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):
            for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, ms)
        return sockets


async def serve(settings: Settings) -> None:
    """Run the gateway until SIGINT/SIGTERM (see module docstring).

    Raises:
        StartupError, BackendStartError (in an ExceptionGroup when raised after the nursery opened): the
            model, a backend or the tokenizer cannot be loaded.
    """
    nofile = raise_nofile()  # first: the backends spawned inherit it
    model = settings.backend.model
    spawns = (
        not settings.backend.backend_url
        if not settings.models
        else any(m.kind == "native" and not m.backend_url and not m.path for m in settings.models)
    )
    if model is None and spawns:
        try:
            model = default_model_path()
        except FileNotFoundError as exc:
            raise StartupError(f"cannot load model (the default): {exc}") from None
    declared: list[tuple[ModelSettings | None, BackendPool | None]] = [
        (m, backend_pool(settings, model, m) if m.kind == "native" else None) for m in settings.models
    ] or [(None, backend_pool(settings, model))]
    pools = [p for _, p in declared if p is not None]
    catalog: ModelCatalog | None = None

    def drain() -> None:  # every model: the pools now, the catalog once built (a model without backends)
        for p in pools:
            p.draining = True
        if catalog is not None:
            catalog.draining = True

    async with trio.open_nursery() as nursery:
        shutdown, serving = trio.Event(), trio.Event()
        nursery.start_soon(_signals, shutdown, serving, drain, nursery.cancel_scope)
        t = settings.tenancy  # first: an unreachable store or Redis fails before the model loads
        tenancy = Tenants(
            t.db,
            redis_url=t.redis_url,
            admin_key=t.admin_key,
            cache_ttl_s=t.key_cache_s,
            feed_ttl_s=t.key_cache_feed_s,
            stale_s=t.key_stale_s,
            ledger_flush_s=t.ledger_flush_s,
            ledger_batch=t.ledger_batch,
            spool_dir=t.ledger_spool_dir,
            spool_rows=t.ledger_spool_rows,
            limits_fail_open=t.limits_fail_open,
            create_default=False,  # after the model loads: a failed first start keeps the key unshown
        )
        try:
            await tenancy.start(nursery)
        except (StoreUnavailable, StoreError) as exc:
            raise StartupError(f"cannot start tenancy: {' '.join(str(exc).split())}") from None
        async with trio.open_nursery() as starting:  # every model's backends at once
            for p in pools:  # BackendStartError: a first start failed (backends stopped)
                starting.start_soon(nursery.start, p.run)
        catalog = ModelCatalog([await served_model(settings, m, p, model) for m, p in declared])
        await tenancy.create_default_tenant()
        obs = settings.observability
        default = catalog.default
        metrics = GatewayMetrics(default.name, tenant_label=obs.metrics_tenant_label)
        metrics.set_stats_source(partial(_stats, pools))
        metrics.set_backend_models({s.name: m.name for m in catalog if m.pool for s in m.pool.supervisors})
        metrics.set_fail_open_source(lambda: tenancy.admission.fail_open_admitted)
        configure_access_log(obs.access_log)
        gw = Gateway(
            settings,
            default.pool,  # type: ignore[arg-type]  # the default model's (None: an upstream model)
            default.tokenizer,  # type: ignore[arg-type]
            default.template,  # type: ignore[arg-type]
            catalog=catalog,
            tenancy=tenancy,
            filters=TenantFilters(budget=settings.http.filter_budget),
            metrics=metrics,
        )
        app = build_app(gw)

        hc = _Config(send_timeout=settings.http.send_timeout)
        hc.bind = [f"{settings.http.host}:{settings.http.port}"]
        hc.graceful_timeout = (
            1.0  # after the drain gate's drain: closes idle connections, cancels what ran over
        )
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        hc.keep_alive_timeout = settings.http.keep_alive_timeout
        total = settings.http.max_connections or default_total(nofile)
        install(ConnectionCaps(total, settings.http.max_connections_per_client))
        quiet_accept_errors()
        done = trio.Event()

        async def drained() -> None:  # hypercorn's shutdown trigger: signal, then in-flight requests done
            await shutdown.wait()
            with trio.move_on_after(settings.http.drain_timeout):
                await app.drain.idle()
            if app.drain.in_flight:  # the time is up: every open answer ends with an error, then stop
                log.warning("drain timeout: ending %d requests still running", app.drain.in_flight)
                app.drain.cut()
                with trio.move_on_after(CUT_GRACE_S):
                    await app.drain.idle()

        async def http(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await hyper_serve(app, hc, shutdown_trigger=drained, task_status=task_status)
            finally:
                done.set()

        bound = await nursery.start(http)
        serving.set()
        print(_banner(gw, tenancy, settings), flush=True)
        log.info("listening on %s", bound)
        await done.wait()
        log.info("HTTP server stopped; stopping backends")
        with trio.move_on_after(15):
            async with trio.open_nursery() as stopping:
                for p in pools:
                    stopping.start_soon(p.stop, 10.0)
        with trio.move_on_after(10), trio.CancelScope(shield=True):
            await catalog.aclose()  # upstream models' connections
        with trio.move_on_after(10):
            await tenancy.aclose()  # flush the usage ledger
        nursery.cancel_scope.cancel()


CUT_GRACE_S = 2.0  # seconds the requests cut at the drain timeout get to end their answers
DUPLICATE_SIGNAL_S = 1.0  # a second signal sooner than this after the first is the same request to stop


async def _stats(pools: list[BackendPool]) -> dict[str, tuple[Stats, int]]:
    """Every pool's ``BackendPool.stats`` in one dict (supervisor names are unique across models)."""
    out: dict[str, tuple[Stats, int]] = {}
    for p in pools:
        out.update(await p.stats())
    return out


async def _signals(
    shutdown: trio.Event, serving: trio.Event, drain: Callable[[], None], scope: trio.CancelScope
) -> None:
    """SIGINT/SIGTERM: before ``serving`` (backends loading, restarting, tokenizer) stop at once (``scope``
    cancelled: each supervisor SIGTERMs and reaps its process); then the drain of the module docstring.
    ``drain()`` sets the drain flag of every model (``BackendPool.draining``, ``ModelCatalog.draining``)."""
    first = 0.0
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
        async for sig in sigs:
            if not serving.is_set():
                log.warning("signal %s during startup: stopping", signal.Signals(sig).name)
                drain()
                scope.cancel()
                return
            if shutdown.is_set():
                if trio.current_time() - first < DUPLICATE_SIGNAL_S:
                    log.info(
                        "signal %s again (forwarded by a parent): still draining", signal.Signals(sig).name
                    )
                    continue
                log.warning("second signal: exiting now")
                scope.cancel()
                return
            log.info("signal %s: draining", signal.Signals(sig).name)
            first = trio.current_time()
            drain()
            shutdown.set()


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def main(argv: list[str] | None = None) -> int:
    """``python -m gateway serve [options]``: 0 after a drain (or a signal during startup), 2 on bad
    settings, 1 when it cannot start (the model, a backend, the tokenizer); the error is one line on stderr
    (``python -m gateway serve: error: cannot load model /m/x.gguf: not a GGUF file ...``)."""
    try:
        cpu_isa.apply()  # a forced CPU ISA the CPU lacks stops here, before any backend is spawned
        settings, notices = load_settings(argv, os.environ)
    except (SettingsError, cpu_isa.IsaError) as exc:
        print(f"python -m gateway serve: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)
    for notice in notices:
        log.warning("%s", notice)
    failure: BaseException | None = None
    try:
        trio.run(partial(serve, settings))
    except* (BackendStartError, StartupError) as group:
        failure = _first_leaf(group)
    if failure is not None:
        print(f"python -m gateway serve: error: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0
