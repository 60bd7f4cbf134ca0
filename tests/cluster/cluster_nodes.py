"""The parts of a cluster on one machine, and the helpers of the cluster tests.

:func:`open_cluster` (the ``cluster_session`` fixture of ``tests/cluster/conftest.py``) starts:

* one shared store: a PostgreSQL server (``tests/plugins/postgres_server.py``) and a database on it
  (``--db postgresql://...``); with ``LLM_GATEWAY_CLUSTER_STORE=sqlite``, one SQLite file instead (the tests
  that stop the database server skip that part);
* one ``redis-server`` (``tests/plugins/redis_server.py``) for the shared limits and leases;
* one backend process (``python -m backend --listen unix:PATH``, the served default dtype): both gateways are
  clients of it (``--backend-url``), so the model loads once and killing a gateway leaves the backend serving
  the other one;
* two gateway processes, ``A`` and ``B`` (``python -m gateway serve``, real hypercorn on loopback, through
  ``plugins.gateway_server.start_gateway``), sharing the store, Redis and the backend. ``A`` starts first:
  it creates the schema and the ``default`` tenant, ``B`` opens them.

A test that kills or stops a part gets it back through :meth:`Cluster.node` and :meth:`Cluster.heal`, so
the tests do not depend on their order (the files run in name order; the one that kills ``A`` runs last, so a
full run restarts nothing).

Readers independent of the code under test: :meth:`Cluster.usage` reads the ledger straight from the
database, :meth:`Cluster.lease_count` the lease set straight from Redis (:func:`redis_call`, RESP 2 over a
plain socket).
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
import pytest
from plugins.gateway_server import ROOT, GatewayProc, _die_with_pytest, chat_body, start_gateway
from plugins.postgres_server import (
    PostgresHandle,
    create_database,
    restart_postgres,
    start_postgres,
    stop_postgres,
    wait_for_postgres,
)
from plugins.redis_server import redis_port, require_redis, start_redis, stop_redis

BACKEND_START_S = 300.0  # seconds the shared backend gets to load the model (slow shared machines)
# the gateways' ledger (docs/tenancy.md): a row waits at most LEDGER_FLUSH_S for its batch of at most
# LEDGER_BATCH rows, which bounds what a crash loses; each gateway spools in a folder of its own
LEDGER_FLUSH_S = 0.5
LEDGER_BATCH = 512
# --key-cache-s of the gateways on a shared SQLite file (no change feed; the default 1 s is the whole bound)
SQLITE_KEY_CACHE_S = 0.5


class SharedStore(Protocol):
    """The database every gateway of the cluster opens (``--db``)."""

    kind: str  # "postgresql" or "sqlite"

    def db_arg(self) -> str:
        """The value of ``--db``."""
        ...

    def usage(self, tenant_id: str) -> list[dict]:
        """The usage-ledger rows of ``tenant_id``, oldest first, read straight from the database (not through
        the gateways). A row's ``request_id`` is the response's ``id`` (``chatcmpl-...``)."""
        ...

    def stop(self) -> None:
        """Stop the database server and wait until it is gone (SQLite: no server; ``pytest.skip``)."""
        ...

    def start(self) -> None:
        """Start it again on the same address, with its data; returns once it accepts connections."""
        ...

    def ensure(self) -> None:
        """Start it again if a test left it stopped (SQLite: nothing to do)."""
        ...

    def close(self) -> None: ...


@dataclass
class SqliteStore:
    """One SQLite file shared by the gateways (WAL; several processes may open it)."""

    path: Path
    kind: str = "sqlite"

    def db_arg(self) -> str:
        return str(self.path)

    def usage(self, tenant_id: str) -> list[dict]:
        con = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5)
        con.row_factory = sqlite3.Row
        try:
            return [
                dict(r)
                for r in con.execute("SELECT * FROM usage WHERE tenant_id = ? ORDER BY id", [tenant_id])
            ]
        finally:
            con.close()

    def stop(self) -> None:
        pytest.skip("the shared store is a SQLite file: there is no database server to stop")

    def start(self) -> None:
        pytest.skip("the shared store is a SQLite file: there is no database server to start")

    def ensure(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class PostgresStore:
    """One PostgreSQL server (``tests/plugins/postgres_server.py``) and a database on it for the cluster."""

    handle: PostgresHandle
    url: str  # the cluster's database
    kind: str = "postgresql"

    def db_arg(self) -> str:
        return self.url

    def usage(self, tenant_id: str) -> list[dict]:
        import psycopg
        from psycopg.rows import dict_row

        with psycopg.connect(self.url, connect_timeout=5, row_factory=dict_row) as conn:
            return list(conn.execute("SELECT * FROM usage WHERE tenant_id = %s ORDER BY id", [tenant_id]))

    def stop(self) -> None:
        stop_postgres(self.handle)

    def start(self) -> None:
        restart_postgres(self.handle)
        wait_for_postgres(self.url)

    def ensure(self) -> None:
        if not (self.handle.data / "postmaster.pid").exists():
            self.start()

    def close(self) -> None:
        stop_postgres(self.handle)  # the plugin removes its files when the process exits


def open_store(folder: Path) -> SharedStore:
    """The shared store of a new cluster whose files live in ``folder``: PostgreSQL (skips the caller when it is
    not installed), or one SQLite file when ``LLM_GATEWAY_CLUSTER_STORE=sqlite``."""
    if os.environ.get("LLM_GATEWAY_CLUSTER_STORE", "postgresql") == "sqlite":
        return SqliteStore(folder / "cluster.sqlite")
    handle, url = start_postgres(
        folder / "postgres"
    )  # as root, its files live where the postgres user can reach
    try:
        return PostgresStore(handle, create_database(url))
    except BaseException:
        stop_postgres(handle)
        raise


def redis_call(url: str, *args: str, timeout: float = 2.0) -> int | bytes | None:
    """One command to the Redis at ``url`` over a fresh connection (RESP 2; integer and bulk replies only).

    Raises:
        OSError: Redis does not answer, or answers an error or another reply type.
    """
    with socket.create_connection(("127.0.0.1", redis_port(url)), timeout=timeout) as s:
        s.sendall(
            b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a.encode()), a.encode()) for a in args)
        )
        reply = b""
        while b"\r\n" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                raise OSError("redis closed the connection")
            reply += chunk
        head, _, rest = reply.partition(b"\r\n")
        if head[:1] == b":":
            return int(head[1:])
        if head[:1] == b"$":
            n = int(head[1:])
            if n < 0:
                return None
            while len(rest) < n:
                rest += s.recv(4096)
            return rest[:n]
        raise OSError(f"unexpected redis reply {head[:80]!r}")


@dataclass
class Backend:
    """The backend process both gateways are clients of."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_backend(folder: Path) -> Backend:
    """``python -m backend --listen unix:<folder>/backend.sock`` (the default model and dtype); returns once it
    printed its readiness line.

    Raises:
        RuntimeError: it exited, or was not ready within ``BACKEND_START_S`` seconds.
    """
    sock = folder / "backend.sock"
    log_path = folder / "backend.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend", "--listen", f"unix:{sock}"],
            cwd=str(ROOT),
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_pytest,
        )
    deadline = time.monotonic() + BACKEND_START_S
    while b"backend ready" not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            raise RuntimeError(f"backend did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.05)
    return Backend(proc, f"unix:{sock}", log_path)


@dataclass
class TenantKey:
    """A tenant created for one test and its one API key."""

    tenant_id: str
    key: str
    key_id: str

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}


