"""The shared store: PostgreSQL, for several gateways serving as one (``--db postgresql://user@host/db``).

* psycopg 3 (synchronous), at most ``POOL_SIZE`` connections (:class:`Connections`), each call in a worker
  thread behind a ``CapacityLimiter(POOL_SIZE)`` (``auth.sql.ThreadedStore``). A pooled connection is checked
  before use, so one the server closed (a restart) is replaced, not used. ``psycopg_pool`` is not used: its
  connections are made by background workers with their own backoff, so a caller waits out the pool timeout
  while the server refuses, and again after it is back; here the calling thread connects, and fails or
  recovers at once.
* Bounded waits: connect 2 s, a statement 5 s, TCP keepalive and ``tcp_user_timeout`` 5 s for a host that
  vanished. Past any of them a call raises :class:`auth.errors.StoreUnavailable`; parameters given in the URL
  win over these defaults.
* Every call is one transaction (``BEGIN`` ... ``COMMIT``). Changes to tenants and keys
  ``NOTIFY`` channel :data:`CHANNEL` in the same transaction (delivered only if it commits);
  :class:`PostgresChangeFeed` listens on a connection of its own.
* Migrations (``auth.schema``, translated) run under ``pg_advisory_xact_lock`` (:data:`MIGRATION_LOCK`), so
  gateways starting together migrate once; each migration is one transaction (PostgreSQL's DDL is
  transactional).

Reference: PostgreSQL 15 manual, "NOTIFY", "Advisory Locks", "libpq connection parameters"; psycopg 3
"Transactions management" and "Asynchronous notifications".
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import trio
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from .errors import StoreUnavailable
from .schema import translate
from .sql import Row, ThreadedStore, migrate, schema_version

log = logging.getLogger("auth.postgres")

CHANNEL = "llm_gateway_changes"
MIGRATION_LOCK = 0x6C6C6D67  # "llmg": the advisory lock key taken while migrating
POOL_SIZE = 4
DEFAULTS: dict[str, Any] = {
    "connect_timeout": 2,
    "options": "-c statement_timeout=5000",
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 1,
    "keepalives_count": 3,
    "tcp_user_timeout": 5000,
    "application_name": "llm-gateway",
}
DOWN = (psycopg.OperationalError, psycopg.InterfaceError)  # the server did not answer


def conn_params(url: str) -> dict[str, Any]:
    """libpq parameters of ``url`` with :data:`DEFAULTS` for those it does not set.

    Raises:
        ValueError: ``url`` is not a valid connection string.
    """
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as e:
        raise ValueError(f"invalid PostgreSQL URL: {e}") from None
    return {**DEFAULTS, **params}


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and messages)."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def unavailable(exc: BaseException) -> StoreUnavailable:
    """The 503 for a driver error; ``detail``: its class and first line (a host and port, never a password)."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return StoreUnavailable(detail=f"{type(exc).__name__}: {first}")


class PostgresTx:
    """A transaction on one pooled connection (see :class:`auth.sql.Tx`)."""

    def __init__(self, conn: psycopg.Connection[Row]) -> None:
        self.conn = conn

    def rows(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> list[Row]:
        return self.conn.execute(translate(sql, "postgresql"), args).fetchall()

    def run(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> int:
        return self.conn.execute(translate(sql, "postgresql"), args).rowcount

    def many(self, sql: str, seq: list[tuple[Any, ...]]) -> int:
        with self.conn.cursor() as cur:
            cur.executemany(translate(sql, "postgresql"), seq)
            return cur.rowcount

    def announce(self, what: str) -> None:
        self.conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, what))


