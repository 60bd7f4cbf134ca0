"""``RequestRecord``: what is known about one HTTP request, and ``RecordObserver``, which fills it from the
events of the request's generation run (``gateway.generation.events``).

``ObservabilityMiddleware`` (``gateway.observability.middleware``) creates the record on arrival and, at the
end, writes it as the access-log line and hands it to ``GatewayMetrics.finish_request``. In between only
the generation run's events fill it (nothing reads the response bytes back)::

    TextDelta with tokens   on_tokens: TTFT (once), inter-token gaps, output text (``--log-content`` only)
    ChoiceFinished          on_timings: backend phases of that choice (max over choices)
    Ended                   on_ended: tokens (the count billed), finish reason ("abort" / "error" decided by
                            the run) and why an abort ended ("client_disconnect", "slow_reader"), errors

and whoever renders an ``APIError`` outside a run calls ``set_error`` (the exception handlers, the auth
middleware). Times are ``time.perf_counter()`` seconds; the log gives seconds (``*_s`` fields, float) and
the wall-clock arrival time as ISO-8601 UTC.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import UTC, datetime
from typing import Any, Protocol

import msgspec
from starlette.requests import HTTPConnection

from gateway.generation.events import ChoiceFinished, Ended, Event, TextDelta
from gateway.generation.request import GenerationRequest

SCOPE_KEY = "gateway.obs"  # ASGI scope key holding the RequestRecord

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


class LatencyObserver(Protocol):
    """Where TTFT and inter-token gaps go as they happen (``GatewayMetrics``); seconds."""

    def observe_ttft(self, rec: RequestRecord, seconds: float) -> None: ...

    def observe_itl(self, rec: RequestRecord, seconds: float) -> None: ...


class RequestRecord:
    """What is known about one HTTP request; filled by the middleware and the request's run.

    Attributes (seconds are ``perf_counter`` differences):
        request_id: kept from ``x-request-id`` or made by the middleware.
        method, path: of the HTTP request; route: the path if it is a known route, else "other".
        api: "openai" or "ollama" (set from the run's request; None for other routes).
        tenant: tenant id (never a key); model: served model name (the model's, for an alias); stream: bool.
        status: HTTP status sent (None until the response starts).
        prompt_tokens, completion_tokens, cached_tokens: tokens (completion summed over choices).
        finish_reason: of the request, as its run decided it (``Ended.reason``); abort_reason: why a request
            the client left or stopped reading ended ("client_disconnect", "slow_reader"), else None.
        client_gone: the client went away before a status line was sent (the status recorded is then 499).
        queue_s, prefill_s, decode_s, backend_ttft_s: backend phases (max over choices).
        preemptions: times the backend preempted this request.
        draft_tokens, accepted_tokens: speculative decoding: draft tokens proposed for the request and those
            accepted (summed over choices; None until the backend's timings arrived).
        error_type, error_code: of the ``APIError`` rendered, if any.
        itl_sum_s, itl_count: sum (seconds) and number of the inter-token gaps, one per token-carrying output
            after the first.
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
        self.t_first_token: float | None = None
        self.t_last_token: float | None = None
        self.t_end: float | None = None
        self.submitted = False  # the request reached a backend
        self.api: str | None = None
        self.tenant: str | None = None
        self.model: str | None = None
        self.stream: bool | None = None
        self.status: int | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int = 0
        self.cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.abort_reason: str | None = None
        self.client_gone = False
        self.queue_s: float | None = None
        self.prefill_s: float | None = None
        self.decode_s: float | None = None
        self.backend_ttft_s: float | None = None
        self.preemptions = 0
        self.draft_tokens: int | None = None
        self.accepted_tokens: int | None = None
        self.error_type: str | None = None
        self.error_code: str | None = None
        self.itl_sum_s = 0.0  # inter-token gaps: their sum and count (the access log shows the mean)
        self.itl_count = 0
        self.log_content = log_content
        self.prompt_text: str | None = None
        self.output_parts: list[str] = []
        self.latency: LatencyObserver | None = None  # set by the middleware; TTFT/ITL observed live

    # ------------------------------------------------------------------ filled by the run's events

    def set_prompt(self, prompt: object) -> None:
        """Keep the prompt (str, or chat messages) for the log; a no-op unless content logging is on."""
        if not self.log_content:
            return
        if isinstance(prompt, str):
            self.prompt_text = prompt
            return
        try:
            self.prompt_text = json.dumps(msgspec.to_builtins(prompt), ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            self.prompt_text = repr(prompt)

    def on_tokens(self, n_tokens: int, text: str | None = None) -> None:
        """New tokens (``n_tokens``; 0 is ignored) and the text sent for them, if any.

        The first such call fixes TTFT (arrival -> now, observed once per request); each later one adds an
        inter-token gap (now - previous).
        """
        if text and self.log_content:
            self.output_parts.append(text)
        if n_tokens <= 0:
            return
        now = time.perf_counter()
        if self.t_first_token is None:
            self.t_first_token = now
            if self.latency is not None:
                self.latency.observe_ttft(self, now - self.t_arrival)
        else:
            gap = now - (self.t_last_token or now)
            self.itl_sum_s += gap
            self.itl_count += 1
            if self.latency is not None:
                self.latency.observe_itl(self, gap)
        self.t_last_token = now

    def on_timings(self, timings: dict[str, int]) -> None:
        """Backend phases of a finished choice or request (``timings`` in ns, Ollama names); each keeps its
        maximum over choices."""
        for attr, key in _PHASES:
            ns = timings.get(key)
            if ns is not None:
                setattr(self, attr, max(getattr(self, attr) or 0.0, ns / 1e9))

    def on_ended(self, ended: Ended) -> None:
        """The run ended: what it consumed and why it ended, as the run decided it (a 499 before any status
        line was sent marks the client gone)."""
        self.abort_reason = ended.abort_reason
        if ended.status == 499 and self.status is None:
            self.client_gone = True
        if ended.submitted:
            self.submitted = True
            self.prompt_tokens = ended.prompt_tokens
            self.completion_tokens = ended.completion_tokens
            self.cached_tokens = ended.cached_tokens
            self.finish_reason = ended.reason
            self.preemptions = max(self.preemptions, ended.preemptions)
            self.draft_tokens = ended.timings.get("draft_tokens", self.draft_tokens)
            self.accepted_tokens = ended.timings.get("accepted_tokens", self.accepted_tokens)
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
        """The access-log line as a dict (JSON-serialisable; docs/observability.md lists the fields)."""
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
            "abort_reason": self.abort_reason,
            "preemptions": self.preemptions if self.submitted else None,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "e2e_s": _round(self.e2e_s),
            "ttft_s": _round(self.ttft_s),
            "itl_mean_s": _round(self.itl_sum_s / self.itl_count) if self.itl_count else None,
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
    """An ``EventSink`` feeding one run's events into its ``RequestRecord`` (see the module docstring); the
    request's labels are set at construction."""

    def __init__(self, record: RequestRecord, req: GenerationRequest) -> None:
        self.record = record
        record.api, record.stream = req.api, req.stream
        record.model = req.served_name  # an alias: its model's served name
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


def get_record(request_or_scope: HTTPConnection | dict[str, Any]) -> RequestRecord:
    """The ``RequestRecord`` of a Starlette ``Request`` (or ASGI scope dict).

    Outside the middleware (e.g. a unit test calling a handler directly) a detached record is created and
    attached, so callers never need a None check.
    """
    scope = request_or_scope if isinstance(request_or_scope, dict) else request_or_scope.scope
    rec = scope.get(SCOPE_KEY)
    if rec is None:
        rec = RequestRecord(new_request_id(), scope.get("method", ""), scope.get("path", ""))
        scope[SCOPE_KEY] = rec
    return rec
