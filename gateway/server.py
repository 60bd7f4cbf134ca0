"""``python -m gateway serve``: start (or connect to) backends, then serve HTTP with hypercorn's Trio worker.

Settings: ``gateway.settings`` (defaults < ``--config`` TOML < ``LLM_GATEWAY_*`` environment < flags);
a bad one is a message and exit status 2.

Lifecycle:
1. Backends: without ``--backend-url``, ``--backends`` processes ``python -m backend --model PATH --listen
   unix:SOCK`` plus the engine options are spawned (socket in a temp dir); with one or more ``--backend-url``
   the gateway connects to them. The gateway waits for the first ``Ready``.
2. Text: tokenizer + chat template loaded from ``--tokenizer``, else ``--model``, else the backend's
   ``ModelCard.model_path``. Tenancy (database, usage ledger) starts; the app is built
   (``gateway.app.build_app``: every route and the middleware order).
3. HTTP: ``hypercorn.trio.serve`` on ``--host``/``--port``; a curl example is printed when ready.
4. SIGINT/SIGTERM: drain. The listener stays open and every new request (new connection or kept-alive)
   is answered 503 ``server_shutting_down`` (``gateway.middleware.drain.DrainGate``; the probes and
   monitoring still answer), while in-flight requests run on for up to ``--drain-timeout`` seconds; when
   the last one ends (or the time is up) hypercorn stops (1 s more grace, then the rest is cancelled),
   then backends get ``Shutdown`` (bounded wait, then SIGKILL). A second signal exits at once, if it comes
   ``DUPLICATE_SIGNAL_S`` or more after the first: a signal sent to a process group reaches the gateway twice
   when a parent forwards it too (``make serve``, a shell), and that is one request to stop.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from functools import partial

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hyper_serve

from backend.model_path import default_model_path
from gateway.app import build_app
from gateway.backends.pool import BackendPool
from gateway.backends.supervisor import BackendSupervisor, SpawnSpec
from gateway.filters import TenantFilters
from gateway.observability.access_log import configure_access_log
from gateway.observability.metrics import GatewayMetrics
from gateway.settings import Settings, SettingsError, configure_logging, engine_argv, load_settings
from gateway.state import Gateway
from gateway.tenants import Tenants
from templating import ChatTemplate, cached_tokenizer

log = logging.getLogger("gateway")


def backend_pool(settings: Settings, model: str | None) -> BackendPool:
    """One supervisor per ``--backend-url``, else ``--backends`` spawned ones serving ``model`` with the
    engine options."""
    b = settings.backend
    if b.backend_url:
        sups = [
            BackendSupervisor(url=u, name=f"backend-{i}", request_buffer=b.request_buffer)
            for i, u in enumerate(b.backend_url)
        ]
    else:
        spec = SpawnSpec(
            model=model or default_model_path(),
            extra_args=engine_argv(settings.engine),
            startup_timeout=b.backend_startup_timeout,
        )
        sups = [
            BackendSupervisor(spawn=spec, name=f"backend-{i}", request_buffer=b.request_buffer)
            for i in range(b.backends)
        ]
    return BackendPool(sups, wait_timeout=b.backend_wait)


def _banner(gw: Gateway, tenancy: Tenants, settings: Settings) -> str:
    base = f"http://{settings.http.host}:{settings.http.port}"
    name = gw.model_names()[0] if gw.model_names() else "model"
    key = tenancy.default_key
    return (
        f"Gateway ready on {base} (model {name!r}, backends: {', '.join(s.url for s in gw.pool.supervisors)})\n"
        f'  curl {base}/v1/chat/completions -H "Authorization: Bearer $API_KEY" '
        f"-H 'Content-Type: application/json' "
        f'-d \'{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 100}}\'\n'
        + (
            f"  API_KEY={key}  (tenant 'default', created now; shown once)"
            if key
            else "  API_KEY: a tenant key (create one: POST /admin/v1/tenants/{id}/keys with the admin key)"
        )
    )


async def serve(settings: Settings) -> None:
    """Run the gateway until SIGINT/SIGTERM (see module docstring)."""
    model = settings.backend.model
    if model is None and not settings.backend.backend_url:
        model = default_model_path()
    pool = backend_pool(settings, model)
    async with trio.open_nursery() as nursery:
        shutdown = trio.Event()
        nursery.start_soon(_signals, shutdown, pool, nursery.cancel_scope)
        await nursery.start(pool.run)
        card = pool.card
        tok_path = settings.backend.tokenizer or model or (card.model_path if card else None)
        tokenizer = await trio.to_thread.run_sync(cached_tokenizer, tok_path)
        template = ChatTemplate(tokenizer, card.chat_template if card and card.chat_template else None)
        t = settings.tenancy
        tenancy = Tenants(t.db, redis_url=t.redis_url, admin_key=t.admin_key)
        await tenancy.start(nursery)
        obs = settings.observability
        metrics = GatewayMetrics(card.name if card else "", tenant_label=obs.metrics_tenant_label)
        metrics.set_stats_source(pool.stats)
        configure_access_log(obs.access_log)
        gw = Gateway(
            settings, pool, tokenizer, template, tenancy=tenancy, filters=TenantFilters(), metrics=metrics
        )
        app = build_app(gw)

        hc = Config()
        hc.bind = [f"{settings.http.host}:{settings.http.port}"]
        hc.graceful_timeout = (
            1.0  # after the drain gate's drain: closes idle connections, cancels what ran over
        )
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        hc.keep_alive_timeout = 75
        done = trio.Event()

        async def drained() -> None:  # hypercorn's shutdown trigger: signal, then in-flight requests done
            await shutdown.wait()
            with trio.move_on_after(settings.http.drain_timeout):
                await app.drain.idle()

        async def http(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await hyper_serve(app, hc, shutdown_trigger=drained, task_status=task_status)
            finally:
                done.set()

        bound = await nursery.start(http)
        print(_banner(gw, tenancy, settings), flush=True)
        log.info("listening on %s", bound)
        await done.wait()
        log.info("HTTP server stopped; stopping backends")
        with trio.move_on_after(15):
            await pool.stop(grace=10.0)
        with trio.move_on_after(10):
            await tenancy.aclose()  # flush the usage ledger
        nursery.cancel_scope.cancel()


DUPLICATE_SIGNAL_S = 1.0  # a second signal sooner than this after the first is the same request to stop


async def _signals(shutdown: trio.Event, pool: BackendPool, scope: trio.CancelScope) -> None:
    first = 0.0
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
        async for sig in sigs:
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
            pool.draining = True
            shutdown.set()


def main(argv: list[str] | None = None) -> int:
    """``python -m gateway serve [options]``; 2 on bad settings (message on stderr), 0 after a drain."""
    try:
        settings, notices = load_settings(argv, os.environ)
    except SettingsError as exc:
        print(f"python -m gateway serve: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)
    for notice in notices:
        log.warning("%s", notice)
    trio.run(partial(serve, settings))
    return 0
