"""A tenancy store or Redis that cannot be reached at start: the gateway exits 1 at once with one line.

``python -m gateway serve --db postgresql://...`` (nothing listens) and ``--redis-url redis://...`` (nothing
listens): exit status 1 within ``EXIT_BOUND_S``, the last stderr line
``python -m gateway serve: error: cannot start tenancy: <reason>``, no traceback, the password never printed,
no backend started (tenancy is checked before the model loads), and no default key announced (a start that
fails does not show a key it will not show again). A ``--db`` that looks like a URL but is not PostgreSQL's
is a settings error (exit 2); a file that is not a SQLite database is one line; a first start whose model
cannot load leaves the store without a default tenant, so the key is shown by the first start that works.
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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["url", "not_a_database"])
def test_store_location_that_cannot_be_used_is_one_line(tmp_path, where):
    """A ``--db`` that looks like a URL but is not PostgreSQL's is a settings error (exit 2), not a SQLite file
    named ``mysql:/...``; a file that is not a SQLite database is one line (exit 1), not a traceback."""
    if where == "url":
        db, rc, start = "postgresq://gw@127.0.0.1:1/gw", 2, "python -m gateway serve: error: argument --db: "
    else:
        (tmp_path / "notes.db").write_text("not a database\n" * 100)
        db, rc = str(tmp_path / "notes.db"), 1
        start = "python -m gateway serve: error: cannot start tenancy: cannot open the tenancy store "
    cmd = [sys.executable, "-m", "gateway", "serve", "--port", str(free_port()), "--db", db]
    proc = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=EXIT_BOUND_S + 30)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == rc and err and err[-1].startswith(start), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not list(tmp_path.glob("postgresq*"))


@pytest.mark.timeout(90)
def test_first_start_that_fails_on_the_model_keeps_the_key_unshown(tmp_path):
    """A first start whose model cannot load creates no default tenant and shows no key: the next start that
    works shows it (the key is shown once, so a failed start must not spend it)."""
    import sqlite3

    db = tmp_path / "g.sqlite"
    empty = tmp_path / "empty_model"
    empty.mkdir()
    cmd = [sys.executable, "-m", "gateway", "serve", "--port", str(free_port()), "--db", str(db)]
    proc = subprocess.run(
        cmd + ["--model", str(empty)], cwd=str(ROOT), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and "cannot load model" in proc.stderr.strip().splitlines()[-1], proc.stderr[
        -2000:
    ]
    assert "created tenant" not in proc.stderr + proc.stdout and "sk-gw-" not in proc.stderr + proc.stdout
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM tenants").fetchone()[0] == 0
