"""Gateway A is killed with SIGKILL while it serves 16 streams of one tenant: gateway B keeps serving (before,
right after and after the kill), A's ledger loses at most what its documented bound allows, and A's
concurrency leases lapse within 10 s (B admits the tenant's full concurrency again).

The traffic on A at the kill: ``STREAMS`` streams of a tenant with ``max_concurrent = STREAMS`` (each read by
a task of its own, so none is stopped as a slow reader), and one client task sending short requests of another
tenant one after another; the client notes when it has read each of these to its end. The ledger loss is
counted from the database: the finished requests (``id`` of the response) without a row. The documented bound
(``auth/ledger.py``, docs/tenancy.md): a crash loses at most the rows recorded in the last ``--ledger-flush-s``
seconds, at most ``--ledger-batch`` of them (the cluster's gateways run with ``LEDGER_FLUSH_S`` and
``LEDGER_BATCH``); a lost row must therefore have finished within ``LEDGER_FLUSH_S`` (plus ``CLOCK_SLACK_S``:
the client reads the end of a response a moment after the gateway records it) of the kill. The streams cut by
the kill never finished: a crash bills none of them (their rows are counted and printed). The kill waits until
the first finished request is older than the loss window, so at least one row must have been written.

The lease lapse is timed from just before the kill to B's admission of the ``STREAMS``-th stream of the tenant,
the client waiting what each 429's ``retry-after-ms`` says.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import trio
from cluster_nodes import LEDGER_BATCH, LEDGER_FLUSH_S, Cluster, chat
from plugins.gateway_server import GatewayProc

pytestmark = pytest.mark.slow

STREAMS = 16
LEASE_BOUND_S = 10.0  # A's leases lapse within this after the kill (they live 6 s without renewal)
LEASE_TTL_S = 6.0  # ratelimit.redis_limiter.LEASE_TTL_S: no concurrency 429 asks to wait longer
CLOCK_SLACK_S = 0.5
FINISHED_BEFORE_KILL = 3  # short requests the client has seen finish on A before the kill


async def serving(c: httpx.AsyncClient, g: GatewayProc) -> None:
    """One short request through ``g`` with its own tenant's key answers 200 with its token."""
    r = await c.post(g.base_url + "/v1/chat/completions", json=chat(g, 1), headers=g.headers())
    assert r.status_code == 200, (r.status_code, r.text[:300])
    assert r.json()["usage"]["completion_tokens"] == 1


async def hold_streams(
    c: httpx.AsyncClient, g: GatewayProc, headers: dict, n: int, deadline: float
) -> tuple[list[httpx.Response], list[int]]:
    """Streams through ``g`` until ``n`` are admitted at once (their bodies left unread; the caller closes
    them): each round sends as many as are missing side by side, and a refused round waits the shortest
    ``retry-after-ms`` its 429s gave. Returns the streams and every ``retry-after-ms`` seen. Fails past
    ``deadline`` (monotonic) or on another answer than a concurrency 429."""
    held: list[httpx.Response] = []
    waits: list[int] = []

    async def one() -> None:
        req = c.build_request(
            "POST", g.base_url + "/v1/chat/completions", json=chat(g, 2000, stream=True), headers=headers
        )
        r = await c.send(req, stream=True)
        if r.status_code == 200:
            held.append(r)
            return
        error = (await r.aread()).decode()
        await r.aclose()
        assert r.status_code == 429 and "Too many concurrent requests" in error, (r.status_code, error)
        waits.append(int(r.headers["retry-after-ms"]))
        assert 0 < waits[-1] <= LEASE_TTL_S * 1000, waits

    while True:
        seen = len(waits)
        async with trio.open_nursery() as nursery:
            for _ in range(n - len(held)):
                nursery.start_soon(one)
        if len(held) >= n:
            return held, waits
        assert time.monotonic() < deadline, (len(held), waits)
        await trio.sleep(min(waits[seen:]) / 1000)


