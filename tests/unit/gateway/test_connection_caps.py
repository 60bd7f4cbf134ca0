"""Connection bounds (``gateway.connections``): the caps count and refuse in the API's shape, trio's accept
errors are logged once per interval without a traceback, the soft open-file limit is raised to the hard one."""

from __future__ import annotations

import logging
import resource
import subprocess
import sys

from gateway.connections import ConnectionCaps, OncePerInterval, _refusal_bytes


def test_caps_per_client_then_total():
    caps = ConnectionCaps(total=3, per_client=2)
    assert caps.acquire("a") is None and caps.acquire("a") is None
    err = caps.acquire("a")
    assert err is not None and err.status == 429 and err.code == "too_many_connections"
    assert caps.acquire("b") is None
    err = caps.acquire("c")
    assert err is not None and err.status == 503 and err.headers["retry-after"] == "1"
    caps.release("a")
    assert caps.acquire("c") is None and caps.open == 3 and caps.by_client == {"a": 1, "b": 1, "c": 1}
    raw = _refusal_bytes(err)
    assert raw.startswith(b"HTTP/1.1 503 ") and b"connection: close" in raw
    assert raw.endswith(b'"code":"too_many_connections"}}')


def test_accept_errors_once_per_interval():
    now = [0.0]
    f = OncePerInterval(10.0, clock=lambda: now[0])

    def record() -> logging.LogRecord:
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            return logging.LogRecord(
                "trio.serve_listeners", logging.ERROR, "", 0, "accept returned EMFILE", (), sys.exc_info()
            )

    first = record()
    assert f.filter(first) and first.exc_info is None  # no traceback
    passed = 0
    for _ in range(99):  # every 0.1 s for 9.9 s
        now[0] += 0.1
        passed += f.filter(record())
    assert passed == 0
    now[0] += 0.2
    r = record()
    assert f.filter(r) and "99 more like it" in r.getMessage()


def test_soft_open_file_limit_raised_to_hard_and_logged():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = (
        "import logging, resource\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from gateway.connections import raise_nofile\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, (256, {hard}))\n"
        "print(raise_nofile(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    assert out.stdout.split() == [str(want), str(want)], out
    assert "raised from 256 to" in out.stderr
