"""The store's queries, written once over a :class:`Database` (SQLite or PostgreSQL), and their async face.

::

    SqlStore(db)            synchronous: every query of the tenancy store, in the dialect of ``auth.schema``
    ThreadedStore(sync)     async (``auth.store.TenantStore``): each call in a worker thread via
                            ``trio.to_thread.run_sync``, behind a ``CapacityLimiter`` (SQLite 1, PostgreSQL 4)

A :class:`Database` gives transactions (:class:`Tx`): rows as dicts, row counts, and :meth:`Tx.announce`, which
tells every gateway sharing the database that tenants or keys changed (PostgreSQL: ``NOTIFY`` in the same
transaction, delivered on commit; SQLite: nothing, the key cache's short TTL covers it). Times are UNIX
seconds (float, UTC); days are ``YYYY-MM-DD`` in UTC.

Errors: :class:`ValueError` for a tenant name already taken; :class:`auth.errors.StoreUnavailable` when the
database cannot be reached (PostgreSQL only; the breaker below then answers at once for ``fail_fast_s``).
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import trio

from ratelimit.core import Limits

from .errors import StoreUnavailable
from .keys import generate_key, new_id
from .records import KeyRecord, TenantRecord
from .schema import MIGRATIONS, statements

T = TypeVar("T")
Row = dict[str, Any]

USAGE_COLUMNS = (
    "row_id",
    "ts",
    "day",
    "tenant_id",
    "key_id",
    "key_prefix",
    "request_id",
    "model",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "total_tokens",
    "status",
    "finish_reason",
    "timings",
)
TOKEN_COLUMNS = ("prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens")  # absent: 0
SUMS = (
    "COUNT(*) AS requests, COALESCE(SUM(prompt_tokens),0) AS prompt_tokens, "
    "COALESCE(SUM(cached_tokens),0) AS cached_tokens, COALESCE(SUM(completion_tokens),0) AS completion_tokens, "
    "COALESCE(SUM(total_tokens),0) AS total_tokens"
)
GROUPS = {"tenant": "tenant_id", "key": "key_id", "model": "model", "day": "day"}


class Tx(Protocol):
    """One transaction (statements in ``auth.schema``'s dialect; the database translates them)."""

    def rows(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> list[Row]: ...

    def run(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> int:
        """Execute; the number of rows changed."""
        ...

    def many(self, sql: str, seq: list[tuple[Any, ...]]) -> int:
        """Execute once per argument tuple; the number of rows changed in all."""
        ...

    def announce(self, what: str) -> None:
        """Tell the other gateways ``what`` changed (``tenant:<id>``, ``key:<id>``) once this commits."""
        ...


class Database(Protocol):
    """A connection (SQLite) or a pool (PostgreSQL), migrated when opened."""

    dialect: str
    integrity_error: type[Exception]

    def transaction(self, *, write: bool) -> AbstractContextManager[Tx]: ...

    def schema_version(self) -> int: ...

    def close(self) -> None: ...


def schema_version(tx: Tx) -> int:
    """The migrations applied (the ``schema_version`` table is created if absent)."""
    tx.run("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    return int(tx.rows("SELECT COALESCE(MAX(version), 0) AS v FROM schema_version")[0]["v"])


def migrate(db: Database, lock: str | None = None) -> int:
    """Apply the missing ``auth.schema.MIGRATIONS`` in order, each in one write transaction that first runs
    ``lock`` (PostgreSQL: an advisory lock, so concurrent openers migrate once); returns the version."""
    for i, sql in enumerate(MIGRATIONS, start=1):
        with db.transaction(write=True) as tx:
            if lock:
                tx.run(lock)
            if schema_version(tx) >= i:
                continue
            for stmt in statements(sql):
                tx.run(stmt)
            tx.run("INSERT INTO schema_version(version) VALUES (?)", (i,))
    with db.transaction(write=False) as tx:
        return schema_version(tx)


def _models(text: str | None) -> list[str] | None:
    """A ``models`` column: a JSON list of names, or NULL (every model)."""
    return None if text is None else list(json.loads(text))


def _models_text(models: list[str] | None) -> str | None:
    return None if models is None else json.dumps(list(models))


def _model_limits_text(model_limits: dict[str, Limits] | None) -> str:
    return json.dumps({m: lim.to_dict() for m, lim in (model_limits or {}).items()})


def _tenant(r: Row) -> TenantRecord:
    return TenantRecord(
        r["id"],
        r["name"],
        bool(r["disabled"]),
        r["created_at"],
        Limits.from_dict(json.loads(r["limits"] or "{}")),
        json.loads(r["filters"] or "{}"),
        r["deleted_at"],
        _models(r["models"]),
        {m: Limits.from_dict(d) for m, d in json.loads(r["model_limits"] or "{}").items()},
    )


def _key(r: Row) -> KeyRecord:
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
        _models(r["models"]),
    )


def _ints(r: Row) -> Row:
    return {k: (int(v) if k != "day" and k not in GROUPS.values() else v) for k, v in r.items()}


def _where(since: float | None, until: float | None, **equal: str | None) -> tuple[str, list[Any]]:
    """``ts`` in ``[since, until)`` and each non-None ``column = value``; the WHERE text and its arguments."""
    parts: list[str] = []
    args: list[Any] = []
    for col, val in equal.items():
        if val is not None:
            parts.append(f"{col} = ?")
            args.append(val)
    if since is not None:
        parts.append("ts >= ?")
        args.append(since)
    if until is not None:
        parts.append("ts < ?")
        args.append(until)
    return (" AND ".join(parts) or "1 = 1"), args


class SqlStore:
    """Every query of the tenancy store (synchronous; run it through :class:`ThreadedStore` from Trio)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def close(self) -> None:
        self.db.close()

    # -- tenants --------------------------------------------------------------------------------------
    def count_tenants(self) -> int:
        with self.db.transaction(write=False) as tx:
            return int(tx.rows("SELECT COUNT(*) AS n FROM tenants")[0]["n"])

    def create_tenant(
        self,
        name: str,
        limits: Limits | None = None,
        filters: Any = None,
        *,
        models: list[str] | None = None,
        model_limits: dict[str, Limits] | None = None,
    ) -> TenantRecord:
        """A new tenant (``models`` None: every model; ``model_limits``: served name -> limits). Raises
        ValueError if the name is taken."""
        tid = new_id("tn")
        lim = json.dumps((limits or Limits()).to_dict())
        try:
            with self.db.transaction(write=True) as tx:
                tx.run(
                    "INSERT INTO tenants(id, name, created_at, limits, filters, models, model_limits)"
                    " VALUES (?,?,?,?,?,?,?)",
                    (
                        tid,
                        name,
                        time.time(),
                        lim,
                        json.dumps(filters if filters is not None else {}),
                        _models_text(models),
                        _model_limits_text(model_limits),
                    ),
                )
                tx.announce(f"tenant:{tid}")
        except self.db.integrity_error:
            raise ValueError(f"tenant name {name!r} already exists") from None
        t = self.get_tenant(tid)
        assert t is not None
        return t

    def get_tenant(self, id_or_name: str, *, include_deleted: bool = False) -> TenantRecord | None:
        with self.db.transaction(write=False) as tx:
            rows = tx.rows("SELECT * FROM tenants WHERE id = ? OR name = ?", (id_or_name, id_or_name))
        if not rows or (rows[0]["deleted_at"] is not None and not include_deleted):
            return None
        return _tenant(rows[0])

    def list_tenants(self) -> list[TenantRecord]:
        with self.db.transaction(write=False) as tx:
            rows = tx.rows("SELECT * FROM tenants WHERE deleted_at IS NULL ORDER BY created_at, id")
        return [_tenant(r) for r in rows]

    def update_tenant(
        self,
        tid: str,
        *,
        name: str | None = None,
        disabled: bool | None = None,
        limits: Limits | None = None,
        filters: Any = ...,
        models: Any = ...,
        model_limits: Any = ...,
    ) -> TenantRecord | None:
        """Change the given fields (``filters``, ``models`` (a list, or None: every model), ``model_limits`` (a
        dict): ``...`` is unchanged). Raises ValueError if the new name is taken."""
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
        if models is not ...:
            sets.append("models = ?")
            args.append(_models_text(models))
        if model_limits is not ...:
            sets.append("model_limits = ?")
            args.append(_model_limits_text(model_limits))
        if sets:
            try:
                with self.db.transaction(write=True) as tx:
                    tx.run(
                        f"UPDATE tenants SET {', '.join(sets)} WHERE id = ? AND deleted_at IS NULL",
                        (*args, tid),
                    )
                    tx.announce(f"tenant:{tid}")
            except self.db.integrity_error:
                raise ValueError(f"tenant name {name!r} already exists") from None
        return self.get_tenant(tid)

    def delete_tenant(self, tid: str) -> bool:
        """Soft delete: the tenant disappears, its keys are revoked, its usage rows stay."""
        now = time.time()
        with self.db.transaction(write=True) as tx:
            n = tx.run(
                "UPDATE tenants SET deleted_at = ?, disabled = 1, name = name || '#deleted-' || id "
                "WHERE id = ? AND deleted_at IS NULL",
                (now, tid),
            )
            tx.run(
                "UPDATE api_keys SET revoked_at = ? WHERE tenant_id = ? AND revoked_at IS NULL", (now, tid)
            )
            tx.announce(f"tenant:{tid}")
        return n > 0

    # -- keys -----------------------------------------------------------------------------------------
    def create_key(
        self,
        tenant_id: str,
        *,
        name: str | None = None,
        expires_at: float | None = None,
        limits: Limits | None = None,
        models: list[str] | None = None,
    ) -> tuple[str, KeyRecord]:
        """Returns ``(secret_key, record)``; the secret is not stored (only its SHA-256). ``models`` None: the
        tenant's models; a list: only those of the tenant's models in it."""
        key, prefix, digest = generate_key()
        kid = new_id("key")
        with self.db.transaction(write=True) as tx:
            tx.run(
                "INSERT INTO api_keys(id, tenant_id, name, prefix, hash, created_at, expires_at, limits, models)"
                " VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    kid,
                    tenant_id,
                    name,
                    prefix,
                    digest,
                    time.time(),
                    expires_at,
                    json.dumps(limits.to_dict()) if limits else None,
                    _models_text(models),
                ),
            )
            tx.announce(f"key:{kid}")  # a miss another gateway cached for this digest
        rec = self.get_key(kid)
        assert rec is not None
        return key, rec

    def get_key(self, key_id: str) -> KeyRecord | None:
        with self.db.transaction(write=False) as tx:
            rows = tx.rows("SELECT * FROM api_keys WHERE id = ?", (key_id,))
        return _key(rows[0]) if rows else None

    def list_keys(self, tenant_id: str) -> list[KeyRecord]:
        with self.db.transaction(write=False) as tx:
            rows = tx.rows("SELECT * FROM api_keys WHERE tenant_id = ? ORDER BY created_at, id", (tenant_id,))
        return [_key(r) for r in rows]

    def update_key(
        self, key_id: str, *, name: Any = ..., expires_at: Any = ..., limits: Any = ..., models: Any = ...
    ) -> KeyRecord | None:
        """Change a key's name, expiry (UNIX s or None), own limits (Limits or None) or models (a list, or None:
        the tenant's); ``...`` = unchanged."""
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
        if models is not ...:
            sets.append("models = ?")
            args.append(_models_text(models))
        if sets:
            with self.db.transaction(write=True) as tx:
                tx.run(f"UPDATE api_keys SET {', '.join(sets)} WHERE id = ?", (*args, key_id))
                tx.announce(f"key:{key_id}")
        return self.get_key(key_id)

    def revoke_key(self, key_id: str) -> KeyRecord | None:
        with self.db.transaction(write=True) as tx:
            tx.run(
                "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                (time.time(), key_id),
            )
            tx.announce(f"key:{key_id}")
        return self.get_key(key_id)

    def find_key(self, digest: str) -> tuple[KeyRecord, TenantRecord] | None:
        """The key with this SHA-256 digest and its tenant (deleted tenants included; the caller checks)."""
        with self.db.transaction(write=False) as tx:
            keys = tx.rows("SELECT * FROM api_keys WHERE hash = ?", (digest,))
            if not keys:
                return None
            tenants = tx.rows("SELECT * FROM tenants WHERE id = ?", (keys[0]["tenant_id"],))
        return (_key(keys[0]), _tenant(tenants[0])) if tenants else None

    # -- usage ----------------------------------------------------------------------------------------
    def insert_usage(self, rows: list[dict[str, Any]]) -> int:
        """Insert ledger rows in one transaction; a row whose ``row_id`` is already stored is skipped (a
        replay). A row without ``row_id`` gets a fresh one. Returns the number of rows inserted."""
        if not rows:
            return 0
        values = [
            tuple(
                (r.get("row_id") or uuid.uuid4().hex)
                if c == "row_id"
                else json.dumps(r.get("timings") or {})
                if c == "timings"
                else r.get(c, 0)
                if c in TOKEN_COLUMNS
                else r.get(c)
                for c in USAGE_COLUMNS
            )
            for r in rows
        ]
        sql = (
            f"INSERT INTO usage({', '.join(USAGE_COLUMNS)}) VALUES ({','.join('?' * len(USAGE_COLUMNS))})"
            " ON CONFLICT (row_id) DO NOTHING"
        )
        with self.db.transaction(write=True) as tx:
            return tx.many(sql, values)

    def tokens_on_day(
        self, *, tenant_id: str | None = None, key_id: str | None = None, day: str, model: str | None = None
    ) -> int:
        """Total tokens (prompt + completion) billed on ``day`` to a tenant or a key (``model``: only for that
        model)."""
        col, val = ("tenant_id", tenant_id) if tenant_id is not None else ("key_id", key_id)
        where, args = f"{col} = ? AND day = ?", [val, day]
        if model is not None:
            where, args = where + " AND model = ?", [*args, model]
        with self.db.transaction(write=False) as tx:
            r = tx.rows(f"SELECT COALESCE(SUM(total_tokens), 0) AS n FROM usage WHERE {where}", args)
        return int(r[0]["n"])

    def usage_summary(self, tenant_id: str, since: float | None, until: float | None) -> dict[str, Any]:
        """Totals and per-UTC-day sums of a tenant's ledger rows with ``since <= ts < until``."""
        where, args = _where(since, until, tenant_id=tenant_id)
        with self.db.transaction(write=False) as tx:
            tot = tx.rows(f"SELECT {SUMS} FROM usage WHERE {where}", args)[0]
            days = tx.rows(f"SELECT day, {SUMS} FROM usage WHERE {where} GROUP BY day ORDER BY day", args)
        return {
            "object": "usage",
            "tenant_id": tenant_id,
            "since": since,
            "until": until,
            "totals": _ints(tot),
            "days": [_ints(d) for d in days],
        }

    def spend(
        self,
        *,
        since: float | None = None,
        until: float | None = None,
        tenant_id: str | None = None,
        key_id: str | None = None,
        model: str | None = None,
        group_by: str = "tenant",
    ) -> tuple[Row, list[Row]]:
        """Ledger sums over ``since <= ts < until`` (filtered by the given tenant, key, model): the totals and
        one row per ``group_by`` value (``tenant``, ``key``, ``model`` or ``day``), most tokens first (``day``:
        in date order). Each row: ``group`` (the value; None for rows without one), ``requests``,
        ``prompt_tokens``, ``cached_tokens``, ``completion_tokens``, ``total_tokens``.

        Raises:
            ValueError: an unknown ``group_by``.
        """
        col = GROUPS.get(group_by)
        if col is None:
            raise ValueError(f"group_by must be one of {', '.join(GROUPS)}")
        where, args = _where(since, until, tenant_id=tenant_id, key_id=key_id, model=model)
        order = f"{col}" if group_by == "day" else f"total_tokens DESC, {col}"
        with self.db.transaction(write=False) as tx:
            tot = tx.rows(f"SELECT {SUMS} FROM usage WHERE {where}", args)[0]
            groups = tx.rows(
                f"SELECT {col} AS grp, {SUMS} FROM usage WHERE {where} GROUP BY {col} ORDER BY {order}", args
            )
        out = []
        for g in groups:
            value = g.pop("grp")
            out.append({"group": value, **_ints(g)})
        return _ints(tot), out

    def usage_rows(self, tenant_id: str, limit: int = 100) -> list[dict[str, Any]]:
        """A tenant's newest ledger rows, newest first (``timings`` decoded)."""
        with self.db.transaction(write=False) as tx:
            rows = tx.rows(
                "SELECT * FROM usage WHERE tenant_id = ? ORDER BY id DESC LIMIT ?", (tenant_id, limit)
            )
        for d in rows:
            d["timings"] = json.loads(d["timings"] or "{}")
        return rows


class ThreadedStore:
    """:class:`SqlStore` as ``auth.store.TenantStore``: each call in a worker thread (the Trio loop never waits
    on the database), at most ``limiter``'s tokens at once (SQLite: 1, its one connection; PostgreSQL: the
    pool's size).

    After a :class:`~auth.errors.StoreUnavailable`, calls fail at once for ``fail_fast_s`` seconds instead of
    each waiting out the connect timeout (a request falls back to the key cache or gets its 503 at once).

    Args:
        open_db: builds (connects, migrates) the database; called in a worker thread by :meth:`open`.
        limiter: the worker threads that may use the database at once.
        location: what it was opened from (for messages; a URL's password is not kept).
        feed: the change feed of this database (PostgreSQL), or None.
    """

    def __init__(
        self,
        open_db: Callable[[], Database],
        limiter: trio.CapacityLimiter,
        *,
        location: str,
        feed: Any = None,
        fail_fast_s: float = 1.0,
    ) -> None:
        self._open_db = open_db
        self._limiter = limiter
        self.location = location
        self.feed = feed
        self.fail_fast_s = fail_fast_s
        self.sync: SqlStore | None = None
        self._down_until = 0.0

    async def open(self) -> None:
        """Connect and migrate. Raises :class:`~auth.errors.StoreUnavailable` (PostgreSQL not reachable)."""
        try:
            db = await trio.to_thread.run_sync(self._open_db, limiter=self._limiter)
        except StoreUnavailable as e:
            raise StoreUnavailable(
                f"cannot open the tenancy store {self.location}: {e.detail or e.message}", detail=e.detail
            ) from None
        except (sqlite3.Error, OSError) as e:  # a SQLite path that is not a database, or cannot be created
            reason = f"{type(e).__name__}: {e}"
            raise StoreUnavailable(
                f"cannot open the tenancy store {self.location}: {reason}", detail=reason
            ) from None
        self.sync = SqlStore(db)

    async def aclose(self) -> None:
        if self.sync is not None:
            s, self.sync = self.sync, None
            await trio.to_thread.run_sync(s.close, limiter=self._limiter)

    async def _run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        assert self.sync is not None, "store not open"
        if time.monotonic() < self._down_until:
            raise StoreUnavailable()
        try:
            return await trio.to_thread.run_sync(lambda: fn(*args, **kw), limiter=self._limiter)
        except StoreUnavailable:
            self._down_until = time.monotonic() + self.fail_fast_s
            raise

    @property
    def _s(self) -> SqlStore:
        assert self.sync is not None, "store not open"
        return self.sync

    async def count_tenants(self) -> int:
        return await self._run(self._s.count_tenants)

    async def create_tenant(
        self,
        name: str,
        limits: Limits | None = None,
        filters: Any = None,
        *,
        models: list[str] | None = None,
        model_limits: dict[str, Limits] | None = None,
    ) -> TenantRecord:
        return await self._run(
            self._s.create_tenant, name, limits, filters, models=models, model_limits=model_limits
        )

    async def get_tenant(self, id_or_name: str, *, include_deleted: bool = False) -> TenantRecord | None:
        return await self._run(self._s.get_tenant, id_or_name, include_deleted=include_deleted)

    async def list_tenants(self) -> list[TenantRecord]:
        return await self._run(self._s.list_tenants)

    async def update_tenant(
        self,
        tid: str,
        *,
        name: str | None = None,
        disabled: bool | None = None,
        limits: Limits | None = None,
        filters: Any = ...,
        models: Any = ...,
        model_limits: Any = ...,
    ) -> TenantRecord | None:
        return await self._run(
            self._s.update_tenant,
            tid,
            name=name,
            disabled=disabled,
            limits=limits,
            filters=filters,
            models=models,
            model_limits=model_limits,
        )

    async def delete_tenant(self, tid: str) -> bool:
        return await self._run(self._s.delete_tenant, tid)

    async def create_key(
        self,
        tenant_id: str,
        *,
        name: str | None = None,
        expires_at: float | None = None,
        limits: Limits | None = None,
        models: list[str] | None = None,
    ) -> tuple[str, KeyRecord]:
        return await self._run(
            self._s.create_key, tenant_id, name=name, expires_at=expires_at, limits=limits, models=models
        )

    async def get_key(self, key_id: str) -> KeyRecord | None:
        return await self._run(self._s.get_key, key_id)

    async def list_keys(self, tenant_id: str) -> list[KeyRecord]:
        return await self._run(self._s.list_keys, tenant_id)

    async def update_key(
        self, key_id: str, *, name: Any = ..., expires_at: Any = ..., limits: Any = ..., models: Any = ...
    ) -> KeyRecord | None:
        return await self._run(
            self._s.update_key, key_id, name=name, expires_at=expires_at, limits=limits, models=models
        )

    async def revoke_key(self, key_id: str) -> KeyRecord | None:
        return await self._run(self._s.revoke_key, key_id)

    async def find_key(self, digest: str) -> tuple[KeyRecord, TenantRecord] | None:
        return await self._run(self._s.find_key, digest)

    async def insert_usage(self, rows: list[dict[str, Any]]) -> int:
        return await self._run(self._s.insert_usage, rows)

    async def tokens_on_day(
        self, *, tenant_id: str | None = None, key_id: str | None = None, day: str, model: str | None = None
    ) -> int:
        return await self._run(
            self._s.tokens_on_day, tenant_id=tenant_id, key_id=key_id, day=day, model=model
        )

    async def usage_summary(self, tenant_id: str, since: float | None, until: float | None) -> dict[str, Any]:
        return await self._run(self._s.usage_summary, tenant_id, since, until)

    async def spend(
        self,
        *,
        since: float | None = None,
        until: float | None = None,
        tenant_id: str | None = None,
        key_id: str | None = None,
        model: str | None = None,
        group_by: str = "tenant",
    ) -> tuple[Row, list[Row]]:
        return await self._run(
            self._s.spend,
            since=since,
            until=until,
            tenant_id=tenant_id,
            key_id=key_id,
            model=model,
            group_by=group_by,
        )

    async def usage_rows(self, tenant_id: str, limit: int = 100) -> list[dict[str, Any]]:
        return await self._run(self._s.usage_rows, tenant_id, limit)
