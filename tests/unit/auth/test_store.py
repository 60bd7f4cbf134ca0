"""The tenancy store on both backends (a real SQLite file; a real PostgreSQL server, one database per test):
tenants and keys, key lookup, the ledger's rows, daily totals, summaries and spend, migrations."""

from __future__ import annotations

import time

import pytest
import trio

from auth.errors import StoreUnavailable
from auth.keys import hash_key
from auth.postgres_store import PostgresDatabase
from auth.schema import MIGRATIONS, translate
from auth.store import open_store
from ratelimit.core import Limits


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "g.db")
    return request.getfixturevalue("pg_database_url")


@pytest.fixture
async def store(location):
    s = open_store(location)
    await s.open()
    yield s
    await s.aclose()


def row(tenant: str, key: str | None, *, model: str = "m", day: str = "2026-01-02", ts: float = 1.0, **kw):
    return {
        "ts": ts,
        "day": day,
        "tenant_id": tenant,
        "key_id": key,
        "key_prefix": "sk-gw-x",
        "request_id": kw.pop("request_id", "req"),
        "model": model,
        "prompt_tokens": kw.pop("prompt", 3),
        "cached_tokens": 0,
        "completion_tokens": kw.pop("completion", 4),
        "total_tokens": kw.pop("total", 7),
        "status": 200,
        "finish_reason": "stop",
        "timings": {"ttft_ms": 1.5},
        **kw,
    }


async def test_tenants_crud(store):
    assert await store.count_tenants() == 0
    t = await store.create_tenant("acme", Limits(rpm=5), {"hooks": []})
    assert t.id.startswith("tn_") and t.limits.rpm == 5 and t.filters == {"hooks": []} and not t.disabled
    assert isinstance(t.created_at, float) and abs(t.created_at - time.time()) < 60
    with pytest.raises(ValueError, match="already exists"):
        await store.create_tenant("acme")
    b = await store.create_tenant("beta")
    assert [x.name for x in await store.list_tenants()] == ["acme", "beta"]
    assert (await store.get_tenant("acme")).id == t.id and (await store.get_tenant(t.id)).name == "acme"
    u = await store.update_tenant(t.id, disabled=True, limits=Limits(tpm=9), filters={})
    assert u.disabled and u.limits.tpm == 9 and u.limits.rpm is None and u.filters == {}
    with pytest.raises(ValueError):
        await store.update_tenant(t.id, name="beta")
    assert (await store.update_tenant(t.id, name="acme2")).name == "acme2"
    k, rec = await store.create_key(b.id, name="one")
    assert await store.delete_tenant(b.id) and not await store.delete_tenant(b.id)
    assert await store.get_tenant(b.id) is None
    gone = await store.get_tenant(b.id, include_deleted=True)
    assert gone.deleted_at is not None and gone.disabled
    assert (await store.get_key(rec.id)).revoked_at is not None  # its keys were revoked
    assert await store.count_tenants() == 2 and [x.name for x in await store.list_tenants()] == ["acme2"]
    await store.create_tenant("beta")  # the name is free again


async def test_keys_and_lookup(store):
    t = await store.create_tenant("acme")
    secret, rec = await store.create_key(t.id, name="one", expires_at=123.5, limits=Limits(rpm=2))
    assert rec.hash == hash_key(secret) and secret.startswith(rec.prefix) and rec.expires_at == 123.5
    found = await store.find_key(hash_key(secret))
    assert found is not None and found[0].id == rec.id and found[1].id == t.id and found[0].limits.rpm == 2
    assert await store.find_key(hash_key("sk-gw-nope")) is None
    _, rec2 = await store.create_key(t.id)
    assert [k.id for k in await store.list_keys(t.id)] == [rec.id, rec2.id]
    upd = await store.update_key(rec.id, name=None, expires_at=None, limits=None)
    assert upd.name is None and upd.expires_at is None and upd.limits is None
    assert (await store.update_key(rec.id)).id == rec.id  # nothing to change
    revoked = await store.revoke_key(rec.id)
    assert revoked.revoked_at is not None
    assert (await store.revoke_key(rec.id)).revoked_at == revoked.revoked_at  # once
    assert await store.get_key("key_none") is None and await store.revoke_key("key_none") is None


