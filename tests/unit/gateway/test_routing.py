"""Routing among replicas (gateway/backends/routing.py) and ``BackendPool.pick`` / drains over it.

Checked: the route key is the chained key of the leading full blocks, salted, stable across processes (a
fixed digest, not Python's randomized ``hash``); rendezvous hashing spreads keys evenly and moves only the
keys of a removed replica; the load bound falls back to least-loaded; least-loaded takes idle replicas in
turn; the pool skips drained backends, answers 503 at once when all are drained, and ``pick()`` without a
prompt still works.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import trio

from gateway.backends.pool import BackendPool
from gateway.backends.request import BackendUnavailable
from gateway.backends.routing import Router, RoutingConfig, prefix_key, rendezvous, routing_config
from gateway.backends.supervisor import BackendSupervisor
from gateway.sections import BackendSettings

BS = 16


def prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


def test_prefix_key_is_the_salted_chain_of_the_leading_full_blocks():
    a = prompt(1)
    same_start = a[:BS] + prompt(2)[BS:]
    assert prefix_key(a, BS, "t1") == prefix_key(same_start, BS, "t1")  # one block: only the first counts
    assert prefix_key(a, BS, "t1", blocks=2) != prefix_key(same_start, BS, "t1", blocks=2)
    assert prefix_key(a, BS, "t1") != prefix_key(a, BS, "t2")  # the tenant salt separates namespaces
    assert prefix_key(a[: BS - 1], BS, "t1") is None  # no full block: no key
    assert prefix_key(a[:BS], BS, "t1", blocks=4) == prefix_key(a, BS, "t1", blocks=1)  # fewer blocks
    assert prefix_key(a, 32, "t1") != prefix_key(a, BS, "t1")
    with pytest.raises(ValueError):
        prefix_key(a, 0, "t1")


def test_prefix_key_is_stable_across_processes():
    # BLAKE2b, not hash(): the same digest in every process (PYTHONHASHSEED does not matter)
    assert prefix_key(list(range(40)), BS, "t", blocks=2).hex() == "c837b6e42de02443d3791ae303c58e29"


def test_rendezvous_spreads_keys_and_moves_only_the_removed_replicas():
    ids = ["backend-0", "backend-1", "backend-2"]
    keys = [prefix_key(prompt(s, BS), BS, "") for s in range(3000)]
    owner = [rendezvous(k, ids) for k in keys]  # type: ignore[arg-type]
    for i in range(3):
        assert 800 < owner.count(i) < 1200
    smaller = ["backend-0", "backend-2"]
    for k, o in zip(keys, owner, strict=True):
        now = smaller[rendezvous(k, smaller)]  # type: ignore[arg-type]
        if ids[o] != "backend-1":
            assert now == ids[o]  # a key stays where it was unless its replica left
    with pytest.raises(ValueError):
        rendezvous(b"k", [])


def test_router_prefers_the_rendezvous_replica_until_the_load_bound():
    ids = ["a", "b"]
    p = prompt(7)
    key = prefix_key(p, BS, "t")
    assert key is not None
    pref = rendezvous(key, ids)
    other = 1 - pref
    r = Router(RoutingConfig(max_waiting=2))
    loads = [0, 0]
    loads[pref] = 2  # two beyond the other: still preferred
    assert r.choose(ids, loads, p, "t", BS) == pref
    loads[pref] = 3  # three beyond: the least-loaded takes it
    assert r.choose(ids, loads, p, "t", BS) == other
    assert (r.routed_prefix, r.routed_fallback) == (1, 1)
    assert Router(RoutingConfig(policy="least-loaded")).choose(ids, [5, 1], p, "t", BS) == 1
    assert r.choose(ids, [0, 0], p[: BS - 1], "t", BS) in (0, 1)  # no full block: least-loaded
    with pytest.raises(ValueError):
        r.choose(ids, [0], p, "t", BS)


def test_least_loaded_takes_idle_replicas_in_turn():
    r = Router(RoutingConfig(policy="least-loaded"))
    assert [r.choose(["a", "b", "c"], [0, 0, 0]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert r.choose(["a", "b", "c"], [3, 1, 2]) == 1


def test_routing_config_reads_the_backend_table():
    cfg = routing_config(BackendSettings(routing="least-loaded", route_prefix_blocks=3, route_max_waiting=0))
    assert cfg == RoutingConfig("least-loaded", 3, 0)
    assert routing_config(BackendSettings()) == RoutingConfig("prefix", 8, 4)


def fake_pool(n: int, **kw) -> BackendPool:
    sups = []
    for i in range(n):
        s = BackendSupervisor(url=f"unix:/tmp/b{i}.sock", name=f"backend-{i}")
        s.client = SimpleNamespace(alive=True, in_flight=0, ready=SimpleNamespace(block_size=BS))  # type: ignore[assignment]
        sups.append(s)
    return BackendPool(sups, wait_timeout=0.2, **kw)


async def test_pick_routes_one_prefix_to_one_backend_and_skips_drained_ones():
    pool = fake_pool(3)
    p = prompt(3, 200)
    first = await pool.pick(p, "tn_1")
    lead = 8 * BS  # the default route key: the first 8 full blocks
    assert all([await pool.pick(p[:lead] + prompt(s, 200)[lead:], "tn_1") is first for s in range(5)])
    name = next(s.name for s in pool.supervisors if s.client is first)
    pool.drain(name)
    again = await pool.pick(p, "tn_1")
    assert again is not first
    assert await pool.wait_drained(name, 0)  # nothing in flight on it
    pool.undrain(name)
    assert await pool.pick(p, "tn_1") is first
    assert await pool.pick() in [s.client for s in pool.supervisors]  # no prompt: least-loaded
    with pytest.raises(KeyError):
        pool.drain("backend-9")


async def test_all_drained_is_503_at_once_and_drain_waits_for_in_flight():
    pool = fake_pool(2, routing=RoutingConfig(policy="least-loaded"))
    for s in pool.supervisors:
        pool.drain(s.name)
    assert not pool.is_ready()
    with trio.fail_after(0.1):  # at once, not after wait_timeout
        with pytest.raises(BackendUnavailable, match="drained"):
            await pool.pick()
    busy = pool.supervisors[0].client
    busy.in_flight = 1  # type: ignore[union-attr]
    assert await pool.wait_drained("backend-0", 0.1) is False

    async def finish() -> None:
        await trio.sleep(0.05)
        busy.in_flight = 0  # type: ignore[union-attr]

    async with trio.open_nursery() as n:
        n.start_soon(finish)
        assert await pool.wait_drained("backend-0", 2.0) is True
