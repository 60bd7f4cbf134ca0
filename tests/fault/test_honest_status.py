"""Honest status: a client that leaves is a 499 "abort", never a 5xx; a request that finished keeps its 200.

Real gateway (the shared one) and a tenant of this module's own, so that its usage-ledger rows (read
straight from the tenancy DB) are this module's only; the backend's ``generation_tokens`` counter
(``/admin/v1/stats``, before and after, nothing else running) says what was generated.

* A non-streaming request whose client disconnects mid-generation: access log status 499 with
  ``finish_reason`` "abort" (it was a 500), ``gateway:http_requests_total{status="499"}`` and no 500, the
  ledger row 499 "abort" billing every token generated.
* Requests that finished (non-stream, stream, and one ended by a stop string): ledger status 200 with their
  finish reason (every row said 499: the end of the response was taken for a client disconnect), and the
  tokens billed are the ones the backend generated.
"""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import openai
import pytest
from plugins.records import access_line, ledger_rows

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tenant(gateway) -> tuple[str, str]:
    """(tenant id, API key) of a tenant without limits, made for this module."""
    h = gateway.admin_headers()
    r = httpx.post(
        gateway.base_url + "/admin/v1/tenants", json={"name": "honest-" + os.urandom(4).hex()}, headers=h
    )
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    k = httpx.post(gateway.base_url + f"/admin/v1/tenants/{tid}/keys", json={"name": "honest"}, headers=h)
    assert k.status_code == 201, k.text
    return tid, k.json()["key"]


def counter(gp, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in /metrics whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(gp.base_url + "/metrics", timeout=10).text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def generated_since(gp, base: dict) -> int:
    st = gp.wait_idle(30)
    assert st["running"] == 0 and st["waiting"] == 0, st
    return st["generation_tokens"] - base["generation_tokens"]


@pytest.mark.timeout(90)
def test_non_stream_client_that_leaves_is_499_abort_not_500(gateway, tenant):
    tid, key = tenant
    base = gateway.wait_idle(60)
    n499 = counter(gateway, "gateway:http_requests_total", path=CHAT, status="499")
    n500 = counter(gateway, "gateway:http_requests_total", path=CHAT, status="500")
    aborts = counter(gateway, "gateway:request_success_total", finished_reason="abort")
    rid = "honest-leave-" + os.urandom(4).hex()
    payload = json.dumps(
        {
            "model": gateway.model,
            "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "max_tokens": 1500,
            "ignore_eos": True,
            "temperature": 0,
        }
    ).encode()
    s = socket.create_connection(("127.0.0.1", gateway.port))
    try:
        s.sendall(
            (
                f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {key}\r\nx-request-id: {rid}\r\nContent-Length: {len(payload)}\r\n\r\n"
            ).encode()
            + payload
        )
        deadline = time.monotonic() + 60
        while gateway.stats()["generation_tokens"] < base["generation_tokens"] + 3:  # mid-generation
            assert time.monotonic() < deadline, "the request did not start generating"
            time.sleep(0.05)
    finally:
        s.close()
    generated = generated_since(gateway, base)
    assert 3 <= generated < 1500
    line = access_line(gateway, rid)
    assert (line["status"], line["finish_reason"]) == (499, "abort"), line
    assert line["completion_tokens"] == generated, (line, generated)
    [row] = ledger_rows(gateway, tenant_id=tid)
    assert (row["status"], row["finish_reason"]) == (499, "abort"), row
    assert row["completion_tokens"] == generated, (row, generated)
    assert counter(gateway, "gateway:http_requests_total", path=CHAT, status="499") == n499 + 1
    assert counter(gateway, "gateway:http_requests_total", path=CHAT, status="500") == n500
    assert counter(gateway, "gateway:request_success_total", finished_reason="abort") == aborts + 1
    assert line.get("abort_reason") == "client_disconnect", line


@pytest.mark.timeout(90)
def test_finished_requests_keep_status_200_in_the_ledger(gateway, tenant):
    tid, key = tenant
    before = len(ledger_rows(gateway, tenant_id=tid, at_least=0, timeout=0))
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Name three colors."}]
    base = gateway.wait_idle(60)
    plain = client.chat.completions.create(model=gateway.model, messages=msgs, max_tokens=6, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=gateway.model,
            messages=msgs,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    stopped = client.chat.completions.create(
        model=gateway.model, messages=msgs, max_tokens=40, temperature=0, stop=[" "]
    )
    generated = generated_since(gateway, base)
    rows = {r["request_id"]: r for r in ledger_rows(gateway, tenant_id=tid, at_least=before + 3)[before:]}
    assert len(rows) == 3, rows
    stream_id, stream_usage = chunks[0].id, chunks[-1].usage
    assert stream_usage is not None
    for rid, usage, reason in (
        (plain.id, plain.usage, plain.choices[0].finish_reason),
        (stream_id, stream_usage, "length"),
    ):
        row = rows[rid]
        assert (row["status"], row["finish_reason"]) == (200, reason), row
        assert row["completion_tokens"] == usage.completion_tokens, (row, usage)
    assert stopped.choices[0].finish_reason == "stop"
    row = rows[stopped.id]
    assert (row["status"], row["finish_reason"]) == (200, "stop"), row
    # the stop string ended the choice in the gateway; tokens the backend made past it are billed too
    assert row["completion_tokens"] >= stopped.usage.completion_tokens
    assert sum(r["completion_tokens"] for r in rows.values()) == generated, (rows, generated)
