"""Keys and storage: hashing, revocation, expiry, restart durability, migrations (real SQLite files)."""

from __future__ import annotations

import sqlite3
import time

import pytest
import trio

from auth.keys import KEY_PREFIX, generate_key, hash_key
from auth.store import MIGRATIONS, Store
from gateway.errors import AuthenticationError
from gateway.tenancy import Tenancy, classify_path, normalize_path


def scope_for(key: str | None, query: bytes = b"") -> dict:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key is not None else []
    return {"headers": headers, "query_string": query}


def test_generated_keys_are_random_and_hashed():
    keys = {generate_key() for _ in range(200)}
    assert len({k for k, _, _ in keys}) == 200
    for k, prefix, digest in keys:
        assert (
            k.startswith(KEY_PREFIX) and len(k) >= 40 and k.startswith(prefix) and len(prefix) < len(k) - 20
        )
        assert digest == hash_key(k) and len(digest) == 64


async def test_default_tenant_announced_once(tmp_path):
    said: list[str] = []
    path = str(tmp_path / "g.db")
    async with Tenancy.open(path, announce=said.append) as t:
        assert t.default_key and len(said) == 1 and t.default_key in said[0]
        p = await t.authenticate(scope_for(t.default_key))
        assert p.tenant_name == "default"
        key = t.default_key
    async with Tenancy.open(path, announce=said.append) as t:
        assert t.default_key is None and len(said) == 1  # not created or printed again
        assert (await t.authenticate(scope_for(key))).tenant_name == "default"
    # only the digest is stored
    raw = open(path, "rb").read() + (
        open(path + "-wal", "rb").read() if (tmp_path / "g.db-wal").exists() else b""
    )
    assert key.encode() not in raw


async def test_restart_keeps_usage_and_revocations(tmp_path):
    path = str(tmp_path / "g.db")
    async with Tenancy.open(path, announce=lambda s: None) as t:
        tn = await t.store.call(Store.create_tenant, "acme")
        k1, r1 = await t.store.call(Store.create_key, tn.id, name="one")
        k2, _ = await t.store.call(Store.create_key, tn.id, name="two")
        p = await t.authenticate(scope_for(k1))
        for i in range(3):
            async with t.admit(p, prompt_tokens=10, max_tokens=10, model="m", request_id=f"r{i}") as res:
                res.finish(completion_tokens=4, finish_reason="stop")
        await t.store.call(Store.revoke_key, r1.id)
        t.invalidate()
        with pytest.raises(AuthenticationError):
            await t.authenticate(scope_for(k1))
        # no explicit flush: closing must write the queued ledger rows
    async with Tenancy.open(path, announce=lambda s: None) as t:
        with pytest.raises(AuthenticationError) as ei:
            await t.authenticate(scope_for(k1))
        assert ei.value.status == 401 and "revoked" in ei.value.message
        assert (await t.authenticate(scope_for(k2))).tenant_name == "acme"
        u = await t.store.call(Store.usage_summary, tn.id, None, None)
        assert u["totals"]["requests"] == 3 and u["totals"]["total_tokens"] == 42
        assert len(u["days"]) == 1


async def test_auth_failures_are_401_with_openai_body(tmp_path):
    async with Tenancy.open(str(tmp_path / "g.db"), announce=lambda s: None) as t:
        tn = await t.store.call(Store.create_tenant, "x")
        good, _ = await t.store.call(Store.create_key, tn.id)
        expired, _ = await t.store.call(Store.create_key, tn.id, expires_at=time.time() - 1)
        soon, _ = await t.store.call(Store.create_key, tn.id, expires_at=time.time() + 0.3)
        cases = [
            scope_for(None),
            scope_for("sk-gw-wrong"),
            scope_for(expired),
            scope_for(good, b"api_key=" + good.encode()),
            {"headers": [(b"authorization", f"Basic {good}".encode())], "query_string": b""},
            {"headers": [(b"x-api-key", good.encode())], "query_string": b""},
        ]
        for sc in cases:
            with pytest.raises(AuthenticationError) as ei:
                await t.authenticate(sc)
            body = ei.value.body()
            assert ei.value.status == 401 and set(body["error"]) >= {"message", "type", "param", "code"}
            assert good not in str(body) and expired not in str(body)
        await t.authenticate(scope_for(soon))
        await trio.sleep(0.35)
        with pytest.raises(AuthenticationError):
            await t.authenticate(scope_for(soon))  # expiry is checked on every request, cache or not
        await t.store.call(Store.update_tenant, tn.id, disabled=True)
        t.invalidate()
        with pytest.raises(AuthenticationError):
            await t.authenticate(scope_for(good))


def test_migrations_are_ordered_and_idempotent(tmp_path):
    path = str(tmp_path / "m.db")
    s = Store(path)
    assert s.schema_version() == len(MIGRATIONS)
    s.close()
    s = Store(path)  # reopening applies nothing twice
    rows = s.conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
    assert [r[0] for r in rows] == list(range(1, len(MIGRATIONS) + 1))
    assert s.conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
    s.close()
    # a database created by an older version (schema_version table with fewer rows) is upgraded in order
    con = sqlite3.connect(str(tmp_path / "old.db"))
    con.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    con.commit()
    con.close()
    assert Store(str(tmp_path / "old.db")).schema_version() == len(MIGRATIONS)


def test_path_classification():
    assert normalize_path("/v1/../admin//v1/./tenants/") == "/admin/v1/tenants/"
    for p in ("/", "/healthz", "/readyz", "/openapi.json", "/static/app.js"):
        assert classify_path(p) == "public", p
    for p in ("/admin/v1/tenants", "/v1/../admin/v1/tenants", "/ADMIN/v1/x", "//admin/v1/tenants"):
        assert classify_path(p) == "admin", p
    for p in (
        "/v1/chat/completions",
        "/v1/chat/completions/",
        "/chat/completions",
        "/nope",
        "/healthz/../v1/models",
        "/static/../v1/chat/completions",
        "/v1//chat/completions",
    ):
        assert classify_path(p) == "tenant", p
    assert classify_path("/v1/chat/completions", "OPTIONS") == "public"
