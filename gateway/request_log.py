"""Per-request observation record, request ids, and the JSON access log.

One ``RequestRecord`` follows each HTTP request from arrival to the last byte
sent. ``ObservabilityMiddleware`` (a plain ASGI middleware; wrap the whole
Starlette app with it so that even a 500 made by Starlette's
``ServerErrorMiddleware`` passes through it) creates the record, keeps or
makes the ``x-request-id``, puts the id on every response, counts the HTTP
status, and at the end writes one JSON line on the ``gateway.access`` logger
and hands the record to ``GatewayMetrics.finish_request``.

The request pipeline fills in what only it knows, with a handful of calls::

    rec = get_record(request)            # starlette Request or ASGI scope; never None under the middleware
    rec.tenant = tenant_id               # after auth (an id, never the key)
    rec.model = model_name; rec.stream = stream
    rec.set_prompt(messages)             # kept only with --log-content
    rec.on_submit(len(prompt_ids))       # just before BackendClient.submit (prompt tokens)
    rec.on_tokens(len(out.new_token_ids), text=delta_text)   # per RequestOutput with tokens
    rec.on_finish(out.finish_reason, out.usage, out.timings) # per finished choice

Log line fields (all optional ones are ``null`` when unknown): see
``RequestRecord.log_fields`` and docs/observability.md. The line never holds
an API key (no header is ever logged) and holds prompt or output text only
when content logging was switched on explicitly (``--log-content``).

Times are ``time.perf_counter()`` seconds internally; the log gives seconds
(``*_s`` fields, float) and the wall-clock arrival time as ISO-8601 UTC.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from gateway.generation.events import ChoiceFinished, Ended, Event, TextDelta
from gateway.generation.request import GenerationRequest

if TYPE_CHECKING:  # pragma: no cover
    from backend.protocol import Timings, Usage
    from gateway.metrics import GatewayMetrics

ACCESS_LOGGER_NAME = "gateway.access"
REQUEST_ID_HEADER = "x-request-id"
SCOPE_KEY = "gateway.obs"  # ASGI scope key holding the RequestRecord
_MAX_ERROR_BODY = 64 * 1024  # bytes of an error body read to find error.code/type
# Sent by the pipeline when an output filter cut a response (OpenAI ``finish_reason``, Ollama ``done_reason``);
# JSON-escaped model text cannot contain it (its quotes would be ``\"``).
_CUT_MARK = b'_reason":"content_filter"'
# A client-supplied id is kept when it is 1..128 chars of this safe set; otherwise a new one is made.
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=@\-]{1,128}$")

access_logger = logging.getLogger(ACCESS_LOGGER_NAME)
# RequestRecord attribute (seconds) <- timings key (ns) of the backend phases
_PHASES = (
    ("queue_s", "queue_duration"),
    ("prefill_s", "prompt_eval_duration"),
    ("decode_s", "eval_duration"),
    ("backend_ttft_s", "backend_ttft_duration"),
)


def new_request_id() -> str:
    """A fresh request id: ``req-`` + 32 hex digits (uuid4)."""
    return "req-" + uuid.uuid4().hex


def valid_request_id(value: str | None) -> bool:
    """Whether a client-supplied ``x-request-id`` is kept (1..128 chars of ``[A-Za-z0-9._:/+=@-]``)."""
    return bool(value) and _VALID_REQUEST_ID.match(value) is not None  # type: ignore[arg-type]


class RequestRecord:
    """What is known about one HTTP request; filled by the middleware and the request pipeline.

    Attributes (seconds are ``perf_counter`` differences):
        request_id: kept from ``x-request-id`` or made by ``new_request_id``.
        method, path: of the HTTP request; route: the path if it is a known route, else "other".
        api: "openai" or "ollama" (set by the handler; None for other routes).
        tenant: tenant id (never a key); model: served model name; stream: bool.
        status: HTTP status sent (None until the response starts).
        prompt_tokens, completion_tokens, cached_tokens: tokens (completion summed over choices).
        finish_reason: of the request (the last choice's; "abort" when the client went away).
        queue_s, prefill_s, decode_s, backend_ttft_s: backend ``Timings`` (max over choices).
        preemptions: times the backend preempted this request.
        error_type, error_code: of the error body sent, if any.
        itl_s: inter-token gaps, one per token-carrying output after the first (seconds).
    """

    def __init__(
        self, request_id: str, method: str = "", path: str = "", route: str = "", *, log_content: bool = False
    ) -> None:
        self.request_id = request_id
        self.method = method
        self.path = path
        self.route = route or path
        self.wall_arrival = time.time()
        self.t_arrival = time.perf_counter()
        self.t_submit: float | None = None
        self.t_first_token: float | None = None
        self.t_last_token: float | None = None
        self.t_end: float | None = None
        self.api: str | None = None
        self.tenant: str | None = None
        self.model: str | None = None
        self.stream: bool | None = None
        self.status: int | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int = 0
        self.cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.finished_choices = 0
        self.queue_s: float | None = None
        self.prefill_s: float | None = None
        self.decode_s: float | None = None
        self.backend_ttft_s: float | None = None
        self.preemptions = 0
        self.error_type: str | None = None
        self.error_code: str | None = None
        self.itl_s: list[float] = []
        self.n_token_outputs = 0
        self.tokens_seen = 0  # tokens received in outputs (all choices)
        self._usage_completion = 0
        self.log_content = log_content
        self.prompt_text: str | None = None
        self.output_parts: list[str] = []
        self.metrics: GatewayMetrics | None = None  # set by the middleware; TTFT/ITL observed live
        self.finalized = False

    # ------------------------------------------------------------------ pipeline hooks

    @property
    def submitted(self) -> bool:
        """True once the request was handed to the backend (``on_submit`` or any output)."""
        return self.t_submit is not None

    def set_prompt(self, prompt: Any) -> None:
        """Keep the prompt (str, or chat messages) for the log; a no-op unless content logging is on."""
        if not self.log_content:
            return
        if isinstance(prompt, str):
            self.prompt_text = prompt
            return
        try:
            import msgspec

            prompt = msgspec.to_builtins(prompt)  # chat messages may be msgspec structs
        except Exception:  # noqa: BLE001
            pass
        try:
            self.prompt_text = json.dumps(prompt, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            self.prompt_text = repr(prompt)

    def on_submit(self, prompt_tokens: int | None = None) -> None:
        """Mark the hand-over to the backend (call once, just before ``submit``), with the prompt length (tokens).

        Giving ``prompt_tokens`` here lets an aborted request (which gets no
        final ``Usage``) still count its prompt; a later ``Usage`` overrides it.
        """
        if self.t_submit is None:
            self.t_submit = time.perf_counter()
        if prompt_tokens is not None and self.prompt_tokens is None:
            self.prompt_tokens = prompt_tokens

    def on_tokens(self, n_tokens: int, text: str | None = None) -> None:
        """One backend output carrying ``n_tokens`` new tokens (0 is ignored) and its text, if any.

        The first such call fixes TTFT (arrival -> now, observed once per
        request); each later one adds an inter-token gap (now - previous).
        """
        if text and self.log_content:
            self.output_parts.append(text)
        if n_tokens <= 0:
            return
        self.tokens_seen += n_tokens
        now = time.perf_counter()
        if self.t_submit is None:
            self.t_submit = now
        if self.t_first_token is None:
            self.t_first_token = now
            if self.metrics is not None:
                self.metrics.observe_ttft(self, now - self.t_arrival)
        else:
            gap = now - (self.t_last_token or now)
            self.itl_s.append(gap)
            if self.metrics is not None:
                self.metrics.observe_itl(self, gap)
        self.t_last_token = now
        self.n_token_outputs += 1

    def add_output_text(self, text: str) -> None:
        """Add generated text for the content log without counting tokens (no-op unless --log-content)."""
        if text and self.log_content:
            self.output_parts.append(text)

    def on_finish(
        self, finish_reason: str | None, usage: Usage | None = None, timings: Timings | None = None
    ) -> None:
        """One choice finished: its finish reason, ``Usage`` (tokens) and ``Timings`` (seconds).

        prompt/cached tokens are taken once; completion tokens add up over
        choices; timings keep the maximum over choices.
        """
        if self.t_submit is None:
            self.t_submit = time.perf_counter()
        self.finished_choices += 1
        if finish_reason:
            self.finish_reason = finish_reason
        if usage is not None:
            self.prompt_tokens = usage.prompt_tokens
            self.cached_tokens = max(self.cached_tokens or 0, getattr(usage, "cached_tokens", 0) or 0)
            self._usage_completion += usage.completion_tokens
            self.completion_tokens = max(self._usage_completion, self.tokens_seen)
        if timings is not None:
            self.queue_s = max(self.queue_s or 0.0, timings.queue)
            self.prefill_s = max(self.prefill_s or 0.0, timings.prefill)
            self.decode_s = max(self.decode_s or 0.0, timings.decode)
            self.backend_ttft_s = max(self.backend_ttft_s or 0.0, timings.ttft)
            self.preemptions = max(self.preemptions, timings.preemptions)

    def on_timings(self, timings: dict[str, int]) -> None:
        """Backend phases of a finished choice or request (``timings`` in ns, Ollama names); each keeps
        its maximum over choices."""
        for attr, key in _PHASES:
            ns = timings.get(key)
            if ns is not None:
                setattr(self, attr, max(getattr(self, attr) or 0.0, ns / 1e9))

    def on_ended(self, ended: Ended) -> None:
        """The generation run ended (``gateway.generation.events.Ended``): what it consumed and why it
        ended, decided by the run."""
        if ended.submitted:
            if self.t_submit is None:
                self.t_submit = time.perf_counter()
            self.prompt_tokens = ended.prompt_tokens
            self.completion_tokens = ended.completion_tokens
            self.cached_tokens = ended.cached_tokens
            self.finish_reason = ended.reason
            self.preemptions = max(self.preemptions, ended.preemptions)
            self.on_timings(ended.timings)
        if ended.error_type is not None or ended.error_code is not None:
            self.set_error(ended.error_type, ended.error_code)

    def set_error(self, error_type: str | None, error_code: str | None) -> None:
        """Record the error type/code sent (the message is never logged)."""
        self.error_type = error_type
        self.error_code = error_code

    # ------------------------------------------------------------------ derived

    @property
    def ttft_s(self) -> float | None:
        """Gateway-side time to first token: arrival -> first token-carrying output, seconds."""
        return None if self.t_first_token is None else self.t_first_token - self.t_arrival

    @property
    def e2e_s(self) -> float:
        """Arrival -> end of response (or now), seconds."""
        return (self.t_end or time.perf_counter()) - self.t_arrival

    def log_fields(self) -> dict[str, Any]:
        """The access-log line as a dict (JSON-serialisable)."""
        d: dict[str, Any] = {
            "ts": datetime.fromtimestamp(self.wall_arrival, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "api": self.api,
            "tenant": self.tenant,
            "model": self.model,
            "stream": self.stream,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens if self.submitted else None,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "preemptions": self.preemptions if self.submitted else None,
            "e2e_s": _round(self.e2e_s),
            "ttft_s": _round(self.ttft_s),
            "itl_mean_s": _round(sum(self.itl_s) / len(self.itl_s)) if self.itl_s else None,
            "queue_s": _round(self.queue_s),
            "prefill_s": _round(self.prefill_s),
            "decode_s": _round(self.decode_s),
            "error_type": self.error_type,
            "error_code": self.error_code,
        }
        if self.log_content:
            d["prompt"] = self.prompt_text
            d["output"] = "".join(self.output_parts) if self.output_parts else None
        return d


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


class RecordObserver:
    """An ``EventSink`` feeding one generation run's events into its ``RequestRecord``: the request's
    labels at construction, TTFT/ITL per ``TextDelta`` carrying tokens, the outcome from ``Ended``."""

    def __init__(self, record: RequestRecord, req: GenerationRequest) -> None:
        self.record = record
        record.api = record.api or req.api  # a translating route may have labelled it already
        record.model, record.stream = req.model, req.stream
        record.tenant = req.tenant_id or None
        record.set_prompt(req.prompt_log)  # kept only with --log-content

    async def emit(self, event: Event) -> None:
        try:
            if isinstance(event, TextDelta):
                self.record.on_tokens(event.tokens, text=event.text or None)
            elif isinstance(event, ChoiceFinished):
                self.record.on_timings(event.timings)
            elif isinstance(event, Ended):
                self.record.on_ended(event)
        except Exception:  # noqa: BLE001 - observability must never break a request
            logging.getLogger("gateway.observability").exception("request record update failed")


def get_record(request_or_scope: Any) -> RequestRecord:
    """The ``RequestRecord`` of a Starlette ``Request`` (or ASGI scope dict).

    Outside the middleware (e.g. a unit test calling a handler directly) a
    detached record is created and attached, so callers never need a None check.
    """
    scope = request_or_scope if isinstance(request_or_scope, dict) else request_or_scope.scope
    rec = scope.get(SCOPE_KEY)
    if rec is None:
        rec = RequestRecord(new_request_id(), scope.get("method", ""), scope.get("path", ""))
        scope[SCOPE_KEY] = rec
    return rec


def emit_access_log(rec: RequestRecord) -> None:
    """Write the record as one compact JSON line on the ``gateway.access`` logger (INFO)."""
    if access_logger.isEnabledFor(logging.INFO):
        access_logger.info(json.dumps(rec.log_fields(), ensure_ascii=False, separators=(",", ":")))


def configure_access_log(destination: str | None = "-", level: int = logging.INFO) -> logging.Handler | None:
    """Send ``gateway.access`` lines, message only, to stderr (``"-"``), a file path, or nowhere (None/"off").

    Returns the handler installed (None when switched off). Idempotent per destination.
    """
    logger = logging.getLogger(ACCESS_LOGGER_NAME)
    for h in list(logger.handlers):
        if getattr(h, "_gateway_access", False):
            logger.removeHandler(h)
            h.close()
    logger.propagate = False
    if destination in (None, "", "off", "none"):
        logger.setLevel(logging.CRITICAL + 1)
        return None
    handler: logging.Handler = (
        logging.StreamHandler(sys.stderr)
        if destination == "-"
        else logging.FileHandler(destination, encoding="utf-8")
    )
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler._gateway_access = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


def _content_error_fields(body: bytes) -> tuple[str | None, str | None]:
    """(type, code) of an OpenAI-shaped ``{"error": {...}}`` body, or of an Ollama ``{"error": str, "type", "code"}`` one."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None, None
    if not isinstance(obj, dict):
        return None, None
    err = obj.get("error")
    if isinstance(err, dict):
        return _str_or_none(err.get("type")), _str_or_none(err.get("code"))
    return _str_or_none(obj.get("type")), _str_or_none(obj.get("code"))


def _principal_tenant(scope: dict) -> str | None:
    """Tenant id of the principal an auth middleware left in ``scope["state"]["principal"]``, if any."""
    state = scope.get("state")
    principal = state.get("principal") if isinstance(state, dict) else None
    if principal is None:
        return None
    for attr in ("tenant_id", "tenant"):
        v = getattr(principal, attr, None)
        if isinstance(v, str):
            return v
        if v is not None and isinstance(getattr(v, "id", None), str):
            return v.id
    return None


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) else None


