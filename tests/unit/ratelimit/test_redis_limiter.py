"""Admission with a real redis-server (started here on a free port): exact limits across processes, the Lua
script against the in-process model, a lost reply taken back, Redis down is a 503."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plugins.admission_burst import burst
from plugins.books import NullBook
from plugins.redis_server import raw_redis, running, start_redis

from auth.principal import Principal
from ratelimit.admission import Admission
from ratelimit.core import Dim, Limits
from ratelimit.errors import LimiterUnavailable, RateLimitExceeded
from ratelimit.local import LocalLimiter
from ratelimit.redis_limiter import RedisLimiter

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server not installed (make sysdeps)"
)


def principal(tag: str, **limits) -> Principal:
    return Principal(f"tn_{tag}", tag, f"key_{tag}", "sk-gw-AbCd", Limits(**limits))


def fresh(**limits) -> Principal:
    return principal(f"r{os.getpid()}-{time.time_ns()}", **limits)


def shared(redis_url: str, **kw) -> Admission:
    return Admission(RedisLimiter(redis_url), NullBook(), **kw)


async def test_redis_exact_rpm_tpm_concurrency(redis_url):
    adm = shared(redis_url)
    await adm.start()
    async with running(adm):
        p = fresh(rpm=10, window_s=3600)
        ok, errs = await burst(adm, p, 50)
        assert len(ok) == 10 and len(errs) == 40
        e = errs[0]
        assert e.headers["x-ratelimit-remaining-requests"] == "0" and e.headers["retry-after"]

        p = fresh(tpm=1000, window_s=3600)
        ok, errs = await burst(adm, p, 50, prompt_tokens=20, max_tokens=80, hold=0.05)
        assert len(ok) == 10 and all(e.type == "tokens" for e in errs)

        p = fresh(max_concurrent=4)
        ok, errs = await burst(adm, p, 30, hold=0.3)
        assert len(ok) == 4
        ok, errs = await burst(adm, p, 4)
        assert len(ok) == 4  # leases were released

        # true-up: unused tokens come back
        p = fresh(tpm=1000, window_s=3600)
        async with adm.admit(p, prompt_tokens=100, max_tokens=500) as r:
            assert r.headers["x-ratelimit-remaining-tokens"] == "400"
            r.finish(completion_tokens=5)
        assert 895 <= int(r.final_headers["x-ratelimit-remaining-tokens"]) <= 900

        # refill with a short window
        p = fresh(rpm=5, window_s=0.5)  # 10 per second
        t0 = trio.current_time()
        ok, _ = await burst(adm, p, 20)
        assert 5 <= len(ok) <= 5 + int((trio.current_time() - t0) * 10)
        await trio.sleep(0.55)
        ok, _ = await burst(adm, p, 20)
        assert len(ok) == 5

        # daily quota
        p = fresh(daily_tokens=50)
        async with adm.admit(p, prompt_tokens=20, max_tokens=20) as r:
            r.finish(completion_tokens=20)
        with pytest.raises(RateLimitExceeded) as ei:
            async with adm.admit(p, prompt_tokens=10, max_tokens=10):
                pass
        assert ei.value.code == "insufficient_quota"


CHILD = r"""
import json, sys, time, trio
from auth.principal import Principal
from ratelimit.admission import Admission
from ratelimit.core import Limits
from ratelimit.errors import RateLimitExceeded
from ratelimit.redis_limiter import RedisLimiter

class NullBook:
    def record(self, row):
        pass
    async def tokens_on_day(self, *, tenant_id=None, key_id=None, day):
        return 0

async def main(redis_url, tags, start_at):
    out = {}
    adm = Admission(RedisLimiter(redis_url), NullBook())
    async with trio.open_nursery() as nursery:
        await nursery.start(adm.run)
        await admit_all(adm, tags, start_at, out)
        await adm.aclose()
    print(json.dumps(out))

