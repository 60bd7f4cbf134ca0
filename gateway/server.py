"""``python -m gateway serve``: start (or connect to) backends, then serve HTTP with hypercorn's Trio worker.

Lifecycle:
1. Backends: without ``--backend-url`` one ``python -m backend --model PATH --listen unix:SOCK`` is spawned
   (socket in a temp dir; unknown CLI options and ``--dtype`` are passed through); with one or more
   ``--backend-url`` the gateway connects to them. The gateway waits for the first ``Ready``.
2. Text: tokenizer + chat template loaded from ``--tokenizer``, else ``--model``, else the backend's
   ``ModelCard.model_path``.
3. HTTP: ``hypercorn.trio.serve`` on ``--host``/``--port``; a curl example is printed when ready.
4. SIGINT/SIGTERM: drain. The listener stays open and every new request (new connection or kept-alive)
   is answered 503 ``server_shutting_down`` with ``Retry-After`` and ``Connection: close`` (``DrainGate``;
   /health and /healthz 200, /readyz 503, /metrics and /admin/v1/stats still answer), while in-flight requests run on for up to ``--drain-timeout`` seconds; when
   the last one ends (or the time is up) hypercorn stops (1 s more grace, then the rest is cancelled),
   then backends get ``Shutdown`` (bounded wait, then SIGKILL). A second signal exits at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from functools import partial
from typing import Any

import msgspec
import trio

from gateway.app import build_app
from gateway.backends.pool import BackendPool
from gateway.backends.request import DEFAULT_REQUEST_BUFFER
from gateway.backends.supervisor import BackendSupervisor, SpawnSpec
from gateway.middleware.drain import DrainGate
from gateway.state import Gateway, GatewayConfig

log = logging.getLogger("gateway")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gateway", description="OpenAI-compatible LLM gateway")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the HTTP API (unknown options are passed to the spawned backend)")
    s.add_argument("--model", help="model path (GGUF file or HF dir); default: the default model")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--backend-url",
        action="append",
        default=[],
        metavar="URL",
        help="unix:PATH or tcp://HOST:PORT of a running backend (repeatable); no backend is spawned",
    )
    s.add_argument(
        "--backends", type=int, default=1, help="backend processes to spawn (without --backend-url)"
    )
    s.add_argument(
        "--admin-key",
        default=os.environ.get("GATEWAY_ADMIN_KEY"),
        help="admin bearer key (env GATEWAY_ADMIN_KEY)",
    )
    s.add_argument("--db", default=None, help="tenancy database path (SQLite)")
    s.add_argument("--redis-url", default=None, help="Redis URL for shared rate limits")
    s.add_argument(
        "--dtype",
        default=None,
        help="compute dtype of spawned backends (default: bfloat16, the fast mode; float32: the exact mode)",
    )
    s.add_argument("--tokenizer", default=None, help="tokenizer/template source (default: the model)")
    s.add_argument(
        "--served-model-name", action="append", default=[], help="extra accepted model name (repeatable)"
    )
    s.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    s.add_argument(
        "--sse-heartbeat", type=float, default=5.0, help="seconds between ': ping' comments while waiting"
    )
    s.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on shutdown"
    )
    s.add_argument(
        "--backend-wait", type=float, default=30.0, help="seconds a request waits for a restarting backend"
    )
    s.add_argument("--backend-startup-timeout", type=float, default=600.0)
    s.add_argument(
        "--request-buffer",
        type=int,
        default=DEFAULT_REQUEST_BUFFER,
        help="backend outputs buffered per request before a slow client is aborted",
    )
    s.add_argument(
        "--thread-tokenize-chars",
        type=int,
        default=8192,
        help="prompts longer than this (characters) are templated/tokenized in a worker thread; 0: never",
    )
    s.add_argument("--log-level", default="INFO")
    from gateway import (
        metrics,
        request_log,
    )  # observability flags: --metrics-tenant-label, --access-log, --log-content

    metrics.add_cli_args(s)
    request_log.add_cli_args(s)
    return p


def _optional(name: str) -> Any:
    """Import an optional module of another area; None if it has not landed."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if exc.name and name.endswith(exc.name.split(".")[-1]):
            return None
        raise