class Connections:
    """The pooled connections of one store: idle ones are reused, checked first (an empty query: one round
    trip), and a connection the server closed is replaced, not used; callers are bounded by the store's
    ``CapacityLimiter``, so at most ``size`` are open. Connecting is done by the calling thread, so a refused
    connection fails at once and an unreachable host within ``connect_timeout``; nothing retries in the
    background (the next call simply connects again)."""

    def __init__(self, params: dict[str, Any], size: int) -> None:
        self.params = params
        self.size = size
        self._idle: list[psycopg.Connection[Row]] = []
        self._lock = threading.Lock()

    def _take(self) -> psycopg.Connection[Row]:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return psycopg.connect(**self.params, autocommit=True, row_factory=dict_row)
            try:
                conn.execute("")
                return conn
            except DOWN:
                conn.close()

    def _give_back(self, conn: psycopg.Connection[Row]) -> None:
        if conn.closed or conn.broken:
            return
        with self._lock:
            if len(self._idle) < self.size:
                self._idle.append(conn)
                return
        conn.close()

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Connection[Row]]:
        """A connection inside ``BEGIN`` ... ``COMMIT`` (rolled back on an exception)."""
        conn = self._take()
        try:
            with conn.transaction():
                yield conn
        finally:
            self._give_back(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class PostgresDatabase:
    """Connections to ``url``, migrated when opened (see the module docstring).

    Raises:
        StoreUnavailable: the server could not be reached within the connect timeout.
        ValueError: an invalid URL.
    """

    dialect = "postgresql"
    integrity_error = psycopg.IntegrityError

    def __init__(self, url: str, *, pool_size: int = POOL_SIZE) -> None:
        self.url = url
        self.pool = Connections(conn_params(url), pool_size)
        try:
            self.migrate()
        except BaseException:
            self.pool.close()
            raise

    @contextmanager
    def transaction(self, *, write: bool) -> Iterator[PostgresTx]:
        try:
            with self.pool.transaction() as conn:
                yield PostgresTx(conn)
        except DOWN as e:
            raise unavailable(e) from None

    def schema_version(self) -> int:
        with self.transaction(write=False) as tx:
            return schema_version(tx)

    def migrate(self) -> int:
        """Apply the missing migrations, each in a transaction holding the advisory lock; the version."""
        return migrate(self, f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")

    def close(self) -> None:
        self.pool.close()


class PostgresChangeFeed:
    """``LISTEN`` on :data:`CHANNEL` on a connection of its own; every notification (a committed change to a
    tenant or key, by any gateway) calls ``on_change``. Run it in a nursery: ``await nursery.start(feed.run,
    on_change)``; cancel it to stop.

    When the connection is lost it reconnects with backoff (0.1 s doubling to 2 s); after each (re)connect it
    calls ``on_change`` once, since notifications sent meanwhile are lost. ``connected`` is True while it
    listens (the key cache may then trust cached lookups longer).
    """

    def __init__(self, url: str, *, poll_s: float = 0.25) -> None:
        self.url = url
        self.poll_s = poll_s
        self.connected = False
        self.reconnects = 0

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(**conn_params(self.url), autocommit=True)
        try:
            conn.execute(f"LISTEN {CHANNEL}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _wait(self, conn: psycopg.Connection[Any]) -> int:
        """Notifications received within ``poll_s`` (returns at the first)."""
        return len(list(conn.notifies(timeout=self.poll_s, stop_after=1)))

    async def run(self, on_change: Callable[[], None], task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        backoff, down_since = 0.1, None
        while True:
            try:
                conn = await trio.to_thread.run_sync(self._connect)
            except DOWN as e:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning(
                        "change feed: cannot listen on %s (%s); retrying", redact(self.url), type(e).__name__
                    )
                await trio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if down_since is not None:
                log.warning("change feed: listening again after %.1f s", time.monotonic() - down_since)
                self.reconnects += 1
            backoff, down_since = 0.1, None
            self.connected = True
            on_change()  # whatever changed while no one listened
            try:
                while True:
                    if await trio.to_thread.run_sync(self._wait, conn):
                        on_change()
            except DOWN as e:
                down_since = time.monotonic()
                log.warning("change feed: connection lost (%s); reconnecting", type(e).__name__)
            finally:
                self.connected = False
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(conn.close)


def postgres_store(url: str, *, pool_size: int = POOL_SIZE) -> ThreadedStore:
    """The async store on the PostgreSQL database ``url``, with its change feed (``store.feed``)."""
    return ThreadedStore(
        lambda: PostgresDatabase(url, pool_size=pool_size),
        trio.CapacityLimiter(pool_size),
        location=redact(url),
        feed=PostgresChangeFeed(url),
    )