@dataclass
class Cluster:
    """Two gateways (:meth:`node` ``"A"`` and ``"B"``) over one store, one Redis and one backend."""

    folder: Path
    store: SharedStore
    backend: Backend
    redis_proc: subprocess.Popen
    redis_url: str
    nodes: dict[str, GatewayProc] = field(default_factory=dict)
    redis_prefix: str = "gw:rl:"  # the gateways' default key prefix in Redis

    def start_node(self, name: str) -> GatewayProc:
        """Start gateway ``name`` on the shared store, Redis and backend; returns once its /readyz is 200."""
        args = (
            *("--db", self.store.db_arg(), "--redis-url", self.redis_url, "--backend-url", self.backend.url),
            *("--ledger-flush-s", str(LEDGER_FLUSH_S), "--ledger-batch", str(LEDGER_BATCH)),
            *("--ledger-spool-dir", str(self.folder / f"spool-{name}")),
            # SQLite has no change feed: only the key cache's TTL bounds how long a change takes to arrive
            *(("--key-cache-s", str(SQLITE_KEY_CACHE_S)) if self.store.kind == "sqlite" else ()),
        )
        self.nodes[name] = start_gateway(*args, dtype=None)
        return self.nodes[name]

    def node(self, name: str) -> GatewayProc:
        """The gateway ``name``, started (again) first if it is not running."""
        gp = self.nodes.get(name)
        if gp is None or gp.proc.poll() is not None:
            if gp is not None:
                gp.stop()  # closes its stats client
            gp = self.start_node(name)
        return gp

    def kill(self, name: str) -> None:
        """SIGKILL gateway ``name``: nothing is flushed, released or renewed."""
        gp = self.nodes[name]
        os.kill(gp.proc.pid, signal.SIGKILL)
        gp.proc.wait(10)

    def stop_redis(self) -> None:
        """Stop Redis (SIGTERM; its state is not saved) and wait until it is gone."""
        stop_redis(self.redis_proc)

    def ensure_redis(self) -> None:
        """Start Redis again on its port if a test left it stopped."""
        if self.redis_proc.poll() is not None:
            self.redis_proc, _ = start_redis(self.folder, port=redis_port(self.redis_url))

    def heal(self) -> None:
        """Start again the database server and Redis if a test (one that failed half-way) left them stopped;
        the gateways are started again by :meth:`node`."""
        self.store.ensure()
        self.ensure_redis()

    def lease_count(self, tenant_id: str) -> int:
        """The members of ``tenant_id``'s lease set in Redis: its admitted requests not yet released (a
        released lease is removed; one whose holder died stays until an acquire drops it after its TTL)."""
        n = redis_call(self.redis_url, "ZCARD", f"{self.redis_prefix}t:{tenant_id}:conc")
        assert isinstance(n, int), n
        return n

    def new_tenant(self, via: str = "A", **limits: float) -> TenantKey:
        """A new tenant with ``limits`` and one key, created through gateway ``via``'s admin API."""
        g = self.node(via)
        r = httpx.post(
            g.base_url + "/admin/v1/tenants",
            json={"name": "cluster-" + os.urandom(4).hex(), "limits": limits},
            headers=g.admin_headers(),
            timeout=30,
        )
        assert r.status_code == 201, r.text
        tid = r.json()["id"]
        r = httpx.post(
            g.base_url + f"/admin/v1/tenants/{tid}/keys", json={}, headers=g.admin_headers(), timeout=30
        )
        assert r.status_code == 201, r.text
        return TenantKey(tid, r.json()["key"], r.json()["id"])

    def usage(self, tenant_id: str, *, at_least: int = 0, timeout: float = 10.0) -> list[dict]:
        """The ledger rows of ``tenant_id`` once there are ``at_least`` of them (after ``timeout`` seconds:
        those there are)."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.store.usage(tenant_id)
            if len(rows) >= at_least or time.monotonic() > deadline:
                return rows
            time.sleep(0.1)

    def close(self) -> None:
        for gp in self.nodes.values():  # every gateway drains at once, then each is waited for
            if gp.proc.poll() is None:
                gp.proc.send_signal(signal.SIGTERM)
        for gp in self.nodes.values():
            gp.stop()
        self.backend.stop()
        stop_redis(self.redis_proc)
        self.store.close()


def open_cluster(folder: Path) -> Cluster:
    """Start a cluster whose files live in ``folder`` (see the module docstring). Skips the caller when
    ``redis-server`` is not installed. The caller closes it (:meth:`Cluster.close`)."""
    require_redis()
    store = open_store(folder)
    redis_proc, redis_url = start_redis(folder)
    try:
        backend = start_backend(folder)
    except BaseException:
        stop_redis(redis_proc)
        store.close()
        raise
    c = Cluster(folder, store, backend, redis_proc, redis_url)
    try:
        c.node("A")
        c.node("B")
    except BaseException:
        c.close()
        raise
    return c


def chat(g: GatewayProc, max_tokens: int, *, stream: bool = False) -> dict:
    """A chat-completions body for ``g``'s model that generates exactly ``max_tokens`` tokens."""
    return chat_body(g, "Tell me a story.", max_tokens=max_tokens, ignore_eos=True, stream=stream)