async def serve(args: argparse.Namespace, passthrough: list[str]) -> None:
    """Run the gateway until SIGINT/SIGTERM (see module docstring)."""
    from templating import ChatTemplate, cached_tokenizer

    model = args.model
    if not args.backend_url and model is None:
        from backend.model_path import default_model_path

        model = default_model_path()
    extra = list(passthrough)
    if args.dtype:
        extra += ["--dtype", args.dtype]
    if args.backend_url:
        sups = [
            BackendSupervisor(url=u, name=f"backend-{i}", request_buffer=args.request_buffer)
            for i, u in enumerate(args.backend_url)
        ]
    else:
        spec = SpawnSpec(model=model, extra_args=extra, startup_timeout=args.backend_startup_timeout)
        sups = [
            BackendSupervisor(spawn=spec, name=f"backend-{i}", request_buffer=args.request_buffer)
            for i in range(max(1, args.backends))
        ]
    pool = BackendPool(sups, wait_timeout=args.backend_wait)
    config = GatewayConfig(
        max_body_bytes=args.max_body_bytes,
        heartbeat_s=args.sse_heartbeat,
        backend_wait_s=args.backend_wait,
        admin_key=args.admin_key,
        served_model_names=list(args.served_model_name),
        thread_tokenize_chars=args.thread_tokenize_chars,
        metrics_tenant_label=args.metrics_tenant_label,
        log_content=args.log_content,
        access_log=args.access_log,
    )

    async with trio.open_nursery() as nursery:
        shutdown = trio.Event()
        nursery.start_soon(_signals, shutdown, pool, nursery.cancel_scope)
        await nursery.start(pool.run)
        card = pool.card
        tok_path = args.tokenizer or model or (card.model_path if card else None)
        tokenizer = await trio.to_thread.run_sync(cached_tokenizer, tok_path)
        template = ChatTemplate(tokenizer, card.chat_template if card and card.chat_template else None)
        gw = Gateway(config, pool, tokenizer, template)
        extra_routes, middleware = await _plugins(gw, args, nursery)
        gate = DrainGate(build_app(gw, extra_routes=extra_routes, middleware=middleware), pool)
        asgi = _wrap(gate, gw)

        from hypercorn.config import Config
        from hypercorn.trio import serve as hyper_serve

        hc = Config()
        hc.bind = [f"{args.host}:{args.port}"]
        hc.graceful_timeout = 1.0  # after DrainGate's drain: closes idle connections, cancels what ran over
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        hc.keep_alive_timeout = 75
        done = trio.Event()

        async def drained() -> None:  # hypercorn's shutdown trigger: signal, then in-flight requests done
            await shutdown.wait()
            with trio.move_on_after(args.drain_timeout):
                await gate.idle()

        async def http(task_status=trio.TASK_STATUS_IGNORED):
            try:
                await hyper_serve(asgi, hc, shutdown_trigger=drained, task_status=task_status)
            finally:
                done.set()

        bound = await nursery.start(http)
        base = f"http://{args.host}:{args.port}"
        name = gw.model_names()[0] if gw.model_names() else "model"
        print(
            f"Gateway ready on {base} (model {name!r}, backends: {', '.join(s.url for s in sups)})\n"
            f"  curl {base}/v1/chat/completions -H \"Authorization: Bearer $API_KEY\" -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 100}}\'',
            flush=True,
        )
        if gw.tenancy is not None:
            key = gw.tenancy.default_key
            print(
                f"  API_KEY={key}  (tenant 'default', created now; shown once)"
                if key
                else "  API_KEY: a tenant key (create one: POST /admin/v1/tenants/{id}/keys with the admin key)",
                flush=True,
            )
        log.info("listening on %s", bound)
        await done.wait()
        log.info("HTTP server stopped; stopping backends")
        with trio.move_on_after(15):
            await pool.stop(grace=10.0)
        if gw.tenancy is not None:
            with trio.move_on_after(10):
                await gw.tenancy.aclose()  # flush the usage ledger
        nursery.cancel_scope.cancel()


async def _plugins(gw: Gateway, args: argparse.Namespace, nursery: trio.Nursery) -> tuple[list, list]:
    """Wire in the other areas' parts: tenancy (auth, admission, admin API, usage ledger; started in
    ``nursery``), per-tenant content filters, and the playground (``/`` + ``/static``)."""
    from starlette.middleware import Middleware
    from starlette.responses import FileResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    from gateway.admin.routes import admin_routes, usage_routes
    from gateway.filters import TenantFilters
    from gateway.middleware.auth import AuthMiddleware
    from gateway.openapi import openapi_routes
    from gateway.tenants import DEFAULT_DB_PATH, Tenants

    tenancy = Tenants(args.db or DEFAULT_DB_PATH, redis_url=args.redis_url, admin_key=args.admin_key)
    await tenancy.start(nursery)
    gw.tenancy = tenancy
    gw.filters = TenantFilters()
    static = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")

    async def index(request):
        return FileResponse(os.path.join(static, "index.html"), headers={"cache-control": "no-cache"})

    routes: list = [
        Mount("/admin/v1", routes=admin_routes(tenancy)),
        *openapi_routes(),
        *usage_routes(tenancy),
    ]
    if os.path.isdir(static):
        routes += [
            Route("/", index, methods=["GET"]),
            Mount("/static", StaticFiles(directory=static), name="static"),
        ]
    return routes, [Middleware(AuthMiddleware, tenants=tenancy)]


def _wrap(app: Any, gw: Gateway) -> Any:
    """CORS outermost (preflights answered before auth; error responses get CORS headers too, so a browser client can read a 401 or 429 body)."""
    from gateway.middleware.cors import CORSMiddleware, cors_origins_from_env

    return CORSMiddleware(app, origins=cors_origins_from_env())


async def _signals(shutdown: trio.Event, pool: BackendPool, scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
        async for sig in sigs:
            if shutdown.is_set():
                log.warning("second signal: exiting now")
                scope.cancel()
                return
            log.info("signal %s: draining", signal.Signals(sig).name)
            pool.draining = True
            shutdown.set()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.cmd == "serve":
        if args.backend_url and rest:
            parser.error(
                f"unrecognized arguments (nothing to pass them to with --backend-url): {' '.join(rest)}"
            )
        trio.run(partial(serve, args, rest))
        return 0
    return 2
