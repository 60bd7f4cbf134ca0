"""The tenancy store: tenants, API keys and the usage ledger, behind one typed async interface.

::

    open_store(location) -> TenantStore
        "./data/gateway.db", ":memory:"           SQLite (auth.sqlite_store): embedded, the default
        "postgresql://user@host:5432/db"          PostgreSQL (auth.postgres_store): shared by several gateways,
        "postgres://..."                          with a change feed (LISTEN/NOTIFY)

Both run the same queries (``auth.sql.SqlStore``) and the same migrations (``auth.schema``), each call in a
worker thread (the Trio loop never waits on the database). Rows come back as ``auth.records`` records and
plain dicts; times are UNIX seconds (float, UTC), days ``YYYY-MM-DD`` in UTC.

Errors: ``ValueError`` for a tenant name already taken; :class:`auth.errors.StoreUnavailable` when the store
cannot be reached (PostgreSQL down, or past its connect/statement timeouts).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol

import trio

from ratelimit.core import Limits

from .records import KeyRecord, TenantRecord


class ChangeFeed(Protocol):
    """Tells this gateway that another one changed tenants or keys (``auth.postgres_store.PostgresChangeFeed``)."""

    connected: bool  # listening now: no change can go unannounced

    async def run(self, on_change: Callable[[], None], task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Call ``on_change()`` after every change (and after each reconnect); runs until cancelled."""
        ...


class TenantStore(Protocol):
    """What the gateway asks of the store (implemented by ``auth.sql.ThreadedStore``)."""

    location: str  # the file or the URL, without a password
    feed: ChangeFeed | None  # None: no feed (SQLite), the key cache's TTL bounds staleness

    async def open(self) -> None:
        """Connect (create, migrate). Raises ``StoreUnavailable``."""
        ...

    async def aclose(self) -> None: ...

    async def count_tenants(self) -> int: ...

    async def create_tenant(
        self,
        name: str,
        limits: Limits | None = None,
        filters: Any = None,
        *,
        models: list[str] | None = None,
        model_limits: dict[str, Limits] | None = None,
    ) -> TenantRecord:
        """``models`` None: every model; ``model_limits``: served model name -> limits. Raises ValueError if
        the name is taken."""
        ...

    async def get_tenant(self, id_or_name: str, *, include_deleted: bool = False) -> TenantRecord | None: ...

    async def list_tenants(self) -> list[TenantRecord]: ...

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
        """The given fields change (``...``: unchanged; ``models=None``: every model). Raises ValueError if the
        new name is taken."""
        ...

    async def delete_tenant(self, tid: str) -> bool:
        """Soft delete: the tenant disappears, its keys are revoked, its usage rows stay."""
        ...

    async def create_key(
        self,
        tenant_id: str,
        *,
        name: str | None = None,
        expires_at: float | None = None,
        limits: Limits | None = None,
        models: list[str] | None = None,
    ) -> tuple[str, KeyRecord]:
        """``(secret_key, record)``; only the secret's SHA-256 is stored. ``models``: None, the tenant's."""
        ...

    async def get_key(self, key_id: str) -> KeyRecord | None: ...

    async def list_keys(self, tenant_id: str) -> list[KeyRecord]: ...

    async def update_key(
        self, key_id: str, *, name: Any = ..., expires_at: Any = ..., limits: Any = ..., models: Any = ...
    ) -> KeyRecord | None: ...

    async def revoke_key(self, key_id: str) -> KeyRecord | None: ...

    async def find_key(self, digest: str) -> tuple[KeyRecord, TenantRecord] | None:
        """The key with this SHA-256 hex digest and its tenant (deleted ones included: the caller checks)."""
        ...

    async def insert_usage(self, rows: list[dict[str, Any]]) -> int:
        """Write ledger rows in one transaction (fields: ``auth.sql.USAGE_COLUMNS``); a ``row_id`` already
        stored is skipped. Returns the rows inserted."""
        ...

    async def tokens_on_day(
        self, *, tenant_id: str | None = None, key_id: str | None = None, day: str, model: str | None = None
    ) -> int:
        """Tokens billed on UTC ``day`` to a tenant or a key (``model``: only that model's requests)."""
        ...

    async def usage_summary(
        self, tenant_id: str, since: float | None, until: float | None
    ) -> dict[str, Any]: ...

    async def spend(
        self,
        *,
        since: float | None = None,
        until: float | None = None,
        tenant_id: str | None = None,
        key_id: str | None = None,
        model: str | None = None,
        group_by: str = "tenant",
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Totals and per-group sums (``auth.sql.SqlStore.spend``)."""
        ...

    async def usage_rows(self, tenant_id: str, limit: int = 100) -> list[dict[str, Any]]: ...


def is_postgres(location: str) -> bool:
    """Whether ``location`` names a PostgreSQL database (``postgresql://`` or ``postgres://``)."""
    return location.startswith(("postgresql://", "postgres://"))


def check_location(location: str) -> None:
    """Refuse a ``location`` that looks like a URL but is not a PostgreSQL one (``mysql://``, ``postgresq://``,
    ``postgresql:/x``): without this it would be taken as a SQLite file path and a gateway would start on an
    empty database. Raises ValueError naming the location and what is accepted."""
    if is_postgres(location) or location == ":memory:":
        return
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", location):
        raise ValueError(
            f"tenancy store {location!r}: not a postgresql:// (or postgres://) URL; a SQLite file is a path"
        )


def open_store(location: str) -> TenantStore:
    """The store for ``location`` (not yet opened: ``await store.open()``): PostgreSQL for a
    ``postgresql://``/``postgres://`` URL, else the SQLite file at that path (or ``:memory:``).
    Raises ValueError for a location :func:`check_location` refuses."""
    check_location(location)
    if is_postgres(location):
        from .postgres_store import postgres_store

        return postgres_store(location)
    from .sqlite_store import sqlite_store

    return sqlite_store(location)
