"""What a test gateway recorded, read back: its usage ledger and its access-log lines.

The ledger is read straight from the gateway's tenancy SQLite file (read-only), not through the admin API, so
that a test of billing does not depend on the code it checks. Both helpers poll: rows and lines are written
after the response ends (the ledger in batches).
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import httpx
from plugins.gateway_server import GatewayProc


def ledger_rows(
    gp: GatewayProc,
    *,
    tenant_id: str | None = None,
    since: float | None = None,
    at_least: int = 1,
    timeout: float = 15.0,
    flush: bool = False,
) -> list[dict]:
    """The usage-ledger rows of ``gp``'s database, oldest first: ``tenant_id``'s only and/or those written at or
    after ``since`` (UNIX seconds), once there are at least ``at_least`` (after ``timeout`` seconds: what there
    is). ``flush``: ask ``GET /v1/usage`` with ``gp``'s key before each read, which writes the queued rows."""
    path = Path(gp.tmpdir) / "tenancy.sqlite"
    where = [w for w, v in (("tenant_id = ?", tenant_id), ("ts >= ?", since)) if v is not None]
    args = [v for v in (tenant_id, since) if v is not None]
    sql = "SELECT * FROM usage" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id"
    deadline = time.monotonic() + timeout
    while True:
        if flush:
            httpx.get(gp.base_url + "/v1/usage", headers=gp.headers(), timeout=30)
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        con.row_factory = sqlite3.Row
        try:
            rows = [dict(r) for r in con.execute(sql, args)]
        finally:
            con.close()
        if len(rows) >= at_least or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def access_line(gp: GatewayProc, request_id: str, timeout: float = 15.0) -> dict:
    """The JSON access-log line of ``request_id`` in ``gp``'s log. Fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        for line in gp.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and f'"request_id":"{request_id}"' in line:
                return json.loads(line)
        assert time.monotonic() < deadline, f"no access-log line for {request_id}:\n{gp.log_tail()}"
        time.sleep(0.1)
