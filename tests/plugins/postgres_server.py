"""A throwaway PostgreSQL server for the tests that share tenants, keys and the ledger (Debian's ``postgresql``
package, installed by ``scripts/sysdeps.sh``): loopback only, a free port, ``fsync=off``, files in a temporary
folder, trust authentication for user ``postgres``.

``initdb`` and ``pg_ctl`` refuse to run as root; when the tests run as root they run as the ``postgres`` user
(``runuser -u postgres --``) on a folder it owns. Fixtures::

    postgres_url       (session) one server for the whole run: ``postgresql://postgres@127.0.0.1:PORT/postgres``
    pg_database_url    (function) a fresh database on it (``CREATE DATABASE``): tests never see each other's rows

A test that stops and restarts the server during traffic starts its own (:func:`start_postgres`,
:func:`stop_postgres`, :func:`restart_postgres`: same folder, same port, same URL).
"""

from __future__ import annotations

import atexit
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from plugins.gateway_server import free_port


def postgres_bin() -> Path | None:
    """The folder of the newest installed server's ``initdb``/``pg_ctl`` (``/usr/lib/postgresql/N/bin``), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def require_postgres() -> Path:
    """The binaries' folder; skips the calling test when PostgreSQL is not installed."""
    path = postgres_bin()
    if path is None:
        pytest.skip("PostgreSQL not installed: no /usr/lib/postgresql/*/bin/initdb (make sysdeps)")
    return path


@dataclass
class PostgresHandle:
    """A server this plugin started: its data folder, socket folder, port and binaries."""

    bin: Path
    data: Path
    sockets: Path
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _own(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


HOMES = Path(tempfile.gettempdir()) / "llm-gateway-pg"  # where the servers' files live when run as root
_made: list[Path] = []  # homes this process made: removed at exit (their servers stopped first)


def _home(folder: Path) -> Path:
    """The folder holding a server's files for ``folder``: ``folder`` itself, or, as root, a folder of the
    ``postgres`` user under :data:`HOMES` named after ``folder`` (so a second start finds it). Not under
    pytest's base temp folder: every pytest start on the machine makes that 0700 again, and the postgres user
    could no longer reach its files to stop or restart the server."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return folder
    HOMES.mkdir(exist_ok=True)
    HOMES.chmod(0o711)
    home = HOMES / hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    if not home.exists():
        home.mkdir()
        _made.append(home)
    _own(home)
    return home


@atexit.register
def _remove_homes() -> None:
    for home in _made:
        if (home / "pgdata" / "postmaster.pid").exists():
            subprocess.run(
                _as_postgres(
                    [str(postgres_bin() / "pg_ctl"), "-D", str(home / "pgdata"), "-m", "immediate", "stop"]
                ),
                capture_output=True,
                timeout=30,
            )
        shutil.rmtree(home, ignore_errors=True)


def _run(cmd: list[str], what: str) -> None:
    r = subprocess.run(_as_postgres(cmd), capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}")


def start_postgres(folder: Path, port: int | None = None) -> tuple[PostgresHandle, str]:
    """Create a cluster for ``folder`` (in it, or as root in its home under :data:`HOMES`; once: a second call on
    the same folder reuses it) and start it on
    ``port`` (else a free one); returns once it accepts connections (``pg_ctl -w``). Returns the handle and the
    URL ``postgresql://postgres@127.0.0.1:PORT/postgres``. The caller stops it (:func:`stop_postgres`).

    Raises:
        RuntimeError: ``initdb`` or ``pg_ctl start`` failed (their stderr in the message).
    """
    bin_dir = require_postgres()
    home = _home(folder)
    data, sockets = home / "pgdata", home / "sock"
    sockets.mkdir(exist_ok=True)
    _own(sockets)
    if not (data / "PG_VERSION").exists():
        _run(
            [str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"]
            + ["-E", "UTF8", "--locale=C"],
            "initdb",
        )
    handle = PostgresHandle(bin_dir, data, sockets, port or free_port(), home / "postgres.log")
    _pg_ctl_start(handle)
    return handle, handle.url


def _pg_ctl_start(h: PostgresHandle) -> None:
    opts = (
        f"-k {h.sockets} -p {h.port} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off"
        " -c full_page_writes=off -c shared_buffers=16MB -c max_connections=100"
    )
    if not h.log.exists():
        h.log.touch()
        _own(h.log)
    _run(
        [str(h.bin / "pg_ctl"), "-D", str(h.data), "-l", str(h.log), "-o", opts, "-w", "-t", "30", "start"],
        "pg_ctl start",
    )


def stop_postgres(handle: PostgresHandle) -> None:
    """Stop the server (``pg_ctl stop -m fast``: open sessions are ended); waits until it is down. A server
    already stopped is left alone."""
    if not (handle.data / "postmaster.pid").exists():
        return
    _run(
        [str(handle.bin / "pg_ctl"), "-D", str(handle.data), "-m", "fast", "-w", "-t", "30", "stop"],
        "pg_ctl stop",
    )


def restart_postgres(handle: PostgresHandle) -> None:
    """Start a stopped server again on the same folder and port (the same URL)."""
    _pg_ctl_start(handle)


def create_database(url: str) -> str:
    """``CREATE DATABASE`` a fresh one on the server of ``url``; returns its URL."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """One PostgreSQL server for the session (skipped when not installed); its ``postgres`` database URL."""
    require_postgres()
    folder = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
    handle, url = start_postgres(folder)
    try:
        yield url
    finally:
        stop_postgres(handle)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def pg_database_url(postgres_url: str) -> str:
    """A database of its own for one test, on the session's server."""
    return create_database(postgres_url)


def wait_for_postgres(url: str, timeout_s: float = 10.0) -> None:
    """Wait until ``url`` accepts a connection (after :func:`restart_postgres`)."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with psycopg.connect(url, connect_timeout=1):
                return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
