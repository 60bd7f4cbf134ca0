"""The PostgreSQL change feed and the key cache around it, with real servers: a change made through one store
reaches another gateway's authenticator within 1 s; while PostgreSQL is stopped a cached key is served for at
most ``stale_s`` and everything else is a 503 ``store_unavailable``; after a restart both recover by themselves."""

from __future__ import annotations

import time

import pytest
import trio
from plugins.postgres_server import create_database, restart_postgres, start_postgres, stop_postgres

from auth.authenticator import Authenticator
from auth.errors import StoreUnavailable, Unauthenticated
from auth.store import open_store

STALE_S = 3.0  # the stale-serving bound under test (60 s by default); room for a slow pg_ctl stop


def creds(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


async def wait_until(predicate, timeout_s: float = 10.0) -> float:
    """Seconds until ``predicate()`` held (polled every 10 ms); fails the test past ``timeout_s``."""
    t0 = trio.current_time()
    while not predicate():
        assert trio.current_time() - t0 < timeout_s, "condition not reached"
        await trio.sleep(0.01)
    return trio.current_time() - t0


async def refused_after(auth: Authenticator, key: str, timeout_s: float = 5.0) -> float:
    """Seconds until ``key`` is refused (polled every 10 ms)."""
    t0 = trio.current_time()
    while True:
        try:
            await auth.authenticate(creds(key))
        except Unauthenticated:
            return trio.current_time() - t0
        assert trio.current_time() - t0 < timeout_s, "still accepted"
        await trio.sleep(0.01)


async def test_a_change_on_one_gateway_reaches_the_other_within_1s(pg_database_url):
    a, b = open_store(pg_database_url), open_store(pg_database_url)
    await a.open()
    await b.open()
    auth_b = Authenticator(b, admin_key=None, cache_ttl_s=1.0, feed_ttl_s=30.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.feed.run, auth_b.invalidate)
        await wait_until(lambda: b.feed.connected)
        assert auth_b.ttl_s() == 30.0  # with the feed listening, lookups are trusted longer
        tn = await a.create_tenant("acme")
        key, rec = await a.create_key(tn.id)
        assert (await auth_b.authenticate(creds(key))).tenant_id == tn.id  # created on A: works on B at once
        await a.revoke_key(rec.id)
        assert await refused_after(auth_b, key) < 1.0
        key2, _ = await a.create_key(tn.id)
        await auth_b.authenticate(creds(key2))
        await a.update_tenant(tn.id, disabled=True)
        assert await refused_after(auth_b, key2) < 1.0
        nursery.cancel_scope.cancel()
    await a.aclose()
    await b.aclose()


async def test_store_down_serves_cached_keys_for_stale_s_then_recovers(tmp_path):
    handle, server_url = start_postgres(tmp_path / "pg")
    try:
        url = create_database(server_url)
        store = open_store(url)
        store.fail_fast_s = 0.2  # the breaker's window after a failed call (1 s by default)
        await store.open()
        tn = await store.create_tenant("acme")
        cached, _ = await store.create_key(tn.id)
        uncached, _ = await store.create_key(tn.id)
        auth = Authenticator(store, admin_key=None, cache_ttl_s=0.2, feed_ttl_s=0.2, stale_s=STALE_S)
        async with trio.open_nursery() as nursery:
            await nursery.start(store.feed.run, auth.invalidate)
            await wait_until(lambda: store.feed.connected)
            await auth.authenticate(creds(cached))
            confirmed = trio.current_time()
            await trio.to_thread.run_sync(stop_postgres, handle)
            await wait_until(lambda: not store.feed.connected)
            await trio.sleep(0.3)  # past the TTL: the lookup goes to the store, which is down
            t0 = trio.current_time()
            assert (await auth.authenticate(creds(cached))).tenant_id == tn.id  # served stale
            assert trio.current_time() - t0 < 3.0
            with pytest.raises(StoreUnavailable) as ei:
                await auth.authenticate(creds(uncached))
            assert (ei.value.status, ei.value.code, ei.value.headers) == (
                503,
                "store_unavailable",
                {"retry-after": "1"},
            )
            while trio.current_time() - confirmed < STALE_S - 0.5:  # served for stale_s after its last check
                await auth.authenticate(creds(cached))
                await trio.sleep(0.1)
            await trio.sleep(max(0.0, confirmed + STALE_S + 0.1 - trio.current_time()))
            with pytest.raises(StoreUnavailable):  # and not after
                await auth.authenticate(creds(cached))
            assert auth.stale_served > 0
            with pytest.raises(StoreUnavailable):  # the admin API's calls too, at once (the breaker)
                await store.list_tenants()
            await trio.to_thread.run_sync(restart_postgres, handle)
            await wait_until(lambda: store.feed.connected)  # the feed reconnects by itself
            await trio.sleep(0.3)  # the breaker's window
            assert (await auth.authenticate(creds(uncached))).tenant_id == tn.id  # the pool reconnected
            assert [t.name for t in await store.list_tenants()] == ["acme"]
            nursery.cancel_scope.cancel()
        await store.aclose()
    finally:
        stop_postgres(handle)


async def test_a_call_with_the_server_stopped_fails_within_3s(tmp_path):
    handle, server_url = start_postgres(tmp_path / "pg")
    try:
        store = open_store(create_database(server_url))
        await store.open()
        await store.count_tenants()
        await trio.to_thread.run_sync(stop_postgres, handle)
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.count_tenants()
        assert time.monotonic() - t0 < 3.0
        await store.aclose()
    finally:
        stop_postgres(handle)
