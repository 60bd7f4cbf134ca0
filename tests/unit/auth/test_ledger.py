"""The usage ledger with real stores: rows written in batches (after ``flush_s``, or at once when ``batch`` are
queued), spooled to disk while PostgreSQL is stopped and written when it is back (none lost, none twice), a
clean shutdown with the store down leaving them on disk, and the spool of a SIGKILLed process written by the
next one to start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
from plugins.postgres_server import create_database, restart_postgres, start_postgres, stop_postgres

from auth.ledger import UsageLedger
from auth.store import open_store

ROOT = Path(__file__).resolve().parents[3]


def usage(tenant: str, i: int) -> dict:
    return {
        "ts": 1000.0 + i,
        "day": "2026-01-02",
        "tenant_id": tenant,
        "key_id": "k",
        "key_prefix": "sk-gw-x",
        "request_id": f"req-{i}",
        "model": "m",
        "prompt_tokens": 1,
        "cached_tokens": 0,
        "completion_tokens": 1,
        "total_tokens": 2,
        "status": 200,
        "finish_reason": "stop",
        "timings": {},
    }


async def stored(store, tenant: str) -> list[str]:
    return sorted(r["request_id"] for r in await store.usage_rows(tenant, limit=10_000))


async def eventually(check, timeout_s: float = 15.0) -> None:
    """Wait (polling every 50 ms) until the async ``check()`` is true; fails past ``timeout_s``."""
    deadline = trio.current_time() + timeout_s
    while not await check():
        assert trio.current_time() < deadline, "not reached in time"
        await trio.sleep(0.05)


async def test_rows_wait_for_flush_s_or_a_full_batch(tmp_path):
    store = open_store(str(tmp_path / "g.db"))
    await store.open()
    ledger = UsageLedger(store, batch=5, flush_s=0.4, spool_dir=str(tmp_path))
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        ledger.record(usage("t", 0))
        await trio.sleep(0.2)
        assert await stored(store, "t") == []  # waiting for its batch
        await trio.sleep(0.4)
        assert await stored(store, "t") == ["req-0"]  # flush_s passed
        for i in range(1, 6):
            ledger.record(usage("t", i))
        await trio.sleep(0.1)
        assert len(await stored(store, "t")) == 6  # a full batch goes at once
        ledger.record(usage("t", 6))
        await ledger.flush()  # a reader (the usage endpoint) does not wait flush_s
        assert len(await stored(store, "t")) == 7
        await ledger.aclose()
    assert not list(tmp_path.glob("ledger-spool-*"))  # an empty spool is removed at a clean shutdown
    await store.aclose()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_row_the_store_refuses_takes_no_other_row_with_it(tmp_path, caplog, kind):
    """An upstream reporting 2^64 completion tokens: the insert overflows for that row alone (SQLite:
    OverflowError in the driver; PostgreSQL: integer out of range). The batch it came in with (two other
    tenants' rows) is written row by row: both are stored, the refused row is logged with its request id and
    kept in the spool folder's reject file, and later batches are written."""
    handle = None
    if kind == "postgres":
        handle, server = start_postgres(tmp_path / "pg")
    try:
        store = open_store(create_database(server) if handle else str(tmp_path / "g.db"))
        await _refused_row_alone(store, tmp_path, caplog)
    finally:
        if handle is not None:
            stop_postgres(handle)


async def _refused_row_alone(store, tmp_path, caplog) -> None:
    await store.open()
    ledger = UsageLedger(store, batch=3, flush_s=0.05, spool_dir=str(tmp_path))
    huge = usage("b", 1) | {"completion_tokens": 2**64, "total_tokens": 2**64 + 1}
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        for row in (usage("a", 0), huge, usage("c", 2)):  # one batch of three
            ledger.record(row)
        await ledger.flush()
        assert await stored(store, "a") == ["req-0"] and await stored(store, "c") == ["req-2"]
        assert await stored(store, "b") == []
        ledger.record(usage("a", 3))
        await ledger.flush()
        assert await stored(store, "a") == ["req-0", "req-3"]
        await ledger.aclose()
    await store.aclose()
    [line] = (tmp_path / "ledger-rejected.jsonl").read_text().splitlines()
    kept = json.loads(line)
    assert kept["row"]["request_id"] == "req-1" and kept["row"]["completion_tokens"] == 2**64
    assert "Overflow" in kept["reason"] or "out of range" in kept["reason"]
    assert any("req-1" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
    assert not list(tmp_path.glob("ledger-spool-*"))  # nothing was an outage: nothing spooled


async def test_postgres_stopped_during_traffic_loses_no_row(tmp_path):
    handle, server = start_postgres(tmp_path / "pg")
    try:
        store = open_store(create_database(server))
        await store.open()
        spool_dir = tmp_path / "spool"
        ledger = UsageLedger(store, batch=8, flush_s=0.05, spool_dir=str(spool_dir))
        async with trio.open_nursery() as nursery:
            await nursery.start(ledger.run)
            n = 0

            async def traffic(seconds: float) -> None:
                nonlocal n
                end = trio.current_time() + seconds
                while trio.current_time() < end:
                    ledger.record(usage("t", n))
                    n += 1
                    await trio.sleep(0.01)

            await traffic(0.3)
            await trio.to_thread.run_sync(stop_postgres, handle)
            await traffic(1.0)
            await ledger.flush()
            assert ledger.spool.rows > 0  # waiting on disk
            lines = (spool_dir / f"ledger-spool-{os.getpid()}.jsonl").read_text().splitlines()
            assert len(lines) == ledger.spool.rows and json.loads(lines[0])["row_id"]
            await trio.to_thread.run_sync(restart_postgres, handle)
            await traffic(0.3)

            async def spool_written() -> bool:
                return ledger.spool.rows == 0

            await eventually(spool_written)
            await ledger.flush()
            assert ledger.spool.rows == 0
            assert await stored(store, "t") == sorted(f"req-{i}" for i in range(n))  # all, once each
            await ledger.aclose()
        await store.aclose()
    finally:
        stop_postgres(handle)


async def test_clean_shutdown_with_the_store_down_keeps_the_rows_on_disk(tmp_path):
    handle, server = start_postgres(tmp_path / "pg")
    try:
        url = create_database(server)
        store = open_store(url)
        await store.open()
        ledger = UsageLedger(store, flush_s=0.05, spool_dir=str(tmp_path))
        async with trio.open_nursery() as nursery:
            await nursery.start(ledger.run)
            await trio.to_thread.run_sync(stop_postgres, handle)
            for i in range(20):
                ledger.record(usage("t", i))
            await ledger.aclose()
        await store.aclose()
        [spool] = tmp_path.glob("ledger-spool-*.jsonl")
        assert len(spool.read_text().splitlines()) == 20
        await trio.to_thread.run_sync(restart_postgres, handle)
        store = open_store(url)
        await store.open()
        ledger = UsageLedger(store, flush_s=0.05, spool_dir=str(tmp_path))
        async with trio.open_nursery() as nursery:
            await nursery.start(ledger.run)  # this process's own (same pid) spool: written at start

            async def all_rows() -> bool:
                return len(await stored(store, "t")) >= 20

            await eventually(all_rows)
            await ledger.aclose()
        assert await stored(store, "t") == sorted(f"req-{i}" for i in range(20))
        await store.aclose()
    finally:
        stop_postgres(handle)


CHILD = textwrap.dedent(
    """
    import sys, trio
    from auth.ledger import UsageLedger
    from auth.store import open_store

    async def main(url, spool_dir, n):
        store = open_store(url)
        await store.open()
        ledger = UsageLedger(store, flush_s=0.05, spool_dir=spool_dir)
        async with trio.open_nursery() as nursery:
            await nursery.start(ledger.run)
            print("ready", flush=True)
            sys.stdin.readline()  # the parent stopped PostgreSQL
            for i in range(n):
                ledger.record({"ts": 1.0, "day": "2026-01-02", "tenant_id": "t", "request_id": f"req-{i}",
                               "total_tokens": 2, "timings": {}})
            await ledger.flush()
            print("spooled", ledger.spool.rows, flush=True)
            await trio.sleep_forever()

    trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
    """
)


async def test_the_spool_of_a_killed_process_is_written_at_the_next_start(tmp_path):
    handle, server = start_postgres(tmp_path / "pg")
    child = None
    try:
        url = create_database(server)
        spool_dir = tmp_path / "spool"
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, url, str(spool_dir), "30"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout.readline().strip() == "ready"
        await trio.to_thread.run_sync(stop_postgres, handle)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["spooled", "30"]
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        assert len((spool_dir / f"ledger-spool-{child.pid}.jsonl").read_text().splitlines()) == 30
        await trio.to_thread.run_sync(restart_postgres, handle)
        store = open_store(url)
        await store.open()
        # a crash between writing a spool and truncating it: some of its rows are stored already
        first = [
            json.loads(x) for x in (spool_dir / f"ledger-spool-{child.pid}.jsonl").read_text().splitlines()
        ]
        await store.insert_usage(first[:10])
        ledger = UsageLedger(store, flush_s=0.05, spool_dir=str(spool_dir))
        async with trio.open_nursery() as nursery:
            await nursery.start(ledger.run)

            async def all_rows() -> bool:
                return len(await stored(store, "t")) >= 30

            await eventually(all_rows)
            await ledger.aclose()
        assert await stored(store, "t") == sorted(f"req-{i}" for i in range(30))  # each once
        assert not (spool_dir / f"ledger-spool-{child.pid}.jsonl").exists()
        await store.aclose()
    finally:
        if child is not None and child.poll() is None:
            child.kill()
        stop_postgres(handle)
