"""The embedded store: one SQLite file (or ``:memory:``), the default, needing no server.

* One connection, WAL journal, ``synchronous=NORMAL``, ``busy_timeout`` 5 s (several gateway processes on one
  host may share the file). Calls run in a worker thread behind a ``CapacityLimiter(1)``, so the connection is
  used by one thread at a time (``check_same_thread=False``).
* Writes run in ``BEGIN IMMEDIATE`` transactions; reads in autocommit. No change feed: another process sharing
  the file sees a change within the key cache's TTL (``auth.authenticator``).
* Migrations (``auth.schema``) are applied when the file is opened, one transaction each.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio

from .sql import Row, SqlStore, ThreadedStore, migrate, schema_version


class SqliteTx:
    """A transaction on the one connection (see :class:`auth.sql.Tx`)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def rows(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> list[Row]:
        return [dict(r) for r in self.conn.execute(sql, args)]

    def run(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> int:
        return self.conn.execute(sql, args).rowcount

    def many(self, sql: str, seq: list[tuple[Any, ...]]) -> int:
        return self.conn.executemany(sql, seq).rowcount

    def announce(self, what: str) -> None:
        """No feed on SQLite."""


class SqliteDatabase:
    """One SQLite connection, migrated when opened (see the module docstring)."""

    dialect = "sqlite"
    integrity_error = sqlite3.IntegrityError

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

    @contextmanager
    def transaction(self, *, write: bool) -> Iterator[SqliteTx]:
        if not write:
            yield SqliteTx(self.conn)
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield SqliteTx(self.conn)
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def schema_version(self) -> int:
        with self.transaction(write=False) as tx:
            return schema_version(tx)

    def migrate(self) -> int:
        """Apply the missing migrations, each in its own IMMEDIATE transaction; the version."""
        return migrate(self)

    def close(self) -> None:
        self.conn.close()


def open_sqlite(path: str) -> SqlStore:
    """The synchronous store on the file ``path`` (created with its folder; ``":memory:"`` for a throwaway)."""
    return SqlStore(SqliteDatabase(path))


def sqlite_store(path: str) -> ThreadedStore:
    """The async store on ``path`` (open it with ``await store.open()``)."""
    return ThreadedStore(lambda: SqliteDatabase(path), trio.CapacityLimiter(1), location=path)
