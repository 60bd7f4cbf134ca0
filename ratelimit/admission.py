"""Admission: check and reserve every limit of a request at once, true it up at the end, bill the ledger.

A request reserves one request (rpm), ``prompt_tokens + max_tokens`` tokens (tpm and the daily quota, as OpenAI
counts TPM) and one concurrency slot, for its tenant, when the key has limits of its own for its key, and when
the tenant has limits for the request's model (``model_limits[model]``) for that tenant and model: all or
nothing (docs/tenancy.md "Limits and the algorithm")::

    async with admission.admit(principal, prompt_tokens=n, max_tokens=m, model=name, request_id=rid) as res:
        headers = res.headers              # x-ratelimit-* for the response
        res.update(completion_tokens=k)    # while streaming: what is billed if the request ends early
        res.finish(completion_tokens=k, cached_tokens=c, finish_reason="stop", status=200, timings={...})

On exit, however the block ends (normally, by an exception, by cancellation), the unused tokens go back, the
slot is freed, and one ledger row is queued; with Redis that runs cancel-shielded and bounded.

A caller that must refuse work it cannot afford before it knows the token counts (a prompt too large to
render or tokenize) counts the request first, then reserves the rest::

    counted = await admission.count_request(principal, model=name)   # rpm only: 429 when used up
    ...                                                              # a refusal here still counted
    async with admission.admit(principal, ..., counted=counted) as res:  # tokens and slot, no second rpm

A request counted so and then refused (for its size, or by its tokens) keeps its rpm unit, as the OpenAI API
counts unsuccessful requests against the per-minute limit.
Entering raises :class:`~ratelimit.errors.RateLimitExceeded` (429) or
:class:`~ratelimit.errors.LimiterUnavailable` (503, Redis did not answer; whatever it reserved is taken back).

Failure policy (docs/tenancy.md "When Redis fails"): by default a store that does not answer is a 503 with
``retry-after`` (fail closed: nothing is admitted past a limit). With ``fail_open=True`` such a request is
admitted without limits instead: nothing reserved, no ``x-ratelimit-*`` headers, its ledger row written as
usual; one warning per outage (when the first request is let in, and when the store answers again) and
:attr:`Admission.fail_open_admitted` counts them. Only admission fails open: a lease clear is still a 503.

With Redis the concurrency slots are leases that this process renews: run :meth:`Admission.run` in the nursery
that owns the admission (``await nursery.start(admission.run)``); :meth:`Admission.aclose` stops it.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Protocol

import trio

from .core import Dim, DimResult, build_dims, headers_for
from .errors import LimiterUnavailable, RateLimitExceeded, StoreError
from .local import LocalLimiter
from .redis_limiter import RedisLimiter
from .refusal import refusal
from .reservation import RequestCount, Reservation, Subject

log = logging.getLogger("ratelimit.admission")

DAY_S = 86400.0  # a POSIX day
RELEASE_TIMEOUT_S = 5.0  # seconds a shared true-up may take (shielded) before it is logged and dropped
PEEK_TIMEOUT_S = 1.0  # seconds the best-effort x-ratelimit-* headers of a response may wait for Redis
STORE_BACKOFF_S = 1.0  # after Redis failed to answer, seconds during which those headers are not asked for


class UsageBook(Protocol):
    """Where finished requests are billed, and what was billed on a day (``auth.ledger.UsageLedger``)."""

    def record(self, row: dict[str, object]) -> None: ...

    async def tokens_on_day(
        self, *, tenant_id: str | None = None, key_id: str | None = None, day: str, model: str | None = None
    ) -> int:
        """Tokens billed on ``day``; ``model`` is passed only for a model's own daily limit."""
        ...


def model_scope(tenant_id: str, model: str) -> str:
    """The state-key prefix of a tenant's limits for served model ``model``."""
    return f"t:{tenant_id}:m:{model}"


def unavailable() -> LimiterUnavailable:
    """The 503 for a store that did not answer: ``retry-after: 1`` (Redis is usually back within seconds)."""
    return LimiterUnavailable(
        "The rate limiter is unavailable; try again shortly.",
        type="server_error",
        code="rate_limiter_unavailable",
        headers={"retry-after": "1"},
    )


def _no_status(exc: BaseException) -> int:
    return 500


