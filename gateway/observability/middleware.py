"""``ObservabilityMiddleware``: request ids, the HTTP status, the access-log line and the request metrics.

A plain ASGI middleware; wrap the whole Starlette app with it so that even a 500 made by Starlette's
``ServerErrorMiddleware`` passes through it. Per HTTP request it creates the ``RequestRecord`` (in the scope
under ``SCOPE_KEY``), keeps a valid client ``x-request-id`` (1..128 chars of ``[A-Za-z0-9._:/+=@-]``) or
makes one, puts it on the response, notes the status sent, and at the end writes one access-log line and
hands the record to ``GatewayMetrics.finish_request``. It never reads the response body: what a request
consumed, how it ended and which error it got come from its run and whoever rendered the error.

Status recorded: the status line sent; 499 (nginx's "client closed request") when the client went away
before one was sent (an ``http.disconnect`` passed through ``receive`` first, or the run ended as 499),
also if the app answered the gone client afterwards; 500 only when the app ended without answering a
client that was still there. ``e2e_s`` ends with the last body message (bookkeeping after it, such as the
run waiting for the backend's final token count, is not part of the latency).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Sequence

from auth.principal import Principal
from gateway.middleware.asgi import ASGIApp, Message, Receive, Scope, Send
from gateway.observability.access_log import emit_access_log
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.record import SCOPE_KEY, RequestRecord, new_request_id

REQUEST_ID_HEADER = "x-request-id"
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=@\-]{1,128}$")


def valid_request_id(value: str | None) -> bool:
    """Whether a client-supplied ``x-request-id`` is kept (1..128 chars of ``[A-Za-z0-9._:/+=@-]``)."""
    return value is not None and _VALID_REQUEST_ID.match(value) is not None


def _request_id(scope: Scope) -> str:
    for k, v in scope.get("headers") or []:
        if k == b"x-request-id":
            try:
                rid = v.decode("ascii")
            except UnicodeDecodeError:
                break
            return rid if valid_request_id(rid) else new_request_id()
    return new_request_id()


def _principal_tenant(scope: Scope) -> str | None:
    """Tenant id of the principal the auth middleware left in ``scope["state"]["principal"]``, if any."""
    state = scope.get("state")
    principal = state.get("principal") if isinstance(state, dict) else None
    return principal.tenant_id if isinstance(principal, Principal) else None


class ObservabilityMiddleware:
    """See the module docstring.

    Args:
        app: the ASGI app to wrap (the whole Starlette app).
        metrics: a ``GatewayMetrics`` (or None for logging only).
        log_content: keep prompt/output text in the log (debug; off by default).
        known_paths: route paths used as the ``path`` label; others count as "other" (bounded label
            cardinality). Defaults to the paths of ``routes``.
        routes: the route list whose paths count (read again for a path not known yet, so routes added
            later count too); default: the wrapped app's ``routes``, if any (pass the Starlette app's when
            other middleware sits between).
        skip_log_paths: paths not written to the access log (default ``/metrics`` and the health probes).
    """

    def __init__(
        self,
        app: ASGIApp,
        metrics: GatewayMetrics | None = None,
        *,
        log_content: bool = False,
        known_paths: Iterable[str] | None = None,
        routes: Sequence[object] | None = None,
        skip_log_paths: Iterable[str] = ("/metrics", "/health", "/healthz", "/readyz"),
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.log_content = log_content
        self._routes = routes if routes is not None else getattr(app, "routes", None)
        if known_paths is None:
            known_paths = [getattr(r, "path", None) for r in self._routes or []]
        self._known_paths = {p for p in known_paths if p}
        self.skip_log_paths = set(skip_log_paths)

    def route_label(self, path: str) -> str:
        """``path`` if it is a known route, else ``"other"``."""
        if path in self._known_paths:
            return path
        routes = self._routes  # routes added after wrapping count too
        if routes is not None and any(getattr(r, "path", None) == path for r in routes):
            self._known_paths.add(path)
            return path
        return "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _request_id(scope)
        path = scope.get("path", "")
        rec = RequestRecord(
            rid, scope.get("method", ""), path, self.route_label(path), log_content=self.log_content
        )
        rec.latency = self.metrics
        scope[SCOPE_KEY] = rec
        state = scope.setdefault("state", {})
        if isinstance(state, dict):
            state["request_id"] = rid
        rid_header = (b"x-request-id", rid.encode("ascii"))

        async def receive_wrapper() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and rec.status is None:
                rec.client_gone = True
            return message

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in (message.get("headers") or []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, rid_header]}
                rec.status = 499 if rec.client_gone else int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                rec.t_end = time.perf_counter()
            await send(message)

        if self.metrics is not None:
            self.metrics.request_started(rec)
        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        finally:
            if rec.t_end is None:
                rec.t_end = time.perf_counter()
            if rec.tenant is None:
                rec.tenant = _principal_tenant(scope)
            if rec.status is None:  # nothing was sent: the client left first, or the app failed
                rec.status = 499 if rec.client_gone else 500
            try:
                if self.metrics is not None:
                    self.metrics.finish_request(rec)
                if path not in self.skip_log_paths:
                    emit_access_log(rec)
            except Exception:  # never let observability break a response
                logging.getLogger("gateway.observability").exception("observability failed for %s", rid)
