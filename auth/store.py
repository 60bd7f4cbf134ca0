"""SQLite storage of tenants, API keys and the usage ledger.

* One connection, WAL journal, ``synchronous=NORMAL``, ``busy_timeout`` 5 s (several gateway processes may
  share the file). Every call runs in a worker thread via ``trio.to_thread.run_sync`` behind a
  ``CapacityLimiter(1)``, so the Trio loop never blocks on disk and the connection is used by one thread at
  a time (``check_same_thread=False``).
* Schema is migratable: table ``schema_version`` + the ordered list ``auth.schema.MIGRATIONS``; opening a
  database applies the missing ones in one transaction each. Rows come back as ``auth.records`` records.

Times are UNIX seconds (float, UTC); days are ``YYYY-MM-DD`` in UTC.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from ratelimit.core import Limits

from .keys import generate_key, new_id
from .records import KeyRecord, TenantRecord
from .schema import MIGRATIONS

T = TypeVar("T")


class Store:
    """Synchronous SQLite access; use through :class:`AsyncStore` from Trio code."""

    def __init__(self, path: str) -> None:
        self.path = path
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=5.0)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA foreign_keys=ON")
        self.conn.execute("PRAGMA busy_timeout=5000")
        self.migrate()

    # -- schema ---------------------------------------------------------------------------------------
    def schema_version(self) -> int:
        self.conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = self.conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0] or 0)

    def migrate(self) -> int:
        """Apply the missing migrations in order (each in its own IMMEDIATE transaction); returns the version."""
        self.conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        for i, sql in enumerate(MIGRATIONS, start=1):
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                if self.schema_version() >= i:
                    self.conn.execute("COMMIT")
                    continue
                for stmt in sql.split(";"):
                    if stmt.strip():
                        self.conn.execute(stmt)
                self.conn.execute("INSERT INTO schema_version(version) VALUES (?)", (i,))
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
        return self.schema_version()

    def close(self) -> None:
        self.conn.close()

    # -- rows -----------------------------------------------------------------------------------------
    @staticmethod
    def _tenant(r: sqlite3.Row) -> TenantRecord:
        return TenantRecord(
            r["id"],
            r["name"],
            bool(r["disabled"]),
            r["created_at"],
            Limits.from_dict(json.loads(r["limits"] or "{}")),
            json.loads(r["filters"] or "{}"),
            r["deleted_at"],
        )

    @staticmethod
    def _key(r: sqlite3.Row) -> KeyRecord:
        lim = json.loads(r["limits"]) if r["limits"] else None
        return KeyRecord(
            r["id"],
            r["tenant_id"],
            r["name"],
            r["prefix"],
            r["created_at"],
            r["expires_at"],
            r["revoked_at"],
            Limits.from_dict(lim) if lim else None,
            r["hash"],
        )

    # -- tenants --------------------------------------------------------------------------------------
    def count_tenants(self) -> int:
        return int(self.conn.execute("SELECT COUNT(*) FROM tenants").fetchone()[0])

    def create_tenant(self, name: str, limits: Limits | None = None, filters: Any = None) -> TenantRecord:
        """Raises ValueError if the name is taken."""
        tid = new_id("tn")
        now = time.time()
        try:
            self.conn.execute(
                "INSERT INTO tenants(id, name, created_at, limits, filters) VALUES (?,?,?,?,?)",
                (
                    tid,
                    name,
                    now,
                    json.dumps((limits or Limits()).to_dict()),
                    json.dumps(filters if filters is not None else {}),
                ),
            )
        except sqlite3.IntegrityError:
            raise ValueError(f"tenant name {name!r} already exists") from None
        t = self.get_tenant(tid)
        assert t is not None
        return t

    def get_tenant(self, id_or_name: str, *, include_deleted: bool = False) -> TenantRecord | None:
        r = self.conn.execute(
            "SELECT * FROM tenants WHERE id = ? OR name = ?", (id_or_name, id_or_name)
        ).fetchone()
        if r is None or (r["deleted_at"] is not None and not include_deleted):
            return None
        return self._tenant(r)

    def list_tenants(self) -> list[TenantRecord]:
        return [
            self._tenant(r)
            for r in self.conn.execute(
                "SELECT * FROM tenants WHERE deleted_at IS NULL ORDER BY created_at, id"
            )
        ]

    def update_tenant(
        self,
        tid: str,
        *,
        name: str | None = None,
        disabled: bool | None = None,
        limits: Limits | None = None,
        filters: Any = ...,
    ) -> TenantRecord | None:
        sets, args = [], []
        if name is not None:
            sets.append("name = ?")
            args.append(name)
        if disabled is not None:
            sets.append("disabled = ?")
            args.append(int(disabled))
        if limits is not None:
            sets.append("limits = ?")
            args.append(json.dumps(limits.to_dict()))
        if filters is not ...:
            sets.append("filters = ?")
            args.append(json.dumps(filters))
        if sets:
            try:
                self.conn.execute(
                    f"UPDATE tenants SET {', '.join(sets)} WHERE id = ? AND deleted_at IS NULL", (*args, tid)
                )
            except sqlite3.IntegrityError:
                raise ValueError(f"tenant name {name!r} already exists") from None
        return self.get_tenant(tid)

    def delete_tenant(self, tid: str) -> bool:
        """Soft delete: the tenant disappears, its keys are revoked, its usage rows stay."""
        now = time.time()
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            n = self.conn.execute(
                "UPDATE tenants SET deleted_at = ?, disabled = 1, name = name || '#deleted-' || id "
                "WHERE id = ? AND deleted_at IS NULL",
                (now, tid),
            ).rowcount
            self.conn.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE tenant_id = ? AND revoked_at IS NULL", (now, tid)
            )
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        return n > 0

    # -- keys -----------------------------------------------------------------------------------------
    def create_key(
        self,
        tenant_id: str,
        *,
        name: str | None = None,
        expires_at: float | None = None,
        limits: Limits | None = None,
    ) -> tuple[str, KeyRecord]:
        """Returns ``(secret_key, record)``; the secret is not stored (only its SHA-256)."""
        key, prefix, digest = generate_key()
        kid = new_id("key")
        self.conn.execute(
            "INSERT INTO api_keys(id, tenant_id, name, prefix, hash, created_at, expires_at, limits) VALUES (?,?,?,?,?,?,?,?)",
            (
                kid,
                tenant_id,
                name,
                prefix,
                digest,
                time.time(),
                expires_at,
                json.dumps(limits.to_dict()) if limits else None,
            ),
        )
        rec = self.get_key(kid)
        assert rec is not None
        return key, rec

    def get_key(self, key_id: str) -> KeyRecord | None:
        r = self.conn.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
        return self._key(r) if r else None

    def list_keys(self, tenant_id: str) -> list[KeyRecord]:
        return [
            self._key(r)
            for r in self.conn.execute(
                "SELECT * FROM api_keys WHERE tenant_id = ? ORDER BY created_at, id", (tenant_id,)
            )
        ]

    def update_key(
        self, key_id: str, *, name: Any = ..., expires_at: Any = ..., limits: Any = ...
    ) -> KeyRecord | None:
        """Change a key's name, expiry (UNIX s or None) or own limits (Limits or None); ``...`` = unchanged."""
        sets, args = [], []
        if name is not ...:
            sets.append("name = ?")
            args.append(name)
        if expires_at is not ...:
            sets.append("expires_at = ?")
            args.append(expires_at)
        if limits is not ...:
            sets.append("limits = ?")
            args.append(json.dumps(limits.to_dict()) if limits else None)
        if sets:
            self.conn.execute(f"UPDATE api_keys SET {', '.join(sets)} WHERE id = ?", (*args, key_id))
        return self.get_key(key_id)

    def revoke_key(self, key_id: str) -> KeyRecord | None:
        self.conn.execute(
            "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (time.time(), key_id)
        )
        return self.get_key(key_id)

    def find_key(self, digest: str) -> tuple[KeyRecord, TenantRecord] | None:
        """The key with this SHA-256 digest and its tenant (deleted tenants included; the caller checks)."""
        r = self.conn.execute("SELECT * FROM api_keys WHERE hash = ?", (digest,)).fetchone()
        if r is None:
            return None
        k = self._key(r)
        t = self.get_tenant(k.tenant_id, include_deleted=True)
        if t is None:
            return None
        return k, t

    # -- usage ----------------------------------------------------------------------------------------
    def insert_usage(self, rows: list[dict[str, Any]]) -> None:
        """Insert ledger rows in one transaction."""
        if not rows:
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            self.conn.executemany(
                "INSERT INTO usage(ts, day, tenant_id, key_id, key_prefix, request_id, model, prompt_tokens, cached_tokens,"
                " completion_tokens, total_tokens, status, finish_reason, timings) VALUES"
                " (:ts, :day, :tenant_id, :key_id, :key_prefix, :request_id, :model, :prompt_tokens, :cached_tokens,"
                " :completion_tokens, :total_tokens, :status, :finish_reason, :timings)",
                [{**r, "timings": json.dumps(r.get("timings") or {})} for r in rows],
            )
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    def tokens_on_day(self, *, tenant_id: str | None = None, key_id: str | None = None, day: str) -> int:
        """Total tokens (prompt + completion) billed on ``day`` to a tenant or a key."""
        col, val = ("tenant_id", tenant_id) if tenant_id is not None else ("key_id", key_id)
        r = self.conn.execute(
            f"SELECT COALESCE(SUM(total_tokens), 0) FROM usage WHERE {col} = ? AND day = ?", (val, day)
        ).fetchone()
        return int(r[0])

    def usage_summary(self, tenant_id: str, since: float | None, until: float | None) -> dict[str, Any]:
        """Totals and per-UTC-day sums of a tenant's ledger rows with ``since <= ts < until``."""
        where, args = "tenant_id = ?", [tenant_id]
        if since is not None:
            where += " AND ts >= ?"
            args.append(since)
        if until is not None:
            where += " AND ts < ?"
            args.append(until)
        cols = (
            "COUNT(*) AS requests, COALESCE(SUM(prompt_tokens),0) AS prompt_tokens, "
            "COALESCE(SUM(cached_tokens),0) AS cached_tokens, COALESCE(SUM(completion_tokens),0) AS completion_tokens, "
            "COALESCE(SUM(total_tokens),0) AS total_tokens"
        )
        tot = dict(self.conn.execute(f"SELECT {cols} FROM usage WHERE {where}", args).fetchone())
        days = [
            dict(r)
            for r in self.conn.execute(
                f"SELECT day, {cols} FROM usage WHERE {where} GROUP BY day ORDER BY day", args
            )
        ]
        return {
            "object": "usage",
            "tenant_id": tenant_id,
            "since": since,
            "until": until,
            "totals": tot,
            "days": days,
        }

    def usage_rows(self, tenant_id: str, limit: int = 100) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT * FROM usage WHERE tenant_id = ? ORDER BY id DESC LIMIT ?", (tenant_id, limit)
        )
        out = []
        for r in rows:
            d = dict(r)
            d["timings"] = json.loads(d["timings"] or "{}")
            out.append(d)
        return out


class AsyncStore:
    """Runs :class:`Store` methods in a worker thread, one at a time: ``await store.call(Store.get_tenant, id)``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sync: Store | None = None
        self._lim = trio.CapacityLimiter(1)

    async def open(self) -> None:
        self.sync = await trio.to_thread.run_sync(Store, self.path, limiter=self._lim)

    async def call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        assert self.sync is not None, "store not open"
        store = self.sync
        return await trio.to_thread.run_sync(lambda: fn(store, *args, **kw), limiter=self._lim)

    async def aclose(self) -> None:
        if self.sync is not None:
            s, self.sync = self.sync, None
            await trio.to_thread.run_sync(s.close, limiter=self._lim)