class ObservabilityMiddleware:
    """ASGI middleware: request id, HTTP-status metrics, the access log, and request metrics.

    Args:
        app: the ASGI app to wrap (wrap the whole Starlette app: outermost).
        metrics: a ``GatewayMetrics`` (or None for logging only).
        log_content: keep prompt/output text in the log (debug; off by default).
        known_paths: route paths used as the ``path`` label; others count as "other"
            (bounded label cardinality). Defaults to the wrapped app's ``routes``, if any.
        skip_log_paths: paths not written to the access log (default ``/metrics`` and the health probes).

    Every ``http`` response carries ``x-request-id``: the client's if valid, else a new one.
    """

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        metrics: GatewayMetrics | None = None,
        *,
        log_content: bool = False,
        known_paths: Iterable[str] | None = None,
        skip_log_paths: Iterable[str] = ("/metrics", "/health", "/healthz", "/readyz"),
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.log_content = log_content
        if known_paths is None:
            known_paths = [getattr(r, "path", None) for r in getattr(app, "routes", []) or []]
        self._known_paths = {p for p in known_paths if p}
        self.skip_log_paths = set(skip_log_paths)

    def __getattr__(self, name: str) -> Any:
        # Transparent wrapper: ``.state``, ``.routes``, ``.router``... are the wrapped app's.
        if name == "app":
            raise AttributeError(name)
        return getattr(self.app, name)

    def route_label(self, path: str) -> str:
        """``path`` if it is a known route, else ``"other"``."""
        if path in self._known_paths:
            return path
        routes = getattr(self.app, "routes", None)  # routes added after wrapping count too
        if routes is not None and any(getattr(r, "path", None) == path for r in routes):
            self._known_paths.add(path)
            return path
        return "other"

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for k, v in scope.get("headers") or []:
            if k == b"x-request-id":
                try:
                    rid = v.decode("ascii")
                except UnicodeDecodeError:
                    rid = None
                break
        if not valid_request_id(rid):
            rid = new_request_id()
        path = scope.get("path", "")
        rec = RequestRecord(
            rid, scope.get("method", ""), path, self.route_label(path), log_content=self.log_content
        )
        rec.metrics = self.metrics
        scope[SCOPE_KEY] = rec
        scope.setdefault("state", {})
        try:
            scope["state"]["request_id"] = rid
        except TypeError:  # pragma: no cover - exotic state object
            pass
        rid_bytes = rid.encode("ascii")
        error_body = bytearray()
        capture = False
        response_started = False
        content_cut = False  # a "..._reason":"content_filter" was sent (output filter cut the response)

        async def send_wrapper(message: dict) -> None:
            nonlocal capture, response_started, content_cut
            t = message["type"]
            if t == "http.response.start":
                response_started = True
                headers = [(k, v) for k, v in (message.get("headers") or []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", rid_bytes))
                message = {**message, "headers": headers}
                rec.status = int(message["status"])
                capture = rec.status >= 400
            elif t == "http.response.body":
                body = message.get("body", b"")
                if capture:
                    if len(error_body) < _MAX_ERROR_BODY:
                        error_body.extend(body[: _MAX_ERROR_BODY - len(error_body)])
                elif _CUT_MARK in body:
                    content_cut = True
            await send(message)

        if self.metrics is not None:
            self.metrics.request_started(rec)
        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException:
            if rec.status is None:
                rec.status = 500
            raise
        finally:
            rec.t_end = time.perf_counter()
            if rec.tenant is None:
                rec.tenant = _principal_tenant(scope)
            if rec.status is None:
                rec.status = 500 if not response_started else rec.status
            if error_body and rec.error_type is None and rec.error_code is None:
                rec.error_type, rec.error_code = _content_error_fields(bytes(error_body))
            if content_cut:
                rec.finish_reason = "content_filter"
            if rec.submitted and rec.finish_reason is None:
                # The response ended (client gone, cancelled, or failed) before the backend finished it.
                rec.finish_reason = "abort" if (rec.status or 500) < 400 else "error"
            rec.completion_tokens = max(rec.completion_tokens, rec.tokens_seen)
            rec.finalized = True
            try:
                if self.metrics is not None:
                    self.metrics.finish_request(rec)
                if path not in self.skip_log_paths:
                    emit_access_log(rec)
            except Exception:  # never let observability break a response
                logging.getLogger("gateway.observability").exception("observability failed for %s", rid)