async def admit_all(adm, tags, start_at, out):
    limits = {"rpm": Limits(rpm=10, window_s=3600), "tpm": Limits(tpm=1000, window_s=3600),
              "conc": Limits(max_concurrent=4)}
    ps = {name: Principal(f"tn_{tag}", tag, f"key_{tag}", "sk-gw-AbCd", limits[name]) for name, tag in tags.items()}
    await trio.sleep(max(0.0, start_at - time.time()))
    for name, (n, prompt, maxt, hold) in {"rpm": (30, 1, 1, 0.0), "tpm": (30, 20, 80, 0.0),
                                          "conc": (30, 1, 1, 3.0)}.items():
        if name == "conc":  # both processes hold their slots over the same interval
            await trio.sleep(max(0.0, start_at + 2.0 - time.time()))
        count = 0
        async def one():
            nonlocal count
            try:
                async with adm.admit(ps[name], prompt_tokens=prompt, max_tokens=maxt) as r:
                    count += 1
                    await trio.sleep(hold)
                    r.finish(completion_tokens=maxt)
            except RateLimitExceeded:
                pass
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)
        out[name] = count

trio.run(main, sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]))
"""


async def test_two_processes_share_the_limits(redis_url):
    tags = {name: f"{name}-{os.getpid()}-{time.time_ns()}" for name in ("rpm", "tpm", "conc")}
    start_at = time.time() + 3.0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", CHILD, redis_url, json.dumps(tags), str(start_at)]
    results = []

    async def child():
        r = await trio.run_process(
            args, capture_stdout=True, capture_stderr=True, env=env, cwd=str(ROOT), check=False
        )
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        results.append(json.loads(r.stdout.decode().strip().splitlines()[-1]))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(child)
        nursery.start_soon(child)
    assert len(results) == 2
    assert sum(r["rpm"] for r in results) == 10
    assert sum(r["tpm"] for r in results) == 10  # 100 tokens each, tpm 1000
    assert sum(r["conc"] for r in results) == 4


async def test_redis_down_is_503_not_a_hang(tmp_path):
    proc, url = start_redis(tmp_path)
    try:
        adm = shared(url)
        await adm.start()
        async with running(adm):
            p = fresh(rpm=5)
            async with adm.admit(p, prompt_tokens=1, max_tokens=1):
                pass
            proc.terminate()
            proc.wait(5)
            with trio.fail_after(10):
                with pytest.raises(LimiterUnavailable) as ei:
                    async with adm.admit(p, prompt_tokens=1, max_tokens=1):
                        pass
            e = ei.value
            assert (e.status, e.type, e.code, e.headers) == (
                503,
                "server_error",
                "rate_limiter_unavailable",
                {"retry-after": "1"},
            )
    finally:
        if proc.poll() is None:
            proc.kill()


OPS = st.lists(
    st.tuples(st.sampled_from(["acq", "rel"]), st.integers(0, 60), st.integers(-10, 40)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=OPS, limits=st.tuples(st.integers(0, 8), st.integers(0, 120), st.integers(0, 4), st.integers(0, 150))
)
def test_redis_script_matches_local_model(redis_url, ops, limits):
    """Same operations, same outcomes: the Lua script and the in-process limiter implement one model
    (window 1e6 s so the refill during a test is negligible)."""
    rpm, tpm, conc, daily = limits
    tag = os.urandom(6).hex()

    def dims(cost):
        return [
            Dim(f"{tag}:rpm", "bucket", "requests", rpm, 1, 1e6),
            Dim(f"{tag}:tpm", "bucket", "tokens", tpm, cost, 1e6),
            Dim(f"{tag}:conc", "conc", "concurrent", conc, 1),
            Dim(f"{tag}:day", "daily", "daily_tokens", daily, cost, ttl_s=1000.0, seed=5),
        ]

    async def main():
        local, remote = LocalLimiter(), RedisLimiter(redis_url)
        held: list[tuple[str, int]] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(remote.run)
            for i, (op, cost, used) in enumerate(ops):
                if op == "acq":
                    a = local.acquire_now(dims(cost), f"m{i}")
                    b = await remote.acquire(dims(cost), f"m{i}")
                    assert a.ok == b.ok, (i, a, b)
                    assert [r.ok for r in a.results] == [r.ok for r in b.results]
                    for ra, rb in zip(a.results, b.results):
                        assert abs(ra.remaining - rb.remaining) < 0.01, (ra, rb)
                    if a.ok:
                        held.append((f"m{i}", cost))
                elif held:
                    m, c = held.pop(0)
                    refund = max(-c, c - used) if used >= 0 else 0
                    ds = dims(c)
                    refunds = {ds[1].key: refund, ds[3].key: refund}
                    ra = local.release_now(ds, m, refunds)
                    rb = await remote.release(ds, m, refunds)
                    for x, y in zip(ra, rb):
                        assert abs(x.remaining - y.remaining) < 0.01, (x, y)
            await remote.aclose()

    trio.run(main)


BUSY_2S = (
    "local s = redis.call('TIME') local t0 = s[1] + s[2] / 1e6 "
    "while true do local t = redis.call('TIME') if t[1] + t[2] / 1e6 - t0 > 2 then break end end return 1"
)


async def test_lost_acquire_reply_is_taken_back(redis_url):
    """Redis runs the admission script but answers only after the gateway gave up (a 2 s script of another
    client blocks it; the store timeout is 0.5 s here, 5 s in production): the request gets 503, and what the
    script reserved is taken back (it used to keep the concurrency slot for the 1 h lease and the tokens for
    the window); an undo of an acquire that never ran refunds nothing."""
    adm = shared(redis_url, store_timeout_s=0.5)
    p = fresh(rpm=4, tpm=1000, max_concurrent=1, window_s=3600)
    async with running(adm), raw_redis(redis_url) as admin:
        async with adm.admit(p, prompt_tokens=1, max_tokens=1) as r:  # also opens the pooled connection
            r.finish(completion_tokens=1)

        async def busy() -> None:
            await admin.eval(BUSY_2S)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(busy)
            await trio.sleep(0.2)  # the busy script is running: Redis reads nothing until it ends
            with pytest.raises(LimiterUnavailable):
                async with adm.admit(p, prompt_tokens=100, max_tokens=100):
                    pass
        # nothing is held: the only concurrency slot is free, and requests + tokens are back in full
        async with adm.admit(p, prompt_tokens=400, max_tokens=500) as r:
            assert r.headers["x-ratelimit-remaining-requests"] == "2"
            assert int(r.headers["x-ratelimit-remaining-tokens"]) >= 98
            r.finish(completion_tokens=500)
        assert isinstance(adm.limiter, RedisLimiter)
        assert await adm.limiter.undo(adm.dims(p, 10, time.time()), "never-acquired") is False
        assert (await adm.peek_headers(p))["x-ratelimit-remaining-requests"] == "2"


async def test_redis_model_limits_are_dimensions_of_their_own(redis_url):
    """In the Lua script too: a tenant's limits for one model are keys of their own, taken with the tenant's
    (all or nothing), and the model's lease set is cleared with the tenant's."""
    adm = shared(redis_url)
    await adm.start()
    async with running(adm):
        base = fresh(rpm=4, window_s=3600)
        p = Principal(
            base.tenant_id,
            base.tenant_name,
            base.key_id,
            base.key_prefix,
            base.limits,
            model_limits={"m1": Limits(rpm=2, max_concurrent=1, window_s=3600)},
        )
        async with adm.admit(p, prompt_tokens=1, max_tokens=1, model="m1") as r:
            assert r.headers["x-ratelimit-remaining-requests"] == "1"  # the tightest: the model's
            with pytest.raises(RateLimitExceeded) as ei:
                async with adm.admit(p, prompt_tokens=1, max_tokens=1, model="m1"):
                    pass
            assert f"concurrent requests for model m1 of tenant {p.tenant_name}" in ei.value.message
            assert await adm.clear_leases(p.tenant_id, [], ["m1"]) == (0, 0, 1)
        async with adm.admit(p, prompt_tokens=1, max_tokens=1, model="m1"):
            pass
        with pytest.raises(RateLimitExceeded) as ei:  # the model's rpm is spent (the refused one took none)
            async with adm.admit(p, prompt_tokens=1, max_tokens=1, model="m1"):
                pass
        assert "model m1" in ei.value.message and ei.value.headers["x-ratelimit-limit-requests"] == "2"
        async with adm.admit(
            p, prompt_tokens=1, max_tokens=1, model="m2"
        ) as r:  # another model: the tenant's
            assert r.headers["x-ratelimit-remaining-requests"] == "1"
