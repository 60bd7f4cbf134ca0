"""Admission with a real redis-server (started here on a free port): exact limits across processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from auth.store import Store
from gateway.errors import RateLimited
from gateway.tenancy import Tenancy
from ratelimit.core import Dim, Limits
from ratelimit.local import LocalLimiter
from ratelimit.redis_limiter import RedisLimiter

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server not installed (make sysdeps)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    d = tmp_path_factory.mktemp("redis")
    port = free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(d),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(5)


_n = 0


async def new_key(t: Tenancy, **limits) -> str:
    global _n
    _n += 1
    tn = await t.store.call(Store.create_tenant, f"r{_n}-{os.getpid()}-{time.time_ns()}", Limits(**limits))
    key, _ = await t.store.call(Store.create_key, tn.id)
    return key


def scope_for(key: str) -> dict:
    return {"headers": [(b"authorization", f"Bearer {key}".encode())], "query_string": b""}


async def burst(t, p, n, *, prompt_tokens=1, max_tokens=1, hold=0.0):
    ok, errs = [], []

    async def one():
        try:
            async with t.admit(p, prompt_tokens=prompt_tokens, max_tokens=max_tokens) as r:
                ok.append(r)
                await trio.sleep(hold)
                r.finish(completion_tokens=max_tokens)
        except RateLimited as e:
            errs.append(e)

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    return ok, errs


async def test_redis_exact_rpm_tpm_concurrency(tmp_path, redis_url):
    async with Tenancy.open(str(tmp_path / "g.db"), redis_url=redis_url, announce=lambda s: None) as t:
        p = await t.authenticate(scope_for(await new_key(t, rpm=10, window_s=3600)))
        ok, errs = await burst(t, p, 50)
        assert len(ok) == 10 and len(errs) == 40
        e = errs[0]
        assert e.headers["x-ratelimit-remaining-requests"] == "0" and e.headers["retry-after"]

        p = await t.authenticate(scope_for(await new_key(t, tpm=1000, window_s=3600)))
        ok, errs = await burst(t, p, 50, prompt_tokens=20, max_tokens=80, hold=0.05)
        assert len(ok) == 10 and all(e.type == "tokens" for e in errs)

        p = await t.authenticate(scope_for(await new_key(t, max_concurrent=4)))
        ok, errs = await burst(t, p, 30, hold=0.3)
        assert len(ok) == 4
        ok, errs = await burst(t, p, 4)
        assert len(ok) == 4  # leases were released

        # true-up: unused tokens come back
        p = await t.authenticate(scope_for(await new_key(t, tpm=1000, window_s=3600)))
        async with t.admit(p, prompt_tokens=100, max_tokens=500) as r:
            assert r.headers["x-ratelimit-remaining-tokens"] == "400"
            r.finish(completion_tokens=5)
        assert 895 <= int(r.final_headers["x-ratelimit-remaining-tokens"]) <= 900

        # refill with a short window
        p = await t.authenticate(scope_for(await new_key(t, rpm=5, window_s=0.5)))  # 10 per second
        t0 = trio.current_time()
        ok, _ = await burst(t, p, 20)
        assert 5 <= len(ok) <= 5 + int((trio.current_time() - t0) * 10)
        await trio.sleep(0.55)
        ok, _ = await burst(t, p, 20)
        assert len(ok) == 5

        # daily quota
        p = await t.authenticate(scope_for(await new_key(t, daily_tokens=50)))
        async with t.admit(p, prompt_tokens=20, max_tokens=20) as r:
            r.finish(completion_tokens=20)
        with pytest.raises(RateLimited) as ei:
            async with t.admit(p, prompt_tokens=10, max_tokens=10):
                pass
        assert ei.value.code == "insufficient_quota"


CHILD = r"""
import json, sys, time, trio
from gateway.tenancy import Tenancy
from gateway.errors import RateLimited

async def main(db, redis_url, keys, start_at):
    out = {}
    async with Tenancy.open(db, redis_url=redis_url, create_default=False) as t:
        ps = {name: await t.authenticate({"headers": [(b"authorization", f"Bearer {k}".encode())], "query_string": b""})
              for name, k in keys.items()}
        await trio.sleep(max(0.0, start_at - time.time()))
        for name, (n, prompt, maxt, hold) in {"rpm": (30, 1, 1, 0.0), "tpm": (30, 20, 80, 0.0),
                                              "conc": (30, 1, 1, 3.0)}.items():
            if name == "conc":  # both processes hold their slots over the same interval
                await trio.sleep(max(0.0, start_at + 2.0 - time.time()))
            count = 0
            async def one():
                nonlocal count
                try:
                    async with t.admit(ps[name], prompt_tokens=prompt, max_tokens=maxt) as r:
                        count += 1
                        await trio.sleep(hold)
                        r.finish(completion_tokens=maxt)
                except RateLimited:
                    pass
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(one)
            out[name] = count
    print(json.dumps(out))