async def test_usage_rows_totals_and_spend(store):
    a, b = await store.create_tenant("a"), await store.create_tenant("b")
    rows = [
        row(a.id, "k1", ts=100.0, row_id="r1", request_id="x1"),
        row(a.id, "k1", ts=200.0, row_id="r2", model="n", total=10, prompt=4, completion=6),
        row(a.id, "k2", ts=90_000.0, row_id="r3", day="2026-01-03"),
        row(b.id, "k3", ts=150.0, row_id="r4", total=100, prompt=50, completion=50),
    ]
    assert await store.insert_usage(rows) == 4
    assert await store.insert_usage(rows[:2] + [row(a.id, "k1", ts=300.0, row_id="r5")]) == 1  # replay: once
    assert await store.tokens_on_day(tenant_id=a.id, day="2026-01-02") == 24
    assert await store.tokens_on_day(key_id="k2", day="2026-01-03") == 7
    assert await store.tokens_on_day(tenant_id="tn_none", day="2026-01-02") == 0
    s = await store.usage_summary(a.id, 100.0, 90_000.0)
    assert s["totals"] == {
        "requests": 3,
        "prompt_tokens": 10,
        "cached_tokens": 0,
        "completion_tokens": 14,
        "total_tokens": 24,
    }
    assert [d["day"] for d in s["days"]] == ["2026-01-02"]
    assert (await store.usage_summary(a.id, None, None))["totals"]["requests"] == 4
    newest = await store.usage_rows(a.id, limit=2)
    assert [r["row_id"] for r in newest] == ["r5", "r3"] and newest[0]["timings"] == {"ttft_ms": 1.5}
    total, by_tenant = await store.spend(group_by="tenant")
    assert total["total_tokens"] == 131 and total["requests"] == 5
    assert [(g["group"], g["total_tokens"]) for g in by_tenant] == [(b.id, 100), (a.id, 31)]
    _, by_model = await store.spend(tenant_id=a.id, group_by="model")
    assert [(g["group"], g["requests"]) for g in by_model] == [("m", 3), ("n", 1)]
    _, by_day = await store.spend(tenant_id=a.id, group_by="day", since=150.0)
    assert [(g["group"], g["total_tokens"]) for g in by_day] == [("2026-01-02", 17), ("2026-01-03", 7)]
    _, by_key = await store.spend(key_id="k1", model="m", until=250.0, group_by="key")
    assert by_key == [
        {
            "group": "k1",
            "requests": 1,
            "prompt_tokens": 3,
            "cached_tokens": 0,
            "completion_tokens": 4,
            "total_tokens": 7,
        }
    ]
    with pytest.raises(ValueError):
        await store.spend(group_by="nope")


async def test_migrations_apply_once(location):
    for _ in range(2):
        s = open_store(location)
        await s.open()
        await s.create_tenant(f"t{time.monotonic_ns()}")
        await s.aclose()
    s = open_store(location)
    await s.open()
    assert await s.count_tenants() == 2

    def versions() -> list[int]:
        with s.sync.db.transaction(write=False) as tx:
            return [r["version"] for r in tx.rows("SELECT version FROM schema_version ORDER BY version")]

    assert await trio.to_thread.run_sync(versions) == list(range(1, len(MIGRATIONS) + 1))
    await s.aclose()


def test_postgres_dialect():
    ddl = translate("id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL, x = ?", "postgresql")
    assert ddl == "id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, ts DOUBLE PRECISION, x = %s"
    assert translate("ts REAL = ?", "sqlite") == "ts REAL = ?"
    with pytest.raises(ValueError):
        translate("", "mysql")


def test_two_gateways_migrate_one_postgres_database_at_once(pg_database_url):
    """Eight stores opening a fresh database at the same moment: the advisory lock serialises the migrations,
    each applied once."""
    import threading

    dbs, errors = [], []

    def open_one():
        try:
            dbs.append(PostgresDatabase(pg_database_url, pool_size=1))
        except Exception as e:  # pragma: no cover - the assertion below shows it
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(dbs) == 8
    with dbs[0].transaction(write=False) as tx:
        versions = [r["version"] for r in tx.rows("SELECT version FROM schema_version ORDER BY version")]
    assert versions == list(range(1, len(MIGRATIONS) + 1))
    for db in dbs:
        db.close()


