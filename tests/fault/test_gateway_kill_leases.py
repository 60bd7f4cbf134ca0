"""A gateway killed with -9 while its tenant holds every concurrency slot (shared limits in Redis): another
gateway on the same Redis and database admits the tenant's full concurrency again within 10 s, a client that
follows the 429's ``retry-after-ms`` gets in within that time, the limit stays exact afterwards, and the admin
call ``DELETE /admin/v1/tenants/{id}/leases`` frees the slots at once.

Two private gateways (``fault_gateway``; the second one started is a client of the first one's backend, the
backend accepts several gateways), one redis-server (tests/plugins/redis_server.py), one SQLite
database. Bound from the issue: admitted again within 10 s of the kill (the leases live LEASE_TTL_S = 6 s
without renewal).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from plugins.gateway_server import GatewayProc
from plugins.redis_server import start_redis, stop_redis

pytestmark = pytest.mark.slow

MAX_CONCURRENT = 3
RECOVERY_BOUND_S = 10.0
LEASE_TTL_S = 6.0  # ratelimit.redis_limiter.LEASE_TTL_S: no 429 may ask a client to wait longer


def new_tenant(g: GatewayProc, **limits: int) -> tuple[str, str]:
    """(tenant id, API key) of a new tenant with ``limits``, created through ``g``'s admin API."""
    r = httpx.post(
        g.base_url + "/admin/v1/tenants",
        json={"name": "kill-" + os.urandom(4).hex(), "limits": limits},
        headers=g.admin_headers(),
        timeout=30,
    )
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    r = httpx.post(
        g.base_url + f"/admin/v1/tenants/{tid}/keys",
        json={"name": "k"},
        headers=g.admin_headers(),
        timeout=30,
    )
    assert r.status_code == 201, r.text
    return tid, r.json()["key"]


def body(g: GatewayProc, max_tokens: int, stream: bool) -> dict:
    return {
        "model": g.model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def open_streams(c: httpx.Client, g: GatewayProc, key: str, n: int) -> list[httpx.Response]:
    """``n`` streams admitted and left running (their bodies unread); asserts each got 200."""
    out = []
    for _ in range(n):
        req = c.build_request(
            "POST",
            g.base_url + "/v1/chat/completions",
            json=body(g, 4000, True),
            headers={"authorization": f"Bearer {key}"},
        )
        r = c.send(req, stream=True)
        assert r.status_code == 200, r.read()
        out.append(r)
    return out


def one(g: GatewayProc, key: str) -> httpx.Response:
    return httpx.post(
        g.base_url + "/v1/chat/completions",
        json=body(g, 1, False),
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def assert_concurrency_429(r: httpx.Response) -> None:
    assert r.status_code == 429, (r.status_code, r.text[:300])
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["retry-after"]) and 0 < int(r.headers["retry-after-ms"]) <= LEASE_TTL_S * 1000


@pytest.mark.timeout(240)
def test_killed_gateway_frees_its_slots_within_the_lease(tmp_path, fault_gateway):
    redis_proc, redis_url = start_redis(tmp_path)
    db = str(tmp_path / "shared.sqlite")
    started: list[GatewayProc] = []
    try:
        # g2 spawns the one backend, g1 (the one killed) is a second client of it: one model load, not two
        g2 = fault_gateway("--redis-url", redis_url, "--db", db)
        started.append(g2)
        backend_url = g2.stats()["backends"][0]["url"]
        g1 = fault_gateway("--redis-url", redis_url, "--db", db, "--backend-url", backend_url)
        started.append(g1)
        tid, key = new_tenant(g1, max_concurrent=MAX_CONCURRENT)
        with httpx.Client(timeout=30, limits=httpx.Limits(max_connections=20)) as c:
            held = open_streams(c, g1, key, MAX_CONCURRENT)
            assert_concurrency_429(one(g2, key))  # g2 sees g1's slots (shared through Redis)

            # kill -9 the gateway: nothing is released, nothing renewed (the backend it used serves g2 on)
            t_kill = time.monotonic()
            os.kill(g1.proc.pid, signal.SIGKILL)
            g1.proc.wait(10)
            for r in held:
                r.close()

            # a client that waits what each 429 says gets in within the bound (admitted: the response's
            # headers came, before any token is generated)
            waits: list[int] = []
            while True:
                r = c.send(
                    c.build_request(
                        "POST",
                        g2.base_url + "/v1/chat/completions",
                        json=body(g2, 1, True),
                        headers={"authorization": f"Bearer {key}"},
                    ),
                    stream=True,
                )
                admitted_at = time.monotonic()
                r.read()
                r.close()
                if r.status_code == 200:
                    break
                assert_concurrency_429(r)
                waits.append(int(r.headers["retry-after-ms"]))
                assert time.monotonic() - t_kill < RECOVERY_BOUND_S + 5, (waits, "still blocked")
                time.sleep(waits[-1] / 1000)
            recovered_s = admitted_at - t_kill
            print(f"recovered {recovered_s:.2f}s after the kill; retry-after-ms seen: {waits}")
            assert waits, "the slots were free before the leases could lapse"
            assert recovered_s <= RECOVERY_BOUND_S, (recovered_s, waits)

            # the full concurrency again (each of g1's leases lapses on its own, ms apart), and not one more
            mine: list[httpx.Response] = []
            while len(mine) < MAX_CONCURRENT:
                req = c.build_request(
                    "POST",
                    g2.base_url + "/v1/chat/completions",
                    json=body(g2, 4000, True),
                    headers={"authorization": f"Bearer {key}"},
                )
                r = c.send(req, stream=True)
                if r.status_code == 200:
                    mine.append(r)
                    continue
                r.read()
                r.close()
                assert_concurrency_429(r)
                assert time.monotonic() - t_kill <= RECOVERY_BOUND_S, (
                    "the full concurrency is not back in time"
                )
                time.sleep(int(r.headers["retry-after-ms"]) / 1000)
            print(f"full concurrency back {time.monotonic() - t_kill:.2f}s after the kill")
            assert_concurrency_429(one(g2, key))

            # the admin call frees them at once (through either gateway: here the one holding them)
            r = httpx.delete(
                g2.base_url + f"/admin/v1/tenants/{tid}/leases", headers=g2.admin_headers(), timeout=30
            )
            assert r.status_code == 200, r.text
            assert r.json() == {"tenant_id": tid, "cleared": MAX_CONCURRENT, "key_leases_cleared": 0}
            more = open_streams(c, g2, key, MAX_CONCURRENT)
            assert_concurrency_429(one(g2, key))
            for s in mine + more:
                s.close()
            r = httpx.delete(
                g2.base_url + "/admin/v1/tenants/tn_nope/leases", headers=g2.admin_headers(), timeout=30
            )
            assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found"
    finally:
        for g in started:  # no drain needed: kill (the backend follows its gateway, PR_SET_PDEATHSIG)
            g.proc.kill()
            g.proc.wait(10)
            g.stop()
        stop_redis(redis_proc)