trio.run(main, sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4]))
"""


async def test_two_processes_share_the_limits(tmp_path, redis_url):
    db = str(tmp_path / "shared.db")
    async with Tenancy.open(db, redis_url=redis_url, announce=lambda s: None) as t:
        keys = {
            "rpm": await new_key(t, rpm=10, window_s=3600),
            "tpm": await new_key(t, tpm=1000, window_s=3600),
            "conc": await new_key(t, max_concurrent=4),
        }
    start_at = time.time() + 3.0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", CHILD, db, redis_url, json.dumps(keys), str(start_at)]
    results = []

    async def child():
        r = await trio.run_process(
            args, capture_stdout=True, capture_stderr=True, env=env, cwd=str(ROOT), check=False
        )
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        results.append(json.loads(r.stdout.decode().strip().splitlines()[-1]))
        # keys never reach a child's output
        assert not any(k in (r.stdout + r.stderr).decode() for k in keys.values())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(child)
        nursery.start_soon(child)
    assert len(results) == 2
    assert sum(r["rpm"] for r in results) == 10
    assert sum(r["tpm"] for r in results) == 10  # 100 tokens each, tpm 1000
    assert sum(r["conc"] for r in results) == 4


async def test_redis_down_is_503_not_a_hang(tmp_path):
    from gateway.errors import ServiceUnavailable

    port = free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                await trio.sleep(0.05)
        async with Tenancy.open(
            str(tmp_path / "g.db"), redis_url=f"redis://127.0.0.1:{port}", announce=lambda s: None
        ) as t:
            p = await t.authenticate(scope_for(await new_key(t, rpm=5)))
            async with t.admit(p, prompt_tokens=1, max_tokens=1):
                pass
            proc.terminate()
            proc.wait(5)
            with trio.fail_after(10):
                with pytest.raises(ServiceUnavailable):
                    async with t.admit(p, prompt_tokens=1, max_tokens=1):
                        pass
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
        try:
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
        finally:
            await remote.aclose()

    trio.run(main)


BUSY_2S = (
    "local s = redis.call('TIME') local t0 = s[1] + s[2] / 1e6 "
    "while true do local t = redis.call('TIME') if t[1] + t[2] / 1e6 - t0 > 2 then break end end return 1"
)


async def test_lost_acquire_reply_is_taken_back(tmp_path, redis_url):
    """Redis runs the admission script but answers only after the gateway gave up (a 2 s script of another
    client blocks it; the gateway's store timeout is 0.5 s here, 5 s in production): the request gets 503,
    and what the script reserved is taken back (it used to keep the concurrency slot for the 1 h lease and
    the tokens for the window); an undo of an acquire that never ran refunds nothing."""
    from gateway.errors import ServiceUnavailable
    from ratelimit.resp import RedisClient

    async with Tenancy.open(str(tmp_path / "g.db"), redis_url=redis_url, announce=lambda s: None) as t:
        t.store_timeout_s = 0.5
        p = await t.authenticate(
            scope_for(await new_key(t, rpm=4, tpm=1000, max_concurrent=1, window_s=3600))
        )
        async with t.admit(p, prompt_tokens=1, max_tokens=1) as r:  # also opens the pooled connection
            r.finish(completion_tokens=1)
        admin = RedisClient(redis_url)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(admin.execute, "EVAL", BUSY_2S, 0)
                await trio.sleep(0.2)  # the busy script is running: Redis reads nothing until it ends
                with pytest.raises(ServiceUnavailable):
                    async with t.admit(p, prompt_tokens=100, max_tokens=100):
                        pass
            # nothing is held: the only concurrency slot is free, and requests + tokens are back in full
            async with t.admit(p, prompt_tokens=400, max_tokens=500) as r:
                assert r.headers["x-ratelimit-remaining-requests"] == "2"
                assert int(r.headers["x-ratelimit-remaining-tokens"]) >= 98
                r.finish(completion_tokens=500)
            dims = t._dims(p, 10, *t._day(time.time()))
            assert await t.limiter.undo(dims, "never-acquired") is False
            assert (await t.peek_headers(p))["x-ratelimit-remaining-requests"] == "2"
        finally:
            await admin.aclose()
