"""A streaming client that stops reading: generation stops early, and every token generated is billed.

Real gateway (the fault suite's shared one, ``borrow_gateway``: a tenant of its own, and a small token
backlog through ``LLM_GATEWAY_MAX_BACKLOG_TOKENS``) and raw sockets whose receive buffer is shrunk
before connecting (``SO_RCVBUF`` 4096 bytes), so that the gateway's writes block as soon as the kernel
buffers are full. Each chunk carries 20 top logprobs (about 2 KB), so those buffers fill after a few dozen
tokens and the test needs few tokens: it ends as soon as the backend stops, or fails as soon as it
generated more than the bound without stopping.

What must hold (docs/gateway.md "Slow readers", docs/observability.md):

* the backend stops after at most about ``max_backlog_tokens`` per choice beyond what the socket buffers
  hold, far below ``max_tokens``, within a bounded time (the request is aborted, not paused);
* the usage ledger bills exactly the tokens the backend generated for the request (the backend's own
  ``generation_tokens`` counter, read before and after through ``/admin/v1/stats``, with no other traffic
  on this gateway), although the client received fewer;
* the request is recorded as a client abort: ledger status 499 with ``finish_reason`` "abort", the access
  log's ``abort_reason`` "slow_reader", ``gateway:request_aborts_total{reason="slow_reader"}``; no 5xx.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from plugins.records import access_line, ledger_rows

BACKLOG = 16  # tokens per choice: conftest.SHARED_BACKLOG (the default is 256; smaller keeps the test short)
MAX_TOKENS = 1500
SLACK = 64  # tokens per choice the loopback socket buffers hold (chunks of ~2 KB: ~10-15 measured), and more
SEND_TIMEOUT = 5.0  # seconds: conftest.SHARED_SEND_TIMEOUT, the shared fault gateway's --send-timeout
DEADLINE_S = 90.0  # only a safety net: on 2 idle cores the request stops within seconds


@pytest.fixture(scope="module")
def gw(borrow_gateway):
    gp = borrow_gateway()  # the shared fault gateway runs with --max-backlog-tokens BACKLOG
    try:
        yield gp
    finally:
        gp.stop()


def open_stream(gp, body: dict, rid: str) -> socket.socket:
    """POST ``body`` on a raw socket whose receive buffer is 4 KiB, and read nothing."""
    data = json.dumps(body).encode()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", gp.port))
    s.sendall(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {gp.api_key}\r\nx-request-id: {rid}\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        + data
    )
    return s


def wait_stopped(gp, base: dict, limit: int) -> int:
    """Wait until the request generated and left the engine; the tokens generated (backend counter).
    Fails once more than ``limit`` tokens were generated while the request still runs."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        st = gp.stats()
        gen = st["generation_tokens"] - base["generation_tokens"]
        if gen > 0 and st["running"] == 0 and st["waiting"] == 0:
            return gen
        assert gen <= limit, f"generation goes on while the client reads nothing: {gen} tokens, still running"
        assert time.monotonic() < deadline, f"the request still runs after {DEADLINE_S} s ({gen} tokens)"
        time.sleep(0.05)


