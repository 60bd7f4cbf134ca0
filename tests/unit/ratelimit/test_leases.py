"""Concurrency leases with a real redis-server: a process that stops renewing frees its slots within the
lease, a live one keeps them, the 429's retry-after tells when a slot can free, the admin clear frees them at
once without letting the holder's renewals or releases miscount, a reused request id takes a slot of its own,
a stalled or restarted Redis neither hangs a response nor fails the first request after it is back."""

from __future__ import annotations

import math
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
from plugins.books import NullBook
from plugins.redis_server import raw_redis, restart_redis, running, start_redis, stop_redis

from auth.principal import Principal
from ratelimit.admission import Admission
from ratelimit.core import CONC_RETRY_S, Limits
from ratelimit.errors import RateLimitExceeded
from ratelimit.local import LocalLimiter
from ratelimit.redis_limiter import LEASE_TTL_S, RedisLimiter

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server not installed (make sysdeps)"
)


def fresh(**limits) -> Principal:
    tag = f"l{os.getpid()}-{time.time_ns()}"
    return Principal(f"tn_{tag}", tag, f"key_{tag}", "sk-gw-AbCd", Limits(**limits))


def redis_admission(url: str, lease_s: float = LEASE_TTL_S) -> Admission:
    return Admission(RedisLimiter(url, lease_s=lease_s), NullBook())


async def hold(adm: Admission, p: Principal, *, request_id: str | None = None):
    """Enter an admission and keep it: returns the reservation (settle it with ``adm.close``)."""
    return await adm.reserve(p, prompt_tokens=1, max_tokens=1, request_id=request_id)


async def refused(adm: Admission, p: Principal) -> RateLimitExceeded:
    with pytest.raises(RateLimitExceeded) as ei:
        await hold(adm, p)
    return ei.value


async def test_default_lease_is_seconds_not_an_hour(redis_url):
    """A slot's lease in Redis expires within LEASE_TTL_S (<= 10 s) of the last renewal (it was 1 h)."""
    adm = Admission(RedisLimiter(redis_url), NullBook())
    async with running(adm), raw_redis(redis_url) as raw:
        p = fresh(max_concurrent=2)
        res = await hold(adm, p)
        now = (await raw.time()).timestamp()
        members = await raw.zrange(f"gw:rl:t:{p.tenant_id}:conc", 0, -1, withscores=True)
        assert len(members) == 1
        assert now < members[0].score <= now + 10.5
        assert LEASE_TTL_S <= 10
        await adm.close(res)


@asynccontextmanager
async def connected(*admissions: Admission) -> AsyncIterator[None]:
    """The admissions' Redis connections without their heartbeats: the leases they take lapse (a holder that
    stopped renewing, as after a crash), unless ``renew`` is called by hand."""
    async with AsyncExitStack() as stack:
        for adm in admissions:
            assert isinstance(adm.limiter, RedisLimiter)
            await stack.enter_async_context(adm.limiter.connected())
        yield


async def test_stopped_holder_lapses_live_holder_is_renewed(redis_url):
    """Process A renews its leases, process B stops (no release, no renewal: a crash): after 2.5 leases A's
    two slots are still counted and B's slot is free, so a third process gets exactly one slot of three."""
    lease = 0.8
    a, b, c = (redis_admission(redis_url, lease) for _ in range(3))
    p = fresh(max_concurrent=3)
    async with running(a, c), connected(b):
        held_a = [await hold(a, p), await hold(a, p)]
        await hold(b, p)  # never released nor renewed: B "dies" here
        assert isinstance(a.limiter, RedisLimiter) and a.limiter.held == 2
        e = await refused(c, p)
        assert 0 < int(e.headers["retry-after-ms"]) <= math.ceil(lease * 1000)
        await trio.sleep(lease * 2.5)
        got = await hold(c, p)  # B's slot lapsed
        await refused(c, p)  # A's two are still counted: exactly 3
        for r in held_a:
            await a.close(r)
        assert a.limiter.held == 0
        await c.close(got)


async def test_concurrency_retry_after_is_when_a_slot_can_free(redis_url):
    """Blocked by a live holder: retry-after-ms is the short hint (CONC_RETRY_S). Blocked by leases of a
    stopped holder about to lapse: retry-after-ms is the time to the earliest lapse, and waiting it out (plus
    a scheduling margin) admits the request."""
    lease = 0.6
    dead, probe = redis_admission(redis_url, lease), redis_admission(redis_url, lease)
    live = redis_admission(redis_url, 5.0)
    async with running(live, probe), connected(dead):
        p = fresh(max_concurrent=1)
        r = await hold(live, p)
        e = await refused(probe, p)
        assert e.headers["retry-after-ms"] == str(math.ceil(CONC_RETRY_S * 1000))
        assert e.headers["retry-after"] == "1" and "x-should-retry" not in e.headers
        await live.close(r)

        q = fresh(max_concurrent=1)
        await hold(dead, q)  # lapses in 0.6 s, never renewed
        await trio.sleep(0.2)
        e = await refused(probe, q)
        wait_ms = int(e.headers["retry-after-ms"])
        assert 0 < wait_ms <= 450, wait_ms  # ~0.4 s left of the lease, not the 1 s hint
        await trio.sleep(wait_ms / 1000 + 0.05)
        await probe.close(await hold(probe, q))