def _why(exc: BaseException, timeout_s: float) -> str:
    """One line for a log: the store's error, or the timeout that passed."""
    return str(exc) if isinstance(exc, StoreError) else f"no reply within {timeout_s:g}s"


class Admission:
    """Limits of one process: the limiter's state, the daily-quota seeds, the ledger rows.

    Args:
        limiter: in-process (:class:`LocalLimiter`) or shared (:class:`RedisLimiter`).
        ledger: bills finished requests; seeds a daily quota the first time this process sees a day.
        error_status: the HTTP status billed for a block that ended by an exception (500 if not told).
        store_timeout_s: seconds one Redis round-trip may take before the request gets 503.
        fail_open: when Redis does not answer, admit without limits instead of a 503 (see the module doc).

    Attributes:
        fail_open_admitted: requests admitted without limits because the store did not answer (a counter).
        fail_open_outages: outages during which requests were admitted so (a counter).
    """

    def __init__(
        self,
        limiter: LocalLimiter | RedisLimiter,
        ledger: UsageBook,
        *,
        error_status: Callable[[BaseException], int] = _no_status,
        store_timeout_s: float = 5.0,
        fail_open: bool = False,
    ) -> None:
        self.limiter = limiter
        self.ledger = ledger
        self.error_status = error_status
        self.store_timeout_s = store_timeout_s
        self.fail_open = fail_open
        self.fail_open_admitted = 0
        self.fail_open_outages = 0
        self._open_outage = False  # requests are being admitted without limits (fail-open, store down)
        self._day_start, self._day_text = -1.0, ""
        self._seeds: dict[str, int] = {}  # daily counter key -> tokens in the ledger when first seen
        self._seed_day = ""
        self._store_failed_at = -math.inf  # trio time of the last Redis call that failed

    async def start(self) -> None:
        """Check that the limiter answers (Redis: ``PING``); raises :class:`StoreError` if not (also in
        fail-open mode: a store that cannot be reached at start is taken for a configuration error)."""
        if isinstance(self.limiter, RedisLimiter):
            await self.limiter.ping()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The limiter's own task (Redis: the lease heartbeat, :meth:`RedisLimiter.run`) until :meth:`aclose`;
        in-process: returns once started. ``await nursery.start(admission.run)``."""
        await self.limiter.run(task_status=task_status)

    async def aclose(self) -> None:
        await self.limiter.aclose()

    def day(self, now: float) -> tuple[str, float]:
        """(UTC day ``YYYY-MM-DD``, seconds until the next UTC midnight) of UNIX time ``now``."""
        start = now - (now % DAY_S)
        if start != self._day_start:
            self._day_start = start
            self._day_text = datetime.fromtimestamp(start, UTC).strftime("%Y-%m-%d")
        return self._day_text, max(0.001, start + DAY_S - now)

    def dims(self, subject: Subject, tokens: int, now: float, model: str | None = None) -> list[Dim]:
        """The dimensions a request of ``tokens`` reserved tokens takes: the tenant's, then the key's, then the
        tenant's for ``model`` (state keys ``t:<tenant>:m:<model>:...``, labelled ``model M of tenant T``)."""
        day, ttl = self.day(now)
        dims = build_dims(
            subject.limits,
            f"t:{subject.tenant_id}",
            f"tenant {subject.tenant_name}",
            tokens=tokens,
            day=day,
            day_ttl_s=ttl,
            ledger={"tenant_id": subject.tenant_id},
        )
        if subject.key_limits is not None:
            dims += build_dims(
                subject.key_limits,
                f"k:{subject.key_id}",
                f"key {subject.key_prefix}...",
                tokens=tokens,
                day=day,
                day_ttl_s=ttl,
                ledger={"key_id": subject.key_id},
            )
        per_model = subject.model_limits.get(model) if model is not None else None
        if per_model is not None:
            dims += build_dims(
                per_model,
                model_scope(subject.tenant_id, model),
                f"model {model} of tenant {subject.tenant_name}",
                tokens=tokens,
                day=day,
                day_ttl_s=ttl,
                ledger={"tenant_id": subject.tenant_id, "model": model},
            )
        return dims

    async def _seed_daily(self, dims: list[Dim], day: str) -> None:
        """Set ``seed`` of daily dimensions: the tokens already billed that day (read once per process and
        day), so a restart does not reset a quota. The limiter uses it only for a counter it does not have."""
        if self._seed_day != day:
            self._seeds.clear()
            self._seed_day = day
            if isinstance(self.limiter, LocalLimiter):
                self.limiter.prune_daily(day)
        for d in dims:
            if d.kind != "daily":
                continue
            seed = self._seeds.get(d.key)
            if seed is None:
                seed = await self.ledger.tokens_on_day(day=day, **d.ledger)
                self._seeds[d.key] = seed
            d.seed = seed

    async def _acquire_shared(
        self, limiter: RedisLimiter, dims: list[Dim], member: str
    ) -> list[DimResult] | None:
        """The results of a shared acquire; None: the store did not answer and ``fail_open`` admits the
        request without limits (what the acquire may have reserved is taken back first)."""
        # one Lua script, shielded so that a cancellation cannot lose a reservation made on the server
        try:
            with trio.CancelScope(shield=True), trio.fail_after(self.store_timeout_s):
                outcome = await limiter.acquire(dims, member)
        except (StoreError, trio.TooSlowError) as e:
            self._store_failed_at = trio.current_time()
            why = _why(e, self.store_timeout_s)
            if not self.fail_open:
                log.error("admission: rate-limit store unavailable: %s", why)
            await self._undo(limiter, dims, member)
            if not self.fail_open:
                raise unavailable() from None
            self.fail_open_admitted += 1
            if not self._open_outage:
                self._open_outage = True
                self.fail_open_outages += 1
                log.warning(
                    "admission: rate-limit store unavailable (%s): admitting requests WITHOUT limits until it "
                    "answers again (fail-open)",
                    why,
                )
            return None
        if self._open_outage:
            self._open_outage = False
            log.warning("admission: rate-limit store answers again: limits apply (fail-open outage over)")
        if not outcome.ok:
            raise refusal(outcome.results)
        return outcome.results

    async def _undo(self, limiter: RedisLimiter, dims: list[Dim], member: str) -> None:
        """The reply to an acquire never came, so the script may have reserved everything anyway: take it back
        if it did (the acquire's marker says so; never refunds what was not taken). Shielded, bounded."""
        with trio.CancelScope(shield=True), trio.move_on_after(max(5.0, self.store_timeout_s)):
            try:
                if await limiter.undo(dims, member):
                    log.warning("admission: took back a reservation whose reply was lost")
            except StoreError as e:
                if not self._open_outage:
                    log.error(
                        "admission: could not take back a possibly-made reservation: %s (it expires with its "
                        "window / lease)",
                        e,
                    )

    async def count_request(
        self, subject: Subject, *, model: str | None = None, request_id: str | None = None
    ) -> RequestCount:
        """Charge one request to every requests-per-window bucket of ``subject`` (the tenant's, the key's,
        the tenant's for ``model``), all or none, before the request's token counts are known. Returns the
        charge (its ``x-ratelimit-*-requests`` headers: ``{}`` when no rpm applies, or when the store does
        not answer and ``fail_open`` admits); pass it to :meth:`admit` / :meth:`reserve` as ``counted``,
        which then charges no second request. Refunded only when admission then refuses the request (429 for
        its tokens or its concurrency: a 429 never uses up a limit); a request refused for anything else
        (its size, its grammar) keeps the charge.

        Raises:
            RateLimitExceeded: 429, an rpm used up; nothing charged.
            LimiterUnavailable: 503, Redis did not answer; nothing charged.
        """
        now = time.time()
        dims = [d for d in self.dims(subject, 0, now, model) if d.name == "requests"]
        if not dims:
            return RequestCount({})
        member = f"{request_id or 'r'}.{secrets.token_hex(8)}"
        if isinstance(self.limiter, RedisLimiter):
            results = await self._acquire_shared(self.limiter, dims, member)
            if results is None:
                return RequestCount({})
            return RequestCount(headers_for(results), dims, member)
        outcome = self.limiter.acquire_now(dims, member)
        if not outcome.ok:
            raise refusal(outcome.results)
        return RequestCount(headers_for(outcome.results), dims, member)

    async def _refund_count(self, counted: RequestCount) -> None:
        """Give back a :meth:`count_request` charge (admission refused the request with a 429). In-process
        with no checkpoint; with Redis shielded and bounded (a refund the store misses lapses with its
        window)."""
        if not counted.dims:
            return
        refunds = {d.key: d.cost for d in counted.dims}
        if isinstance(self.limiter, LocalLimiter):
            self.limiter.release_now(counted.dims, counted.member, refunds, report=False)
            return
        with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_TIMEOUT_S):
            try:
                await self.limiter.release(counted.dims, counted.member, refunds)
            except StoreError as e:
                log.error("admission: could not refund a request count: %s (it lapses with its window)", e)

    async def reserve(
        self,
        subject: Subject,
        *,
        prompt_tokens: int,
        max_tokens: int,
        model: str | None = None,
        request_id: str | None = None,
        counted: RequestCount | None = None,
    ) -> Reservation:
        """Check and reserve all limits at once. Prefer :meth:`admit`; a reservation from here must be
        settled with ``await admission.close(res, exc)``. ``model`` is the served name the request resolved to
        (canonical, not an alias): it selects ``subject.model_limits[model]`` and is billed in the ledger.
        ``counted``: the headers of :meth:`count_request` when the request was counted already (its rpm
        buckets are then left out here and its headers kept); None: the request is counted here.

        Raises:
            ValueError: a negative token count.
            RateLimitExceeded: 429, nothing reserved.
            LimiterUnavailable: 503, nothing reserved.
        """
        if prompt_tokens < 0 or max_tokens < 0:
            raise ValueError("token counts must be >= 0")
        now = time.time()
        dims = self.dims(subject, prompt_tokens + max_tokens, now, model)
        if counted is not None:
            dims = [d for d in dims if d.name != "requests"]
        # unique even when clients reuse a request id (a concurrency slot is one member of a set)
        member = f"{request_id or 'r'}.{secrets.token_hex(8)}"
        results: list[DimResult] = []
        if dims:
            try:
                if any(d.kind == "daily" for d in dims):
                    await self._seed_daily(dims, self.day(now)[0])
                if isinstance(self.limiter, RedisLimiter):
                    shared = await self._acquire_shared(self.limiter, dims, member)
                    if shared is None:  # fail-open: nothing reserved, nothing to true up
                        dims = []
                    else:
                        results = shared
                else:  # no checkpoint between check and reserve: atomic under Trio
                    outcome = self.limiter.acquire_now(dims, member)
                    if not outcome.ok:
                        raise refusal(outcome.results)
                    results = outcome.results
            except RateLimitExceeded:
                if counted is not None:  # a 429 uses up no limit: the request's rpm unit back
                    await self._refund_count(counted)
                raise
        return Reservation(
            subject,
            dims,
            member,
            prompt_tokens,
            max_tokens,
            model,
            request_id,
            {**(counted.headers if counted else {}), **headers_for(results)},
            counted=counted.headers if counted else None,
        )

    async def close(self, res: Reservation, exc: BaseException | None = None) -> dict[str, str]:
        """True up ``res`` (unused tokens back, slot freed; rpm is not refunded) and queue its ledger row.
        Idempotent. In-process it runs with no checkpoint; with Redis cancel-shielded, at most
        ``RELEASE_TIMEOUT_S``.
        Returns the ``x-ratelimit-*`` headers after the true-up."""
        if res.closed:
            return res.final_headers
        ended_early = exc is None or isinstance(exc, trio.Cancelled)
        res.settle(None if ended_early else self.error_status(exc))
        refunds = {d.key: res.refund for d in res.dims if d.name in ("tokens", "daily_tokens")}
        results: list[DimResult] = []
        try:
            if isinstance(self.limiter, LocalLimiter):
                results = self.limiter.release_now(res.dims, res.member, refunds) if res.dims else []
            elif res.dims:
                with trio.CancelScope(shield=True), trio.fail_after(RELEASE_TIMEOUT_S):
                    results = await self.limiter.release(res.dims, res.member, refunds)
        except (StoreError, trio.TooSlowError) as e:
            self._store_failed_at = trio.current_time()
            log.error(
                "admission: true-up failed for tenant %s, the store did not answer: %s (the slot lapses with its "
                "lease, the tokens stay charged for their window)",
                res.subject.tenant_id,
                _why(e, RELEASE_TIMEOUT_S),
            )
        except Exception:
            log.exception("admission: true-up failed for tenant %s", res.subject.tenant_id)
        res.headers_after = {
            **(res.counted or {}),
            **headers_for([r for r in results if r.dim.kind == "bucket"]),
        }
        self._bill(res)
        return res.final_headers

    @asynccontextmanager
    async def admit(
        self,
        subject: Subject,
        *,
        prompt_tokens: int,
        max_tokens: int,
        model: str | None = None,
        request_id: str | None = None,
        counted: RequestCount | None = None,
    ) -> AsyncIterator[Reservation]:
        """``async with admission.admit(p, prompt_tokens=.., max_tokens=.., model=..) as res:`` (see the module
        doc; ``model``: the resolved served name, canonical, not an alias; ``counted``: as :meth:`reserve`).
        Raises on entry what :meth:`reserve` raises; on exit settles the reservation (:meth:`close`)."""
        res = await self.reserve(
            subject,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            model=model,
            request_id=request_id,
            counted=counted,
        )
        try:
            yield res
        except BaseException as exc:
            await self.close(res, exc)
            raise
        await self.close(res)

    async def peek_headers(self, subject: Subject, model: str | None = None) -> dict[str, str]:
        """Current ``x-ratelimit-*`` headers of ``subject`` (and its limits for served name ``model``) without
        reserving anything. Best effort: ``{}`` when Redis does not answer within ``PEEK_TIMEOUT_S`` or failed
        less than ``STORE_BACKOFF_S`` ago (a response never waits on a store that is down)."""
        dims = [d for d in self.dims(subject, 0, time.time(), model) if d.kind == "bucket"]
        if not dims:
            return {}
        if isinstance(self.limiter, LocalLimiter):
            return headers_for(self.limiter.peek_now(dims))
        if trio.current_time() - self._store_failed_at < STORE_BACKOFF_S:
            return {}
        try:
            with trio.fail_after(min(PEEK_TIMEOUT_S, self.store_timeout_s)):
                return headers_for(await self.limiter.peek(dims))
        except (StoreError, trio.TooSlowError) as e:
            log.warning(
                "admission: rate-limit headers left out, the store did not answer: %s",
                _why(e, min(PEEK_TIMEOUT_S, self.store_timeout_s)),
            )
            self._store_failed_at = trio.current_time()
            return {}

    async def clear_leases(
        self, tenant_id: str, key_ids: list[str], models: Sequence[str] = ()
    ) -> tuple[int, int, int]:
        """Free every concurrency slot of tenant ``tenant_id``, of its keys ``key_ids`` and of its limits for
        the served names ``models`` (with Redis: in every process sharing the store). Returns (slots the tenant
        scope held, slots its keys held, slots its model scopes held). The requests that held them run on, no
        longer counted.

        Raises:
            LimiterUnavailable: 503, Redis did not answer within ``store_timeout_s``.
        """
        keys = [
            f"t:{tenant_id}:conc",
            *(f"{model_scope(tenant_id, m)}:conc" for m in models),
            *(f"k:{k}:conc" for k in key_ids),
        ]
        if isinstance(self.limiter, LocalLimiter):
            counts = self.limiter.clear_now(keys)
        else:
            try:
                with trio.fail_after(self.store_timeout_s):
                    counts = await self.limiter.clear(keys)
            except (StoreError, trio.TooSlowError) as e:
                log.error("admission: rate-limit store unavailable: %s", _why(e, self.store_timeout_s))
                self._store_failed_at = trio.current_time()
                raise unavailable() from None
        n = 1 + len(models)
        return counts[0], sum(counts[n:]), sum(counts[1:n])

    def _bill(self, res: Reservation) -> None:
        s, now = res.subject, time.time()
        self.ledger.record(
            {
                "ts": now,
                "day": self.day(now)[0],
                "tenant_id": s.tenant_id,
                "key_id": s.key_id,
                "key_prefix": s.key_prefix,
                "request_id": res.request_id,
                "model": res.model,
                "prompt_tokens": res.prompt_tokens,
                "cached_tokens": res.cached_tokens,
                "completion_tokens": res.completion_tokens,
                "total_tokens": res.used_tokens,
                "status": res.status,
                "finish_reason": res.finish_reason,
                "timings": res.timings,
            }
        )