async def test_unreachable_postgres_fails_fast():
    """Nothing listens on the port: opening raises StoreUnavailable within the connect timeout."""
    from plugins.gateway_server import free_port

    s = open_store(f"postgresql://postgres@127.0.0.1:{free_port()}/x")
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as ei:
        await s.open()
    assert time.monotonic() - t0 < 4.0
    assert (ei.value.status, ei.value.code, ei.value.headers["retry-after"]) == (
        503,
        "store_unavailable",
        "1",
    )


async def test_models_and_model_limits_round_trip(store):
    """A tenant's models (null: every model) and its limits per model; a key's own models; unchanged when not
    given, cleared when given as None / {}; the key lookup returns them."""
    t = await store.create_tenant("acme")
    assert t.models is None and t.model_limits == {}
    t = await store.create_tenant(
        "beta", models=["m1", "m2:7b"], model_limits={"m1": Limits(rpm=2, window_s=5.0), "m3": Limits()}
    )
    assert t.models == ["m1", "m2:7b"]
    assert t.model_limits == {"m1": Limits(rpm=2, window_s=5.0), "m3": Limits()}
    u = await store.update_tenant(t.id, disabled=True)
    assert u.models == ["m1", "m2:7b"] and u.model_limits["m1"].rpm == 2  # not given: unchanged
    u = await store.update_tenant(t.id, models=[], model_limits={"m2:7b": Limits(daily_tokens=9)})
    assert u.models == [] and u.model_limits == {"m2:7b": Limits(daily_tokens=9)}
    u = await store.update_tenant(t.id, models=None, model_limits={})
    assert u.models is None and u.model_limits == {}
    secret, k = await store.create_key(t.id, models=["m1"])
    assert k.models == ["m1"] and (await store.get_key(k.id)).models == ["m1"]
    await store.update_tenant(t.id, models=["m1", "m2"], model_limits={"m2": Limits(tpm=7)})
    key, tenant = await store.find_key(hash_key(secret))
    assert key.models == ["m1"] and tenant.models == ["m1", "m2"] and tenant.model_limits["m2"].tpm == 7
    assert (await store.update_key(k.id, name="x")).models == ["m1"]
    assert (await store.update_key(k.id, models=None)).models is None
    assert [x.models for x in await store.list_tenants()] == [None, ["m1", "m2"]]


async def test_tokens_on_day_of_one_model(store):
    t = await store.create_tenant("a")
    rows = [
        row(t.id, "k1", model="m", total=5),
        row(t.id, "k1", model="n", total=7),
        row(t.id, "k2", total=1),
    ]
    assert await store.insert_usage(rows) == 3
    assert await store.tokens_on_day(tenant_id=t.id, day="2026-01-02") == 13
    assert await store.tokens_on_day(tenant_id=t.id, day="2026-01-02", model="m") == 6
    assert await store.tokens_on_day(key_id="k1", day="2026-01-02", model="n") == 7


def test_migration_keeps_tenants_and_keys_of_an_older_schema(tmp_path):
    """A database made before the models columns existed (migrations 1-2) opens with its rows intact: every
    model allowed, no limits per model."""
    import sqlite3

    from auth.sqlite_store import SqliteDatabase

    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    for sql in MIGRATIONS[:2]:
        conn.executescript(sql)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    conn.executemany("INSERT INTO schema_version VALUES (?)", [(1,), (2,)])
    conn.execute(
        "INSERT INTO tenants(id, name, created_at, limits) VALUES ('tn_old', 'old', 1.0, '{\"rpm\": 3}')"
    )
    conn.execute(
        "INSERT INTO api_keys(id, tenant_id, prefix, hash, created_at) VALUES ('key_old', 'tn_old', 'p', 'h', 1.0)"
    )
    conn.commit()
    conn.close()
    from auth.sql import SqlStore

    s = SqlStore(SqliteDatabase(str(path)))
    key, tenant = s.find_key("h")
    assert (tenant.limits.rpm, tenant.models, tenant.model_limits, key.models) == (3, None, {}, None)
    assert s.db.schema_version() == len(MIGRATIONS)
    s.close()
