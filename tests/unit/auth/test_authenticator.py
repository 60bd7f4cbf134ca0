"""Keys, storage and authentication: hashing, revocation, expiry, the admin key, query-string keys, migrations
(real SQLite files)."""

from __future__ import annotations

import sqlite3
import time

import pytest
import trio

from auth.authenticator import Authenticator
from auth.credentials import bearer_token, query_has_key, redact_query
from auth.errors import Forbidden, Unauthenticated
from auth.keys import KEY_PREFIX, generate_key, hash_key
from auth.schema import MIGRATIONS
from auth.sqlite_store import SqliteDatabase
from auth.store import open_store
from ratelimit.core import Limits

ADMIN = "admin-secret"


def creds(key: str | None) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())] if key is not None else []


@pytest.fixture
async def store(tmp_path):
    s = open_store(str(tmp_path / "g.db"))
    await s.open()
    yield s
    await s.aclose()


def test_generated_keys_are_random_and_hashed():
    keys = {generate_key() for _ in range(200)}
    assert len({k for k, _, _ in keys}) == 200
    for k, prefix, digest in keys:
        assert (
            k.startswith(KEY_PREFIX) and len(k) >= 40 and k.startswith(prefix) and len(prefix) < len(k) - 20
        )
        assert digest == hash_key(k) and len(digest) == 64


def test_credentials_in_headers_and_query():
    assert bearer_token([(b"authorization", b"Bearer  abc ")]) == "abc"
    assert bearer_token([(b"Authorization", b"bearer abc")]) == "abc"
    assert bearer_token([(b"authorization", b"Basic abc")]) == ""
    assert bearer_token([(b"authorization", b"Bearer ")]) == ""
    assert bearer_token([(b"x-api-key", b"abc")]) is None
    for q in (b"api_key=x", b"a=1&TOKEN=y", b"q=sk-gw-abc", b"access_token="):
        assert query_has_key(q), q
    assert not query_has_key(b"") and not query_has_key(b"since=2020-01-01&limit=3")
    assert redact_query(b"a=1&api_key=sk-gw-secret") == b"a=1&api_key=REDACTED"


async def test_auth_failures_are_401(store):
    auth = Authenticator(store, admin_key=ADMIN)
    tn = await store.create_tenant("x")
    good, _ = await store.create_key(tn.id)
    expired, _ = await store.create_key(tn.id, expires_at=time.time() - 1)
    soon, _ = await store.create_key(tn.id, expires_at=time.time() + 0.3)
    cases = [
        (creds(None), b"", None),
        (creds("sk-gw-wrong"), b"", "invalid_api_key"),
        (creds(expired), b"", "invalid_api_key"),
        (creds(good), b"api_key=" + good.encode(), "invalid_api_key"),
        ([(b"authorization", f"Basic {good}".encode())], b"", None),
        ([(b"x-api-key", good.encode())], b"", None),
    ]
    for headers, query, code in cases:
        with pytest.raises(Unauthenticated) as ei:
            await auth.authenticate(headers, query)
        e = ei.value
        assert (e.status, e.type, e.code) == (401, "invalid_request_error", code)
        assert e.headers == {"www-authenticate": "Bearer"}
        assert good not in e.message and expired not in e.message
    assert (await auth.authenticate(creds(soon))).tenant_name == "x"
    await trio.sleep(0.35)
    with pytest.raises(Unauthenticated, match="expired"):
        await auth.authenticate(creds(soon))  # expiry is checked on every request, cache or not
    assert (await auth.authenticate(creds(good))).tenant_id == tn.id
    await store.update_tenant(tn.id, disabled=True)
    assert (await auth.authenticate(creds(good))).tenant_id == tn.id  # cached for cache_ttl_s...
    auth.invalidate()  # ...unless invalidated (what the admin API does after every change)
    with pytest.raises(Unauthenticated) as ei:
        await auth.authenticate(creds(good))
    assert ei.value.code == "tenant_disabled"


async def test_principal_carries_limits_and_filters(store):
    auth = Authenticator(store, admin_key=None)
    tn = await store.create_tenant("acme", Limits(rpm=5), {"hooks": []})
    key, rec = await store.create_key(tn.id, limits=Limits(tpm=7))
    p = await auth.authenticate(creds(key))
    assert (p.tenant_id, p.tenant_name, p.key_id, p.key_prefix) == (tn.id, "acme", rec.id, rec.prefix)
    assert p.limits.rpm == 5 and p.key_limits is not None and p.key_limits.tpm == 7
    assert p.filters == {"hooks": []}


