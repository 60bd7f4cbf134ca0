"""A throwaway redis-server for the tests that share rate limits through Redis (installed by
``scripts/sysdeps.sh``): loopback only, a free port, no persistence, files in a temporary folder."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from plugins.gateway_server import free_port


def require_redis() -> None:
    """Skip the calling test when ``redis-server`` is not installed."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (make sysdeps)")


def start_redis(folder: Path, port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``redis-server`` (on ``port``, else a free one: pass the port of a stopped one to restart it) and
    wait (at most 10 s) until it answers ``PING``; returns the process and its ``redis://127.0.0.1:PORT/0``
    URL. The caller stops the process (:func:`stop_redis`)."""
    require_redis()
    port = port or free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--dir", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)


def stop_redis(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server :func:`start_redis` started (SIGTERM, then SIGKILL after 5 s); waits until it is gone."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def redis_port(url: str) -> int:
    """The port of a ``redis://127.0.0.1:PORT/0`` URL."""
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])