def aborts(gp, reason: str) -> float:
    total = 0.0
    for line in httpx.get(gp.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("gateway:request_aborts_total{") and f'reason="{reason}"' in line:
            total += float(line.split()[-1])
    return total


def body(gp, n: int = 1) -> dict:
    return {
        "model": gp.model,
        "messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "n": n,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
    }


@pytest.mark.timeout(120)
def test_reader_that_stops_then_leaves_is_stopped_and_billed_exactly(gw):
    base = gw.wait_idle(60)
    aborts_before = aborts(gw, "slow_reader")
    since = time.time()
    s = open_stream(gw, body(gw), "slow-reader-1")
    try:
        generated = wait_stopped(gw, base, BACKLOG + SLACK)
        print(f"slow reader: {generated} tokens generated (backlog {BACKLOG}, max_tokens {MAX_TOKENS})")
    finally:
        s.close()  # leaves with the response unread
    rows = ledger_rows(gw, tenant_id=gw.extra["tenant_id"], since=since)
    assert len(rows) == 1, rows
    row = rows[0]
    assert row["completion_tokens"] == generated, (row, generated)  # exactly what the backend generated
    assert row["total_tokens"] == row["prompt_tokens"] + generated
    assert (row["status"], row["finish_reason"]) == (499, "abort"), row
    line = access_line(gw, "slow-reader-1")
    assert line["finish_reason"] == "abort" and line["abort_reason"] == "slow_reader", line
    assert line["completion_tokens"] == generated and line["status"] < 500, line
    assert aborts(gw, "slow_reader") == aborts_before + 1
    st = gw.wait_idle(10, baseline_kv=base["kv_blocks_used"])
    assert st["kv_blocks_used"] <= base["kv_blocks_used"], st


@pytest.mark.timeout(120)
def test_reader_that_stops_then_resumes_gets_an_error_and_n_choices_are_billed(gw):
    """n = 2: each choice is stopped after its backlog and both are billed in full; a client that reads on
    gets what was generated before the stop, then one ``slow_consumer`` error event and ``[DONE]``."""
    base = gw.wait_idle(60)
    since = time.time()
    s = open_stream(gw, body(gw, n=2), "slow-reader-2")
    try:
        generated = wait_stopped(gw, base, 2 * (BACKLOG + SLACK))
        print(f"slow reader, n=2: {generated} tokens generated")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # a 4 KiB window reads ~10 KB/s
        s.settimeout(20)
        raw = b""
        while b"data: [DONE]" not in raw:
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    finally:
        s.close()
    events = [
        json.loads(line[6:])
        for line in raw.decode("utf-8", "replace").split("\n")
        if line.startswith("data: {")
    ]
    errors = [e["error"] for e in events if "error" in e]
    assert [e["code"] for e in errors] == ["slow_consumer"], events[-3:]
    received = sum(1 for e in events for c in e.get("choices", []) if c["delta"].get("content"))
    rows = ledger_rows(gw, tenant_id=gw.extra["tenant_id"], since=since)
    assert len(rows) == 1, rows
    row = rows[0]
    assert row["completion_tokens"] == generated > received, (row, generated, received)
    assert (row["status"], row["finish_reason"]) == (499, "abort"), row
    line = access_line(gw, "slow-reader-2")
    assert line["abort_reason"] == "slow_reader" and line["error_code"] == "slow_consumer", line


@pytest.mark.timeout(120)
def test_reader_that_stops_and_stays_loses_its_connection_and_gives_back_its_slot(gw):
    """A client that stops reading and neither reads on nor closes: once generation stopped, the kernel drops
    the connection after the send timeout (``--send-timeout``, TCP_USER_TIMEOUT), so the request ends (ledger
    row 499 ``abort``) and gives back its concurrency slot while the client still holds its socket."""
    tid, A = gw.extra["tenant_id"], gw.admin_headers()
    url = gw.base_url + f"/admin/v1/tenants/{tid}/limits"
    one = {"rpm": None, "tpm": None, "max_concurrent": 1, "daily_tokens": None}
    assert httpx.put(url, json=one, headers=A, timeout=30).status_code == 200
    base = gw.wait_idle(60)
    since = time.time()
    s = open_stream(gw, body(gw), "slow-reader-3")
    try:
        generated = wait_stopped(gw, base, BACKLOG + SLACK)
        rows = ledger_rows(gw, tenant_id=gw.extra["tenant_id"], since=since, timeout=SEND_TIMEOUT + 15)
        assert len(rows) == 1, "the request still holds its slot while its client neither reads nor leaves"
        assert (rows[0]["status"], rows[0]["finish_reason"]) == (499, "abort"), rows[0]
        assert rows[0]["completion_tokens"] == generated, (rows[0], generated)
        r = httpx.post(
            gw.base_url + "/v1/chat/completions",
            json={"model": gw.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
            headers=gw.headers(),
            timeout=30,
        )
        assert r.status_code == 200, r.text  # max_concurrent 1: the slot was given back
    finally:
        s.close()
        httpx.put(url, json={**one, "max_concurrent": None}, headers=A, timeout=30)