async def test_admin_check(store):
    auth = Authenticator(store, admin_key=ADMIN)
    tn = await store.create_tenant("x")
    key, rec = await store.create_key(tn.id)
    await auth.check_admin(creds(ADMIN))
    with pytest.raises(Forbidden) as ei:
        await auth.check_admin(creds(key))
    assert (ei.value.status, ei.value.code) == (403, "admin_required")
    for headers, query in (
        (creds(None), b""),
        (creds("wrong"), b""),
        (creds(ADMIN), b"key=" + ADMIN.encode()),
    ):
        with pytest.raises(Unauthenticated) as ei:
            await auth.check_admin(headers, query)
        assert ei.value.status == 401 and ei.value.headers == {}
    await store.revoke_key(rec.id)
    auth.invalidate()
    with pytest.raises(Unauthenticated):  # a revoked key is just a wrong one
        await auth.check_admin(creds(key))
    closed = Authenticator(store, admin_key=None)  # no admin key: the admin API is closed to everyone
    with pytest.raises(Unauthenticated):
        await closed.check_admin(creds(ADMIN))
    other, _ = await store.create_key(tn.id)
    with pytest.raises(Forbidden):
        await closed.check_admin(creds(other))
    alone = Authenticator(None, admin_key=ADMIN)  # no key database at all
    await alone.check_admin(creds(ADMIN))
    with pytest.raises(Unauthenticated):
        await alone.check_admin(creds(key))


async def test_unknown_keys_are_cached_as_misses(store):
    auth = Authenticator(store, admin_key=None, cache_ttl_s=60)
    tn = await store.create_tenant("x")
    key, _ = await store.create_key(tn.id)
    calls = 0
    real = store.find_key

    async def counting(digest):
        nonlocal calls
        calls += 1
        return await real(digest)

    store.find_key = counting
    for _ in range(5):
        with pytest.raises(Unauthenticated):
            await auth.authenticate(creds("sk-gw-wrong"))
        await auth.authenticate(creds(key))
    assert calls == 2  # one lookup per distinct key


async def test_restart_keeps_keys_and_revocations(tmp_path):
    path = str(tmp_path / "g.db")
    s = open_store(path)
    await s.open()
    tn = await s.create_tenant("acme")
    k1, r1 = await s.create_key(tn.id, name="one")
    k2, _ = await s.create_key(tn.id, name="two")
    await s.revoke_key(r1.id)
    await s.aclose()
    s = open_store(path)
    await s.open()
    auth = Authenticator(s, admin_key=None)
    with pytest.raises(Unauthenticated, match="revoked"):
        await auth.authenticate(creds(k1))
    assert (await auth.authenticate(creds(k2))).tenant_name == "acme"
    await s.aclose()
    raw = open(path, "rb").read() + (
        open(path + "-wal", "rb").read() if (tmp_path / "g.db-wal").exists() else b""
    )
    assert k1.encode() not in raw and k2.encode() not in raw  # only digests are stored


def test_migrations_are_ordered_and_idempotent(tmp_path):
    path = str(tmp_path / "m.db")
    s = SqliteDatabase(path)
    assert s.schema_version() == len(MIGRATIONS)
    s.close()
    s = SqliteDatabase(path)  # reopening applies nothing twice
    rows = s.conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
    assert [r[0] for r in rows] == list(range(1, len(MIGRATIONS) + 1))
    assert s.conn.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
    s.close()
    # a database created by an older version (schema_version table with fewer rows) is upgraded in order
    con = sqlite3.connect(str(tmp_path / "old.db"))
    con.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    con.commit()
    con.close()
    assert SqliteDatabase(str(tmp_path / "old.db")).schema_version() == len(MIGRATIONS)


async def test_principal_carries_models_and_model_limits(store):
    """The principal's models are the tenant's narrowed by the key's own list (each None: no narrowing), and
    a change to them applies at the next request once the cache is invalidated."""
    auth = Authenticator(store, admin_key=ADMIN)
    t = await store.create_tenant("m", models=["a", "b", "c"], model_limits={"a": Limits(rpm=1)})
    every, _ = await store.create_key(t.id)
    narrowed, k = await store.create_key(t.id, models=["c", "a", "z"])
    p = await auth.authenticate(creds(every))
    assert p.models == ("a", "b", "c") and p.model_limits == {"a": Limits(rpm=1)}
    assert p.allows_model("b") and not p.allows_model("z")
    p = await auth.authenticate(creds(narrowed))
    assert p.models == ("a", "c") and not p.allows_model("b") and not p.allows_model("z")
    await store.update_tenant(t.id, models=None, model_limits={})
    auth.invalidate()
    p = await auth.authenticate(creds(narrowed))
    assert p.models == ("c", "a", "z") and p.model_limits == {}
    await store.update_key(k.id, models=["q"])
    await store.update_tenant(t.id, models=["a"])
    auth.invalidate()
    assert (await auth.authenticate(creds(narrowed))).models == ()  # nothing in common: no model
    assert (await auth.authenticate(creds(every))).models == ("a",)
