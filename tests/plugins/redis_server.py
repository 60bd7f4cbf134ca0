"""A throwaway redis-server for the tests that share rate limits through Redis (installed by
``scripts/sysdeps.sh``): loopback only, a free port, no persistence, files in a temporary folder; optionally
with a password (``--requirepass``), an ACL user, or TLS only (a self-signed certificate made with the
``openssl`` command); a Sentinel that monitors one. Also the helpers of those tests: the admissions' tasks in a nursery (:func:`running`) and
a raw coredis client to look at the server (:func:`raw_redis`)."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import coredis
import pytest
import trio
from plugins.gateway_server import free_port

from ratelimit.admission import Admission
from ratelimit.redis_client import redis_connection


def require_redis() -> None:
    """Skip the calling test when ``redis-server`` is not installed."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (make sysdeps)")


@dataclass(frozen=True)
class TLSFiles:
    """A self-signed certificate for ``127.0.0.1`` (IP SAN) and its key, PEM files; the certificate is its own
    CA (pass it as ``ssl_ca_certs``)."""

    cert: Path
    key: Path


def self_signed(folder: Path) -> TLSFiles:
    """Make a self-signed certificate for ``127.0.0.1`` (RSA 2048, one day) with the ``openssl`` command; skip
    the calling test when there is no ``openssl``."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    cert, key = folder / "redis.crt", folder / "redis.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return TLSFiles(cert, key)


def redis_has_tls() -> bool:
    """Whether this ``redis-server`` was built with TLS (Debian's is): it names ``tls-port`` as a directive it
    knows when asked for an impossible TLS setup, and an unknown one otherwise."""
    r = subprocess.run(
        ["redis-server", "--port", "0", "--tls-port", "1", "--tls-cert-file", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return "Bad directive" not in r.stdout + r.stderr and "tls" in (r.stdout + r.stderr).lower()


def _answers(port: int, tls: TLSFiles | None) -> bool:
    """Whether a server on ``port`` answers a plain ``PING`` (``+PONG``, or ``-NOAUTH`` with a password)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as raw:
            s: socket.socket = raw
            if tls is not None:
                ctx = ssl.create_default_context(cafile=str(tls.cert))
                ctx.load_cert_chain(tls.cert, tls.key)  # for --tls-auth-clients yes
                s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def start_redis(
    folder: Path, port: int | None = None, *, extra: Sequence[str] = (), tls: TLSFiles | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``redis-server`` (on ``port``, else a free one: pass the port of a stopped one to restart it) and
    wait (at most 10 s) until it answers ``PING``; returns the process and its ``redis://127.0.0.1:PORT/0``
    URL (``rediss://`` with ``tls``: then it listens on TLS only, without asking for client certificates).
    ``extra`` are more options (``--requirepass``, ``--user``...). The caller stops the process
    (:func:`stop_redis`)."""
    require_redis()
    port = port or free_port()
    listen = ["--port", str(port)]
    if tls is not None:
        listen = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(tls.cert)]
        listen += [
            "--tls-key-file",
            str(tls.key),
            "--tls-ca-cert-file",
            str(tls.cert),
            "--tls-auth-clients",
            "no",
        ]
    proc = subprocess.Popen(
        ["redis-server", *listen, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--dir", str(folder), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not _answers(port, tls):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)
    return proc, f"{'rediss' if tls else 'redis'}://127.0.0.1:{port}/0"


def start_sentinel(
    folder: Path, primary_url: str, *, service: str = "mymaster", password: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a Redis Sentinel (``redis-server --sentinel``, its config file in ``folder``) that monitors the
    server of ``primary_url`` as ``service`` (quorum 1; ``password``: the primary's), and wait (at most 10 s)
    until it names the primary; returns the process and the ``redis+sentinel://127.0.0.1:PORT/<service>/0``
    URL (with ``:password@`` when given). Stop it with :func:`stop_redis`."""
    require_redis()
    port = free_port()
    conf = folder / f"sentinel-{port}.conf"
    lines = [f"port {port}", "bind 127.0.0.1", f"dir {folder}"]
    lines.append(f"sentinel monitor {service} 127.0.0.1 {redis_port(primary_url)} 1")
    if password is not None:
        lines.append(f"sentinel auth-pass {service} {password}")
    conf.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen(
        ["redis-server", str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    ask = f"*3\r\n$8\r\nSENTINEL\r\n$23\r\nGET-MASTER-ADDR-BY-NAME\r\n${len(service)}\r\n{service}\r\n"
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(ask.encode())
                if s.recv(64).startswith(b"*2"):
                    break
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("redis-server --sentinel did not start")
        time.sleep(0.05)
    auth = f":{quote(password, safe='')}@" if password is not None else ""
    return proc, f"redis+sentinel://{auth}127.0.0.1:{port}/{service}/0"


def stop_redis(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server :func:`start_redis` started (SIGTERM, then SIGKILL after 5 s); waits until it is gone."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def restart_redis(proc: subprocess.Popen[bytes], folder: Path, url: str) -> subprocess.Popen[bytes]:
    """Stop the server of ``url`` and start a new one on its port (the state is lost: no persistence); returns
    the new process. Blocking: from a Trio test, ``await trio.to_thread.run_sync(restart_redis, ...)``, so the
    clients of the test go on running meanwhile as a gateway's would."""
    stop_redis(proc)
    return start_redis(folder, port=redis_port(url))[0]


def redis_port(url: str) -> int:
    """The port of a ``redis://127.0.0.1:PORT/0`` URL."""
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


@asynccontextmanager
async def running(*admissions: Admission) -> AsyncIterator[None]:
    """The admissions' tasks (Redis: the connections and the lease heartbeat) in a nursery; on exit the
    admissions are closed, which ends them."""
    async with trio.open_nursery() as nursery:
        for adm in admissions:
            await nursery.start(adm.run)
        try:
            yield
        finally:
            for adm in admissions:
                await adm.aclose()


@asynccontextmanager
async def raw_redis(url: str) -> AsyncIterator[coredis.Redis[str]]:
    """A coredis client of ``url`` (text replies), to look at or stall the server from a test."""
    async with redis_connection(url).open() as client:
        yield client
