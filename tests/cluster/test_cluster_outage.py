"""PostgreSQL, then Redis, stopped during traffic through both gateways, and started again.

Traffic: ``CLIENTS_PER_NODE`` client tasks per gateway send short requests of one tenant one after another,
the whole time (each bounded by ``REQUEST_TIMEOUT_S``: a hang is a failure, not a wait). The tenant has limits,
so every admission goes to Redis; its key is cached by both gateways before the outages.

* PostgreSQL stopped (``pg_ctl stop -m fast``) for ``OUTAGE_S``: the cached key goes on being served (200); a
  key no gateway has seen cannot be looked up: 503 with ``retry-after``. Once it is back (timed from its restart):
  the admin API answers again and a key created then works on the other gateway.
* Redis stopped for ``OUTAGE_S``: every admitted request is a 503 ``rate_limiter_unavailable`` with
  ``retry-after``. Once it is back, each gateway's traffic gets a 200 again (timed from the restart).
* Throughout: every answer is a 200 or a 503 with ``retry-after`` and an error code; never a 500, a 401, a
  timeout or a dropped connection; no gateway is restarted. Afterwards every request that got a 200 has its
  ledger row in the database (the rows of the outage waited in the gateways' spools).

With ``LLM_GATEWAY_CLUSTER_STORE=sqlite`` there is no database server: the PostgreSQL part is left out.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import httpx
import pytest
import trio
from cluster_nodes import Cluster, chat

pytestmark = pytest.mark.slow

CLIENTS_PER_NODE = 2
REQUEST_TIMEOUT_S = 10.0
OUTAGE_S = 2.0
RECOVERY_BOUND_S = 5.0  # service is back within this after a restart
PAUSE_S = 0.02  # between two requests of a client task
LEDGER_DRAIN_S = 20.0  # the spooled rows are in the database within this after the store is back


@dataclass
class Answer:
    node: str
    sent: float  # monotonic
    done: float
    status: int  # 0: no response (timeout or connection error)
    headers: dict
    body: dict | str


def code_of(a: Answer) -> str | None:
    error = a.body.get("error") if isinstance(a.body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


async def first_ok(answers: list[Answer], node: str, since: float, deadline: float) -> float:
    """Seconds from ``since`` to the first 200 of ``node`` sent at or after ``since``; fails at ``deadline``."""
    while True:
        ok = [a.done for a in answers if a.node == node and a.sent >= since and a.status == 200]
        if ok:
            return min(ok) - since
        seen = [
            (round(a.sent - since, 2), a.status, code_of(a))
            for a in answers
            if a.node == node and a.sent >= since
        ]
        assert time.monotonic() < deadline, (
            f"{node}: no 200 within {deadline - since:.1f}s of the restart: {seen}"
        )
        await trio.sleep(0.02)


@pytest.mark.timeout(180)
async def test_store_then_redis_stopped_during_traffic(cluster: Cluster):
    nodes = {name: cluster.node(name) for name in ("A", "B")}
    cluster.ensure_redis()
    t = cluster.new_tenant("A", rpm=100_000, max_concurrent=64)
    answers: list[Answer] = []
    ok_ids: list[str] = []
    stop = trio.Event()
    measured: dict[str, float] = {}

    async def client(c: httpx.AsyncClient, name: str) -> None:
        g = nodes[name]
        while not stop.is_set():
            sent = time.monotonic()
            try:
                r = await c.post(g.base_url + "/v1/chat/completions", json=chat(g, 1), headers=t.headers)
                status, headers, text = r.status_code, dict(r.headers), r.text
            except httpx.TransportError as e:  # a timeout or a dropped connection
                status, headers, text = 0, {}, repr(e)
            try:
                body: dict | str = r.json() if status else text
            except ValueError:
                body = text
            answers.append(Answer(name, sent, time.monotonic(), status, headers, body))
            if status == 200:
                ok_ids.append(body["id"])  # type: ignore[index]
            await trio.sleep(PAUSE_S)

    async def fresh_key_answers(c: httpx.AsyncClient) -> None:
        """A key no gateway has seen, while the store is down: 503 with retry-after on both."""
        unknown = {"authorization": "Bearer sk-gw-" + os.urandom(32).hex()[:43]}
        for name, g in nodes.items():
            r = await c.get(g.base_url + "/v1/models", headers=unknown)
            assert r.status_code == 503, (name, r.status_code, r.text[:300])
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"], (name, r.text[:300])

    async def store_back(c: httpx.AsyncClient, since: float) -> None:
        """The admin API creates a key again, and it works on the other gateway."""
        a, b = nodes["A"], nodes["B"]
        while True:
            r = await c.post(
                a.base_url + f"/admin/v1/tenants/{t.tenant_id}/keys", json={}, headers=a.admin_headers()
            )
            if r.status_code == 201:
                break
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, (r.status_code, r.text[:300])
            assert time.monotonic() - since < RECOVERY_BOUND_S, "the admin API did not come back"
            await trio.sleep(0.05)
        measured["admin API of A back after the store restart"] = time.monotonic() - since
        new_key = {"authorization": f"Bearer {r.json()['key']}"}
        while (r := await c.get(b.base_url + "/v1/models", headers=new_key)).status_code != 200:
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, (r.status_code, r.text[:300])
            assert time.monotonic() - since < RECOVERY_BOUND_S, "B did not look keys up again"
            await trio.sleep(0.05)
        measured["a key new to B works on B after the store restart"] = time.monotonic() - since

    windows: dict[str, tuple[float, float]] = {}
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as c:
        for g in nodes.values():  # both gateways have the key cached
            r = await c.post(g.base_url + "/v1/chat/completions", json=chat(g, 1), headers=t.headers)
            assert r.status_code == 200, r.text[:300]
            ok_ids.append(r.json()["id"])
        async with trio.open_nursery() as nursery:
            for name in nodes:
                for _ in range(CLIENTS_PER_NODE):
                    nursery.start_soon(client, c, name)
            await trio.sleep(0.5)

            if cluster.store.kind == "postgresql":
                await trio.to_thread.run_sync(cluster.store.stop)
                down = time.monotonic()
                await fresh_key_answers(c)
                await trio.sleep(OUTAGE_S)
                windows["store"] = (down, time.monotonic())
                await trio.to_thread.run_sync(cluster.store.start)
                back = time.monotonic()
                await store_back(c, back)
                await trio.sleep(0.5)

            await trio.to_thread.run_sync(cluster.stop_redis)
            down = time.monotonic()
            await trio.sleep(OUTAGE_S)
            windows["redis"] = (down, time.monotonic())
            await trio.to_thread.run_sync(cluster.ensure_redis)
            back = time.monotonic()
            for name in nodes:
                took = await first_ok(answers, name, back, back + RECOVERY_BOUND_S)
                measured[f"{name} serves again after the Redis restart"] = took
            await trio.sleep(0.5)
            stop.set()

    statuses = sorted({a.status for a in answers})
    print(
        f"outage traffic: {len(answers)} answers, statuses {statuses}; "
        + "; ".join(f"{k}: {v * 1000:.0f} ms" for k, v in measured.items())
    )
    bad = [a for a in answers if a.status not in (200, 503)]
    assert bad == [], bad[:5]
    for a in answers:
        if a.status == 503:
            assert int(a.headers["retry-after"]) >= 1 and code_of(a), a
    # while Redis was down (requests sent after it stopped), nothing was admitted
    lo, hi = windows["redis"]
    during = [a for a in answers if lo <= a.sent and a.done <= hi]
    assert during and all(a.status == 503 and code_of(a) == "rate_limiter_unavailable" for a in during), [
        (a.status, code_of(a)) for a in during if a.status != 503
    ][:5]
    if "store" in windows:  # while PostgreSQL was down, the cached key was served (a request is authenticated
        lo, hi = windows[
            "store"
        ]  # as it arrives: sent in the outage is enough, it may end after the restart)
        during = [a for a in answers if lo <= a.sent <= hi - 0.2]
        for name in nodes:
            assert any(a.node == name and a.status == 200 for a in during), (name, {a.status for a in during})

    # no ledger row lost for a 200 (the spools drain once the store is back)
    rows = await trio.to_thread.run_sync(
        lambda: cluster.usage(t.tenant_id, at_least=len(ok_ids), timeout=LEDGER_DRAIN_S)
    )
    missing = set(ok_ids) - {row["request_id"] for row in rows}
    print(f"ledger: {len(ok_ids)} requests answered 200, {len(missing)} without a row")
    assert not missing