def _admissions(kind: str, url: str) -> tuple[Admission, Admission]:
    """Two admissions sharing one limiter state: two Redis clients, or one in-process limiter."""
    if kind == "redis":
        return redis_admission(url, 1.0), redis_admission(url, 1.0)
    local = LocalLimiter()
    return Admission(local, NullBook()), Admission(local, NullBook())


@pytest.mark.parametrize("kind", ["local", "redis"])
async def test_clear_frees_slots_and_nothing_miscounts_after(redis_url, kind):
    """clear_leases frees the tenant's and its key's slots at once; the holder's renewals do not bring them
    back and its later releases do not free the slots admitted after the clear."""
    holder, other = _admissions(kind, redis_url)
    p = fresh(max_concurrent=2)
    p = Principal(p.tenant_id, p.tenant_name, p.key_id, p.key_prefix, p.limits, Limits(max_concurrent=2))
    async with running(holder, other):
        old = [await hold(holder, p), await hold(holder, p)]
        await refused(other, p)
        assert await other.clear_leases(p.tenant_id, [p.key_id]) == (2, 2, 0)
        assert await other.clear_leases(p.tenant_id, [p.key_id]) == (0, 0, 0)
        new = [await hold(other, p), await hold(other, p)]
        await trio.sleep(1.5)  # a lease and more: the holder renewed what it holds (Redis)
        await refused(other, p)  # the two new ones count, the cleared ones did not come back
        if isinstance(holder.limiter, RedisLimiter):
            assert holder.limiter.held == 0  # the renewal told the holder they were cleared
        for r in old:
            await holder.close(r)
        await refused(other, p)  # the old releases freed nothing of the new ones
        for r in new:
            await other.close(r)
        await other.close(await hold(other, p))


async def test_renewal_puts_back_a_lapsed_lease_of_a_running_request(redis_url):
    """A live request whose lease lapsed (its process stalled, or Redis was out of reach, for longer than the
    lease) is counted again at the next renewal: the count catches up with what runs instead of letting the
    tenant run over its limit until that request ends."""
    holder, other = redis_admission(redis_url, 0.5), redis_admission(redis_url, 5.0)
    p = fresh(max_concurrent=2)
    async with connected(holder), running(other):
        stalled = await hold(holder, p)  # no heartbeat running: the lease lapses
        await trio.sleep(0.7)
        admitted = [await hold(other, p), await hold(other, p)]  # 3 run now, 2 counted
        assert isinstance(holder.limiter, RedisLimiter) and await holder.limiter.renew() == 1
        await other.close(admitted.pop())
        await refused(other, p)  # 2 run and 2 are counted
        await holder.close(stalled)
        await other.close(await hold(other, p))
        await other.close(admitted.pop())


async def test_leases_lost_in_a_redis_restart_are_put_back(tmp_path):
    """Redis restarts without persistence while a tenant holds all its slots: within one renewal the slots
    count again, so the tenant cannot run twice its limit."""
    proc, url = start_redis(tmp_path)
    holder, other = redis_admission(url, 0.8), redis_admission(url, 0.8)
    p = fresh(max_concurrent=2)
    try:
        async with running(holder, other):
            held = [await hold(holder, p), await hold(holder, p)]
            proc = await trio.to_thread.run_sync(restart_redis, proc, tmp_path, url)
            await trio.sleep(0.8 / 4 + 0.3)  # one renewal and a margin
            await refused(other, p)
            for r in held:
                await holder.close(r)
            await other.close(await hold(other, p))
    finally:
        stop_redis(proc)


@pytest.mark.parametrize("kind", ["local", "redis"])
async def test_reused_request_id_takes_a_slot_of_its_own(redis_url, kind):
    """Clients choose x-request-id: two requests with the same id hold two slots (max_concurrent=1: the second
    is refused), and the first one's release does not free the second's."""
    one, two = _admissions(kind, redis_url)
    p = fresh(max_concurrent=2)
    async with running(one, two):
        first = await hold(one, p, request_id="same-id")
        second = await hold(two, p, request_id="same-id")
        with pytest.raises(RateLimitExceeded):
            await hold(two, p, request_id="same-id")
        await one.close(first)
        third = await hold(two, p, request_id="same-id")
        with pytest.raises(RateLimitExceeded):
            await hold(one, p, request_id="same-id")
        await two.close(second)
        await two.close(third)


