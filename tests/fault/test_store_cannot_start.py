"""A tenancy store or Redis that cannot be reached at start: the gateway exits 1 at once with one line.

``python -m gateway serve --db postgresql://...`` (nothing listens) and ``--redis-url redis://...`` (nothing
listens): exit status 1 within ``EXIT_BOUND_S``, the last stderr line
``python -m gateway serve: error: cannot start tenancy: <reason>``, no traceback, the password never printed,
no backend started (tenancy is checked before the model loads), and no default key announced (a start that
fails does not show a key it will not show again).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from plugins.gateway_server import ROOT, free_port

EXIT_BOUND_S = 15.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["postgresql", "redis"])
def test_unreachable_store_at_start_is_one_line(tmp_path, which):
    port = free_port()  # nothing listens there
    where = (
        ["--db", f"postgresql://gw:s3cret@127.0.0.1:{port}/gw"]
        if which == "postgresql"
        else ["--db", str(tmp_path / "t.sqlite"), "--redis-url", f"redis://:s3cret@127.0.0.1:{port}/0"]
    )
    cmd = [sys.executable, "-m", "gateway", "serve", "--port", str(free_port()), *where]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=EXIT_BOUND_S + 30, env=os.environ.copy()
    )
    took = time.monotonic() - t0
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert took < EXIT_BOUND_S, took
    assert err and err[-1].startswith("python -m gateway serve: error: cannot start tenancy: "), err[-3:]
    assert "Traceback" not in proc.stderr and "s3cret" not in proc.stderr + proc.stdout
    assert "backend ready" not in proc.stderr and "created tenant" not in proc.stderr
