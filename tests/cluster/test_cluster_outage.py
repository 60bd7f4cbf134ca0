"""PostgreSQL, then Redis, stopped during traffic through both gateways, and started again.

Traffic: ``CLIENTS_PER_NODE`` client tasks per gateway send short requests of one tenant one after another,
the whole time (each bounded by ``REQUEST_TIMEOUT_S``: a hang is a failure, not a wait). The tenant has limits,
so every admission goes to Redis; its key is cached by both gateways before the outages.

* PostgreSQL stopped (``pg_ctl stop -m fast``) for ``OUTAGE_S``: the cached key goes on being served, past the
  key cache's TTL too (a request through each gateway is admitted; none of the traffic is refused); a key no
  gateway has seen cannot be looked up: 503 with ``retry-after``. Once it is back (timed from its restart): the
  admin API answers again and a key created then works on the other gateway.
* Redis stopped for ``OUTAGE_S``: a request through each gateway is a 503 ``rate_limiter_unavailable`` with
  ``retry-after``, at once; so is every request of the traffic sent and answered in the outage. Once it is back,
  each gateway admits again (timed from the restart to the first admission, probed every 50 ms).
* Throughout: every answer is a 200 or a 503 with ``retry-after`` and an error code; never a 500, a 401, a
  timeout or a dropped connection; no gateway is restarted. Afterwards every request that got a 200 has its
  ledger row in the database (the rows of the outage waited in the gateways' spools).

The checks made during an outage and after a restart are probes of the test's own (streams, whose status line
comes at admission), so they hold however slowly the shared backend generates; the traffic checks what every
answer is. With ``LLM_GATEWAY_CLUSTER_STORE=sqlite`` there is no database server: the PostgreSQL part is left
out.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import httpx
import pytest
import trio
from cluster_nodes import Cluster, chat
from plugins.gateway_server import GatewayProc

pytestmark = pytest.mark.slow

CLIENTS_PER_NODE = 2
REQUEST_TIMEOUT_S = 20.0
OUTAGE_S = 1.5  # longer than the key cache's TTL: the stale-serving path is taken
KEY_CACHE_S = 1.0  # --key-cache-s: how long a lookup is trusted while the change feed is down
RECOVERY_BOUND_S = 5.0  # service is back within this after a restart
PAUSE_S = 0.02  # between two requests of a client task
TRAFFIC_S = 0.3  # traffic before, between and after the outages
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


@dataclass
class Probe:
    status: int
    headers: dict
    error: dict  # the error object of a refusal, else {}
    id: str  # the response id of an admitted request, else ""
    admitted_at: float  # monotonic: when the status line came (admitted or refused)


async def probe(c: httpx.AsyncClient, g: GatewayProc, headers: dict) -> Probe:
    """One streamed request of one token through ``g``, read to its end. Its status line comes at admission,
    before any token is generated, so a slow backend does not delay the verdict; an admitted one is read to its
    end (for the ledger)."""
    async with c.stream(
        "POST", g.base_url + "/v1/chat/completions", json=chat(g, 1, stream=True), headers=headers
    ) as r:
        at = time.monotonic()
        if r.status_code != 200:
            return Probe(r.status_code, dict(r.headers), json.loads(await r.aread())["error"], "", at)
        lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
        return Probe(200, dict(r.headers), {}, json.loads(lines[-1][6:])["id"], at)


async def admitted_again(c: httpx.AsyncClient, g: GatewayProc, headers: dict, since: float) -> Probe:
    """Probe ``g`` every 50 ms until a request is admitted (a 503 with ``retry-after`` meanwhile); returns that
    probe. Fails ``RECOVERY_BOUND_S`` after ``since``."""
    while True:
        p = await probe(c, g, headers)
        if p.status == 200:
            return p
        assert p.status == 503 and int(p.headers["retry-after"]) >= 1, p
        assert time.monotonic() - since < RECOVERY_BOUND_S, f"no admission within {RECOVERY_BOUND_S}s: {p}"
        await trio.sleep(0.05)


@pytest.mark.timeout(180, func_only=True)
async def test_store_then_redis_stopped_during_traffic(cluster: Cluster):
    nodes = {name: cluster.node(name) for name in ("A", "B")}
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
            await trio.sleep(TRAFFIC_S)

            if cluster.store.kind == "postgresql":
                await trio.to_thread.run_sync(cluster.store.stop)
                down = time.monotonic()
                await fresh_key_answers(c)
                # past the key cache's TTL: the cached key is served stale, its request admitted and billed
                await trio.sleep(max(0.0, down + KEY_CACHE_S + 0.2 - time.monotonic()))
                for name, g in nodes.items():
                    p = await probe(c, g, t.headers)
                    assert p.status == 200, (name, p)
                    ok_ids.append(p.id)
                await trio.sleep(max(0.0, down + OUTAGE_S - time.monotonic()))
                windows["store"] = (down, time.monotonic())
                await trio.to_thread.run_sync(cluster.store.start)
                back = time.monotonic()
                await store_back(c, back)
                await trio.sleep(TRAFFIC_S)

            await trio.to_thread.run_sync(cluster.stop_redis)
            down = time.monotonic()
            for name, g in nodes.items():  # nothing is admitted: a 503 at once
                t0 = time.monotonic()
                p = await probe(c, g, t.headers)
                assert p.status == 503 and int(p.headers["retry-after"]) >= 1, (name, p)
                assert p.error["code"] == "rate_limiter_unavailable", (name, p)
                assert p.admitted_at - t0 < 3.0, (name, "a refusal must not wait for Redis")
            await trio.sleep(max(0.0, down + OUTAGE_S - time.monotonic()))
            windows["redis"] = (down, time.monotonic())
            await trio.to_thread.run_sync(cluster.ensure_redis)
            back = time.monotonic()

            async def recovery(name: str) -> None:
                p = await admitted_again(c, nodes[name], t.headers, back)
                ok_ids.append(p.id)
                measured[f"{name} admits again after the Redis restart"] = p.admitted_at - back

            async with trio.open_nursery() as probes:
                for name in nodes:
                    probes.start_soon(recovery, name)
            await trio.sleep(TRAFFIC_S)
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
    # of the traffic's requests sent and answered while Redis was down, none was admitted (how many there are
    # depends on the machine's speed: the probes above are the check that always runs)
    lo, hi = windows["redis"]
    during = [a for a in answers if lo <= a.sent and a.done <= hi]
    assert all(a.status == 503 and code_of(a) == "rate_limiter_unavailable" for a in during), [
        (a.status, code_of(a)) for a in during if a.status != 503
    ][:5]

    if "store" in windows:  # the cached key was never refused while PostgreSQL was down (stale-served)
        lo, hi = windows["store"]
        refused = [a for a in answers if lo <= a.sent <= hi and a.status != 200]
        assert refused == [], refused[:5]

    # no ledger row lost for a 200 (the spools drain once the store is back)
    rows = await trio.to_thread.run_sync(
        lambda: cluster.usage(t.tenant_id, at_least=len(ok_ids), timeout=LEDGER_DRAIN_S)
    )
    missing = set(ok_ids) - {row["request_id"] for row in rows}
    print(f"ledger: {len(ok_ids)} requests answered 200, {len(missing)} without a row")
    assert not missing