async def test_stalled_redis_does_not_hang_the_rate_limit_headers(tmp_path):
    """The x-ratelimit-* headers the auth middleware adds to responses that did not go through admission are
    best effort: with Redis stopped (SIGSTOP, it accepts connections and never answers) they are left out
    within about a second instead of holding the response until Redis answers."""
    proc, url = start_redis(tmp_path)
    adm = redis_admission(url)
    try:
        async with running(adm):
            p = fresh(rpm=100)
            assert (await adm.peek_headers(p))["x-ratelimit-limit-requests"] == "100"
            proc.send_signal(signal.SIGSTOP)
            try:
                t0 = trio.current_time()
                with trio.fail_after(5):
                    assert await adm.peek_headers(p) == {}
                    assert await adm.peek_headers(p) == {}  # the second one does not wait at all
                assert trio.current_time() - t0 < 2.0
            finally:
                proc.send_signal(signal.SIGCONT)
    finally:
        stop_redis(proc)


async def test_first_request_after_a_redis_restart_succeeds(tmp_path):
    """Connections to a Redis that restarted leave the pool when the server closes them, so the first
    admissions after it is back are not false 503s (no reconnect by hand, no restart of the process)."""
    proc, url = start_redis(tmp_path)
    adm = redis_admission(url)
    try:
        async with running(adm):
            p = fresh(rpm=100, max_concurrent=4)
            async with trio.open_nursery() as nursery:  # several requests on the pooled connection(s)
                for _ in range(4):
                    nursery.start_soon(_admit_once, adm, p, 0.1)
            proc = await trio.to_thread.run_sync(restart_redis, proc, tmp_path, url)
            for _ in range(4):
                await _admit_once(adm, p, 0.0)
    finally:
        stop_redis(proc)


async def _admit_once(adm: Admission, p: Principal, hold_s: float) -> None:
    async with adm.admit(p, prompt_tokens=1, max_tokens=1) as r:
        await trio.sleep(hold_s)
        r.finish(completion_tokens=1)


def test_bucket_retry_after_is_exact():
    """rpm/tpm in-process: a refused request passes once retry-after-ms has passed, not 2 ms before (fake
    clock)."""
    now = [1000.0]
    adm = Admission(LocalLimiter(clock=lambda: now[0]), NullBook())
    cases = ((fresh(rpm=2, window_s=10), 1, 2, "requests"), (fresh(tpm=100, window_s=10), 60, 1, "tokens"))

    async def main():
        for p, cost, fits, expect_type in cases:
            for _ in range(fits):
                await adm.close(await adm.reserve(p, prompt_tokens=cost, max_tokens=0))
            e = await refused_cost(adm, p, cost)
            assert e.type == expect_type
            wait_ms = int(e.headers["retry-after-ms"])
            assert wait_ms > 0 and int(e.headers["retry-after"]) == math.ceil(wait_ms / 1000)
            now[0] += wait_ms / 1000 - 0.002
            await refused_cost(adm, p, cost)
            now[0] += 0.002
            await adm.close(await adm.reserve(p, prompt_tokens=cost, max_tokens=0))

    trio.run(main)


async def refused_cost(adm: Admission, p: Principal, cost: int) -> RateLimitExceeded:
    with pytest.raises(RateLimitExceeded) as ei:
        await adm.reserve(p, prompt_tokens=cost, max_tokens=0)
    return ei.value


async def test_bucket_retry_after_is_honest_with_redis(redis_url):
    """rpm with Redis: the request refused with retry-after-ms passes after waiting that long."""
    adm = redis_admission(redis_url)
    async with running(adm):
        p = fresh(rpm=4, window_s=1.0)
        for _ in range(4):
            await adm.close(await hold(adm, p))
        e = await refused(adm, p)
        wait_ms = int(e.headers["retry-after-ms"])
        assert 0 < wait_ms <= 250
        await trio.sleep(wait_ms / 1000 + 0.02)
        await adm.close(await hold(adm, p))


async def test_heartbeat_stops_when_the_limiter_closes(redis_url):
    """The heartbeat task ends when aclose closes its channel (no cancellation needed), and renews meanwhile."""
    adm = redis_admission(redis_url, 0.4)
    p = fresh(max_concurrent=1)
    async with raw_redis(redis_url) as raw:
        with trio.fail_after(5):
            async with running(adm):
                r = await hold(adm, p)
                key = f"gw:rl:t:{p.tenant_id}:conc"
                first = (await raw.zrange(key, 0, 0, withscores=True))[0].score
                await trio.sleep(0.5)
                renewed = (await raw.zrange(key, 0, 0, withscores=True))[0].score
                assert renewed > first
                await adm.close(r)
