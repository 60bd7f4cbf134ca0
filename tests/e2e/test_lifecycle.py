"""Gateway lifecycle against a real server + backend: client disconnects (abort within a step, KV blocks
freed), 64 concurrent streams. A backend killed mid-stream (error events, recovery, heartbeats, graceful
shutdown) is tests/fault/test_backend_kill.py.

``GATEWAY_TEST_ABORT_DEADLINE`` (seconds, default 2) bounds how long after a disconnect the engine must be
back at its baseline (running 0, KV blocks back); raise it only on a machine far slower than 2 cores.
"""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import pytest
import trio
from plugins.gateway_server import chat_body

CHAT = "/v1/chat/completions"
ABORT_DEADLINE = float(os.environ.get("GATEWAY_TEST_ABORT_DEADLINE", "2"))
LONG = "Write a very long story about a dragon who learns to cook, with many chapters."


def _wait_back(gw, baseline_kv: int, aborts_before: int) -> dict:
    t0 = time.monotonic()
    st = gw.stats()
    while time.monotonic() - t0 < ABORT_DEADLINE:
        if st["running"] == 0 and st["waiting"] == 0 and st["kv_blocks_used"] <= baseline_kv:
            break
        time.sleep(0.05)
        st = gw.stats()
    assert st["running"] == 0 and st["waiting"] == 0, st
    assert st["kv_blocks_used"] <= baseline_kv, st
    assert st["aborts"] > aborts_before
    return st


def test_disconnect_aborts_streaming_request(gateway):
    base = gateway.wait_idle(120)
    body = chat_body(gateway, LONG, max_tokens=2000, temperature=0, stream=True)
    with httpx.Client(timeout=300) as client:
        with client.stream("POST", gateway.base_url + CHAT, json=body, headers=gateway.headers()) as r:
            assert r.status_code == 200
            contents = 0
            lines = r.iter_lines()  # keep a reference: a collected iterator closes the connection
            for line in lines:
                if line.startswith("data: ") and '"content":"' in line and '"role"' not in line:
                    contents += 1
                    if contents >= 3:
                        break
            mid = gateway.stats()
            assert mid["running"] == 1 and mid["kv_blocks_used"] > base["kv_blocks_used"]
        # leaving both blocks closes the TCP connection with the body unread
    st = _wait_back(gateway, base["kv_blocks_used"], base["aborts"])
    assert st["generation_tokens"] - base["generation_tokens"] < 2000


def test_disconnect_aborts_non_streaming_request(gateway):
    base = gateway.wait_idle(120)
    payload = json.dumps(chat_body(gateway, LONG, max_tokens=2000, temperature=0)).encode()
    req = (
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {gateway.api_key}\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    s = socket.create_connection(("127.0.0.1", gateway.port))
    s.sendall(req)
    deadline = time.monotonic() + 120
    while True:  # wait until the request generates
        st = gateway.stats()
        if st["running"] == 1 and st["generation_tokens"] > base["generation_tokens"] + 2:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.1)
    s.close()
    st = _wait_back(gateway, base["kv_blocks_used"], base["aborts"])
    assert st["generation_tokens"] - base["generation_tokens"] < 2000


@pytest.mark.timeout(900)
async def test_64_concurrent_streams(gateway):
    prompts = [
        "Hi.",
        "Name a color.",
        "What is 2+2?",
        "Say something nice.",
        "Tell me a fact about the moon, please.",
        "Count to three.",
        "Write one word.",
        "Describe the sea " * 5,
    ]
    results: list = [None] * 64

    async def one(i: int, client: httpx.AsyncClient) -> None:
        body = chat_body(
            gateway,
            prompts[i % len(prompts)],
            max_tokens=6,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
        )
        events, done = [], False
        async with client.stream("POST", gateway.base_url + CHAT, json=body, headers=gateway.headers()) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    if line == "data: [DONE]":
                        done = True
                    else:
                        assert not done
                        events.append(json.loads(line[6:]))
        results[i] = (events, done)

    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async with trio.open_nursery() as nursery:
            for i in range(64):
                nursery.start_soon(one, i, client)
    ids = set()
    for events, done in results:
        assert done
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        finals = [c for e in events for c in e["choices"] if c["finish_reason"] is not None]
        assert len(finals) == 1 and finals[0]["finish_reason"] in ("stop", "length")
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] >= 1
        assert len({e["id"] for e in events}) == 1
        ids.add(events[0]["id"])
        assert all(c["index"] == 0 for e in events for c in e["choices"])
    assert len(ids) == 64
    assert gateway.wait_idle(60)["running"] == 0
