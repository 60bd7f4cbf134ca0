"""In-process limiter: state in dicts, check-and-reserve with no ``await`` inside.

Trio runs one task at a time and only switches at checkpoints (``await`` of something that yields), so
:meth:`LocalLimiter.acquire_now` -- a plain function -- is atomic with respect to every other task of the
process: no check-then-increment race. Limits live in this process only (use the Redis limiter to share
them between gateway processes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import trio

from .core import CONC_RETRY_S, Dim, DimResult, Outcome


class LocalLimiter:
    """Token buckets (debt form), concurrency slots and daily counters of one process.

    A concurrency dimension holds the set of the members (one per admitted request) in it, so a release
    frees that request's slot only, and :meth:`clear_now` can empty a scope while its requests still run.

    ``clock`` returns seconds (monotonic); injectable for tests of the arithmetic only.
    """

    shared = False

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (debt, at)
        self._conc: dict[str, set[str]] = {}  # key -> members holding a slot
        self._daily: dict[str, int] = {}

    # -- helpers -------------------------------------------------------------------------------------
    def _debt(self, d: Dim, now: float) -> float:
        debt, at = self._buckets.get(d.key, (0.0, now))
        rate = d.limit / d.window_s if d.window_s > 0 else math.inf
        if rate == math.inf:
            return 0.0
        return max(0.0, debt - max(0.0, now - at) * rate)

    def _state(self, d: Dim, now: float) -> tuple[float, float, float]:
        """(used, remaining, reset_s) of dimension ``d`` now."""
        if d.kind == "bucket":
            debt = self._debt(d, now)
            rate = d.limit / d.window_s if d.limit > 0 else 0.0
            reset = debt / rate if rate > 0 else (0.0 if debt <= 0 else math.inf)
            return debt, d.limit - debt, reset
        if d.kind == "conc":
            used = len(self._conc.get(d.key, ()))
            return used, d.limit - used, 0.0
        used = self._daily.get(d.key, d.seed)
        return used, d.limit - used, d.ttl_s

    def _check(self, d: Dim, now: float) -> DimResult:
        used, remaining, reset = self._state(d, now)
        if d.cost <= remaining:
            return DimResult(d, True, remaining - d.cost, reset, 0.0)
        if d.cost > d.limit:
            retry = math.inf
        elif d.kind == "bucket":
            rate = d.limit / d.window_s
            retry = (d.cost - remaining) / rate if rate > 0 else math.inf
        elif d.kind == "conc":
            retry = CONC_RETRY_S  # a slot frees when a request ends: a poll hint (see ratelimit.core)
        else:
            retry = d.ttl_s
        return DimResult(d, False, max(0.0, remaining), reset, retry)

    # -- API (synchronous, atomic) -------------------------------------------------------------------
    def acquire_now(self, dims: list[Dim], member: str) -> Outcome:
        """Check every dimension; if all pass, reserve them all, else reserve nothing."""
        now = self._clock()
        results = [self._check(d, now) for d in dims]
        if not all(r.ok for r in results):
            for r in results:  # nothing reserved: report the state as it is
                if r.ok:
                    r.remaining += r.dim.cost
            return Outcome(False, results)
        for d, r in zip(dims, results):
            if d.kind == "bucket":
                debt = self._debt(d, now) + d.cost
                self._buckets[d.key] = (debt, now)
                rate = d.limit / d.window_s if d.limit > 0 else 0.0
                r.reset_s = debt / rate if rate > 0 else 0.0
            elif d.kind == "conc":
                self._conc.setdefault(d.key, set()).add(member)
            else:
                self._daily[d.key] = self._daily.get(d.key, d.seed) + d.cost
        return Outcome(True, results)

    def release_now(
        self, dims: list[Dim], member: str, refunds: dict[str, int], *, report: bool = True
    ) -> list[DimResult]:
        """Give back ``refunds[key]`` units per dimension (negative = charge more) and free concurrency;
        returns the state after (``[]`` with ``report=False``)."""
        now = self._clock()
        for d in dims:
            refund = refunds.get(d.key, 0)
            if d.kind == "bucket":
                debt = max(0.0, self._debt(d, now) - refund)
                self._buckets[d.key] = (debt, now)
            elif d.kind == "conc":
                members = self._conc.get(d.key)
                if members is not None:
                    members.discard(member)
                    if not members:
                        del self._conc[d.key]
            else:
                self._daily[d.key] = max(0, self._daily.get(d.key, d.seed) - refund)
        return self.peek_now(dims) if report else []

    def peek_now(self, dims: list[Dim]) -> list[DimResult]:
        now = self._clock()
        out = []
        for d in dims:
            _, remaining, reset = self._state(d, now)
            out.append(DimResult(d, True, max(0.0, remaining), reset))
        return out

    def clear_now(self, keys: list[str]) -> list[int]:
        """Free every slot of the concurrency dimensions ``keys`` (``t:<tenant>:conc``...); returns how many
        each held. The requests holding them go on; their release then frees nothing."""
        return [len(self._conc.pop(k, ())) for k in keys]

    def has_daily(self, key: str) -> bool:
        return key in self._daily

    def prune_daily(self, day: str) -> None:
        """Forget daily counters of other days than ``day`` (``YYYY-MM-DD``)."""
        for k in [k for k in self._daily if not k.endswith(":" + day)]:
            del self._daily[k]

    # -- async facade shared with RedisLimiter -------------------------------------------------------
    async def acquire(self, dims: list[Dim], member: str) -> Outcome:
        return self.acquire_now(dims, member)  # no checkpoint inside: atomic under Trio

    async def release(self, dims: list[Dim], member: str, refunds: dict[str, int]) -> list[DimResult]:
        return self.release_now(dims, member, refunds)

    async def peek(self, dims: list[Dim]) -> list[DimResult]:
        return self.peek_now(dims)

    async def clear(self, keys: list[str]) -> list[int]:
        return self.clear_now(keys)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Nothing to keep alive in-process (the slots live as long as this process): started, returns."""
        task_status.started()

    async def aclose(self) -> None:
        pass
