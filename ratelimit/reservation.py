"""Reservation: what one admitted request holds (tokens, one request, one concurrency slot) and what it used.

An :class:`~ratelimit.admission.Admission` creates it on entry and settles it on exit; the request's handler
reports progress (:meth:`Reservation.update`) and its outcome (:meth:`Reservation.finish`) in between.
Units: tokens, UNIX seconds (``started_at``), seconds (``timings``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from .core import Dim, Limits


class Subject(Protocol):
    """Who is admitted: a tenant and the key it called with (``auth.principal.Principal`` is one);
    ``model_limits``: served model name -> the tenant's limits for that model."""

    @property
    def tenant_id(self) -> str: ...
    @property
    def tenant_name(self) -> str: ...
    @property
    def key_id(self) -> str: ...
    @property
    def key_prefix(self) -> str: ...
    @property
    def limits(self) -> Limits: ...
    @property
    def key_limits(self) -> Limits | None: ...
    @property
    def model_limits(self) -> Mapping[str, Limits]: ...


@dataclass(frozen=True)
class RequestCount:
    """A request's rpm charge made before admission (``Admission.count_request``).

    Attributes:
        headers: the ``x-ratelimit-*-requests`` headers after the charge ({} when no rpm applies).
        dims: the rpm dimensions charged (empty: none, or the store did not answer and fail-open admitted).
        member: the charge's id in the limiter (what a refund names).
    """

    headers: dict[str, str]
    dims: list[Dim] = field(default_factory=list)
    member: str = ""


@dataclass(eq=False)
class Reservation:
    """An admitted request's reservation: ``prompt_tokens + max_tokens`` tokens, one request, one slot.

    Attributes:
        headers: ``x-ratelimit-*`` headers as of admission (put them on the response).
        dims: the dimensions reserved; member: the reservation's id in the limiter, unique (the request id, if
            any, and a random suffix).
        status, finish_reason: the outcome billed (set by :meth:`finish`, else when settled: 499 ``abort``
            on cancellation, the error's status and ``error`` on an exception).
        counted: the request was counted before admission (``Admission.count_request``): its rpm headers,
            kept on the response; None: the reservation took the request's rpm unit itself.
    """

    subject: Subject
    dims: list[Dim]
    member: str
    prompt_tokens: int
    max_tokens: int
    model: str | None
    request_id: str | None
    headers: dict[str, str]
    reserved_tokens: int = field(init=False, default=0)
    started_at: float = field(default_factory=time.time)
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    status: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    finished: bool = False
    closed: bool = False
    headers_after: dict[str, str] = field(default_factory=dict)
    counted: dict[str, str] | None = None

    def __post_init__(self) -> None:
        self.reserved_tokens = self.prompt_tokens + self.max_tokens

    def update(
        self,
        *,
        completion_tokens: int | None = None,
        cached_tokens: int | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        """Record progress (tokens so far): what is billed if the request ends without :meth:`finish`."""
        if completion_tokens is not None:
            self.completion_tokens = int(completion_tokens)
        if cached_tokens is not None:
            self.cached_tokens = int(cached_tokens)
        if prompt_tokens is not None:
            self.prompt_tokens = int(prompt_tokens)

    def finish(
        self,
        *,
        completion_tokens: int,
        cached_tokens: int = 0,
        finish_reason: str | None = None,
        status: int = 200,
        timings: dict[str, float] | None = None,
        prompt_tokens: int | None = None,
        model: str | None = None,
    ) -> None:
        """Mark the request complete (tokens; ``timings`` in seconds, e.g. ``{"ttft_s":..,"total_s":..}``).
        Pass ``prompt_tokens=0`` for a request rejected before the backend saw it (nothing billed)."""
        self.update(
            completion_tokens=completion_tokens, cached_tokens=cached_tokens, prompt_tokens=prompt_tokens
        )
        self.finish_reason = finish_reason
        self.status = status
        if timings:
            self.timings.update(timings)
        if model is not None:
            self.model = model
        self.finished = True

    def settle(self, error_status: int | None) -> None:
        """Close the record: without :meth:`finish`, the outcome is 499 ``abort`` (``error_status`` None: the
        client went away or the block ended early) or ``error_status`` with ``error``; ``total_s`` is set."""
        self.closed = True
        if not self.finished:
            self.status, self.finish_reason = (
                (499, "abort") if error_status is None else (error_status, "error")
            )
        self.timings.setdefault("total_s", round(time.time() - self.started_at, 6))

    @property
    def used_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def refund(self) -> int:
        """Tokens reserved and not used (negative: used more than reserved), given back at the end."""
        return self.reserved_tokens - self.used_tokens

    @property
    def final_headers(self) -> dict[str, str]:
        """``x-ratelimit-*`` after the true-up (before it: the admission's)."""
        return dict(self.headers_after if self.closed else self.headers)