@pytest.mark.timeout(180, func_only=True)
async def test_killed_gateway_b_serves_on_ledger_within_bound_leases_lapse(cluster: Cluster):
    a, b = cluster.node("A"), cluster.node("B")
    streams_t = cluster.new_tenant("A", max_concurrent=STREAMS)
    ledger_t = cluster.new_tenant("A")
    running, killed = trio.Event(), trio.Event()
    started: list[str] = []  # the response id of each stream of A, once its first token is read
    cut: list[str] = []  # how each of A's streams ended
    finished: dict[str, float] = {}  # response id -> when the client had read all of it (monotonic)

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as c:

        def progress() -> None:
            if len(started) >= STREAMS and len(finished) >= FINISHED_BEFORE_KILL:
                running.set()

        async def stream_on_a() -> None:
            url, body = a.base_url + "/v1/chat/completions", chat(a, 4000, stream=True)
            try:
                async with c.stream("POST", url, json=body, headers=streams_t.headers) as r:
                    assert r.status_code == 200, await r.aread()
                    first = True
                    async for line in r.aiter_lines():
                        if first and line.startswith("data: {") and '"content"' in line:
                            first = False
                            started.append(json.loads(line[6:])["id"])
                            progress()
                        elif line == "data: [DONE]":
                            cut.append("done")
                            return
            except httpx.TransportError as e:
                cut.append(type(e).__name__)
                return
            cut.append("ended")

        async def finisher_on_a() -> None:
            body = chat(a, 1)
            while not killed.is_set():
                try:
                    r = await c.post(a.base_url + "/v1/chat/completions", json=body, headers=ledger_t.headers)
                except httpx.TransportError:
                    return  # killed while in flight: not finished
                assert r.status_code == 200, r.text[:300]
                finished[r.json()["id"]] = time.monotonic()
                progress()

        t_start = time.monotonic()
        async with trio.open_nursery() as nursery:
            for _ in range(STREAMS):
                nursery.start_soon(stream_on_a)
            nursery.start_soon(finisher_on_a)
            with trio.fail_after(60):
                await running.wait()
            # the first finished request must be older than the loss window at the kill: its row must be there
            old_enough = min(finished.values()) + LEDGER_FLUSH_S + CLOCK_SLACK_S + 0.2
            await trio.sleep(max(0.0, old_enough - time.monotonic()))
            t_running = time.monotonic()

            await serving(c, b)  # B serves while A runs its streams
            r = await c.post(b.base_url + "/v1/chat/completions", json=chat(b, 1), headers=streams_t.headers)
            assert r.status_code == 429, r.text[:300]  # B counts A's streams (the leases are shared)

            t_kill = time.monotonic()
            await trio.to_thread.run_sync(cluster.kill, "A")
            killed.set()
            # right after the kill, while A's leases lapse: B serves, and admits the tenant's full concurrency
            # again within the bound (and not one more)
            nursery.start_soon(serving, c, b)
            held, waits = await hold_streams(c, b, streams_t.headers, STREAMS, t_kill + LEASE_BOUND_S + 5)
            lapse_s = time.monotonic() - t_kill
            try:
                r = await c.post(
                    b.base_url + "/v1/chat/completions", json=chat(b, 1), headers=streams_t.headers
                )
                assert r.status_code == 429, r.text[:300]
            finally:
                for s in held:
                    await s.aclose()
        assert len(cut) == STREAMS and "done" not in cut and "ended" not in cut, cut
        await serving(c, b)  # and after

    rows = await trio.to_thread.run_sync(cluster.usage, ledger_t.tenant_id)
    written = {row["request_id"] for row in rows}
    lost = {rid: t_kill - t for rid, t in finished.items() if rid not in written}
    stream_rows = await trio.to_thread.run_sync(cluster.usage, streams_t.tenant_id)
    cut_rows = [row for row in stream_rows if row["request_id"] in started]
    print(
        f"A killed during {STREAMS} streams ({sorted(set(cut))}); full concurrency back on B after "
        f"{lapse_s:.2f}s ({len(waits)} 429s, retry-after-ms {min(waits, default=0)}..{max(waits, default=0)}); ledger: {len(finished)} finished on A, "
        f"{len(finished) - len(lost)} rows written, {len(lost)} lost (finished {sorted(lost.values())} s before "
        f"the kill); rows of A's cut streams: {len(cut_rows)}; traffic on A running after "
        f"{t_running - t_start:.1f}s, killed after {t_kill - t_start:.1f}s"
    )
    assert waits, "the slots were free before A's leases could lapse"
    assert lapse_s <= LEASE_BOUND_S
    assert len(written - set(finished)) <= 1, (
        "a row of a request the client did not see finish (only the last)"
    )
    assert any(t_kill - t > LEDGER_FLUSH_S + CLOCK_SLACK_S for t in finished.values()), "no old row to check"
    assert len(lost) <= LEDGER_BATCH
    assert all(ago <= LEDGER_FLUSH_S + CLOCK_SLACK_S for ago in lost.values()), lost
