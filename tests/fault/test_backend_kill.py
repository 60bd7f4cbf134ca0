"""kill -9 of the backend mid-stream, against a private gateway with its real backend process.

With ``N_STREAMS`` SSE streams and one non-stream request in flight (a tenant whose ``max_concurrent`` is
exactly that many), the backend (the gateway's child, found with psutil) is SIGKILLed:

* every stream ends with one error event (``server_error`` / ``backend_unavailable``) then ``[DONE]``
  within ``ERROR_BOUND_S`` of the kill; every event before it is a chunk;
* the non-stream request is answered 503 ``backend_unavailable`` within the same bound;
* service is back (a new request succeeds, on a new backend pid, ``restarts == 1``) within
  ``RECOVERY_BOUND_S`` of the kill;
* nothing is left held: engine running 0, waiting 0, KV blocks at the baseline, and the tenant's
  concurrency slots are all free again (``N_STREAMS + 1`` requests at once are admitted, no 429);
  ``http_requests_in_flight`` is back to the scrape itself;
* then SIGTERM with a stream in flight drains: the stream completes, exit 0, no child process left.

Also: SSE heartbeats while a prefill runs (50 ms pings). Bounds from the issue: an error event promptly
(< 2 s), service back in < 30 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from plugins.gateway_server import chat_body, post_json, stream_post

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
LONG = "Write a very long story about a dragon who learns to cook, with many chapters."
N_STREAMS = 4
ERROR_BOUND_S = 2.0
RECOVERY_BOUND_S = 30.0


class Stream(threading.Thread):
    """One SSE request read to its end; records the events, ``[DONE]``, and when the error event came."""

    def __init__(self, gw, body: dict) -> None:
        super().__init__(daemon=True)
        self.gw, self.body = gw, body
        self.status: int | None = None
        self.events: list[dict] = []
        self.done = False
        self.error_at: float | None = None

    def run(self) -> None:
        with httpx.Client(timeout=120) as client:
            with client.stream(
                "POST", self.gw.base_url + CHAT, json=self.body, headers=self.gw.headers()
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    assert not self.done, "event after [DONE]"
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error_at = time.monotonic()
                    self.events.append(event)

    def contents(self) -> int:
        return sum(1 for e in self.events for c in e.get("choices", []) if c["delta"].get("content"))


def in_flight_gauge(gw) -> float:
    """``gateway:http_requests_in_flight`` from /metrics (the scrape itself counts one)."""
    for line in httpx.get(gw.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("gateway:http_requests_in_flight "):
            return float(line.split()[-1])
    raise AssertionError("no http_requests_in_flight gauge")


@pytest.mark.timeout(240)
def test_backend_kill_mid_stream_then_recovery(fault_gateway):
    gw = fault_gateway("--backend-wait", "60", heartbeat=0.05)
    try:
        kill_mid_stream_then_recover(gw)
    finally:
        gw.stop()


def kill_mid_stream_then_recover(gw) -> None:
    # heartbeats: with 50 ms pings, a long prefill (several 512-token chunks) shows a ": ping" first
    res = stream_post(gw, CHAT, chat_body(gw, "Say hi. " * 400, max_tokens=2, temperature=0))  # ~1,600 tokens
    assert res.done and res.pings >= 1
    r = httpx.put(
        gw.base_url + f"/admin/v1/tenants/{gw.extra['tenant_id']}/limits",
        json={"rpm": None, "tpm": None, "max_concurrent": N_STREAMS + 1, "daily_tokens": None},
        headers=gw.admin_headers(),
        timeout=30,
    )
    assert r.status_code == 200, r.text
    base = gw.wait_idle(60)
    pid = gw.backend_pid()
    assert pid in [p.pid for p in psutil.Process(gw.proc.pid).children()]

    streams = [
        Stream(gw, chat_body(gw, LONG, max_tokens=2000, temperature=0.7, seed=i, stream=True))
        for i in range(N_STREAMS)
    ]
    plain: dict = {}

    def nonstream() -> None:
        plain["r"] = post_json(gw, CHAT, chat_body(gw, LONG, max_tokens=2000, temperature=0), timeout=120)
        plain["at"] = time.monotonic()

    t_plain = threading.Thread(target=nonstream, daemon=True)
    for s in streams:
        s.start()
    t_plain.start()
    deadline = time.monotonic() + 120
    while gw.stats()["running"] < N_STREAMS + 1 or any(s.contents() < 3 for s in streams):
        assert time.monotonic() < deadline, (gw.stats(), [s.contents() for s in streams])
        time.sleep(0.05)

    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for t in [*streams, t_plain]:
        t.join(60)
        assert not t.is_alive(), "a request hangs after the backend died"

    for s in streams:
        assert s.status == 200 and s.done, (s.status, s.events[-3:])
        err = s.events[-1].get("error")
        assert err and err["type"] == "server_error" and err["code"] == "backend_unavailable", s.events[-1]
        assert all("choices" in e for e in s.events[:-1])
        assert s.error_at - t_kill < ERROR_BOUND_S, s.error_at - t_kill
    r = plain["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable", r.text
    assert plain["at"] - t_kill < ERROR_BOUND_S, plain["at"] - t_kill

    # recovery: the next request waits for the restarted backend (--backend-wait) and succeeds
    r = post_json(gw, CHAT, chat_body(gw, "Say hi.", max_tokens=2, temperature=0), timeout=RECOVERY_BOUND_S)
    assert r.status_code == 200, r.text
    assert time.monotonic() - t_kill < RECOVERY_BOUND_S
    info = gw.stats()["backends"][0]
    assert info["restarts"] == 1 and info["pid"] != pid and info["state"] == "ready", info

    # nothing held: engine idle at the baseline, every concurrency slot free (no 429 for N_STREAMS + 1)
    st = gw.wait_idle(30, baseline_kv=base["kv_blocks_used"])
    assert st["running"] == 0 and st["waiting"] == 0 and st["kv_blocks_used"] <= base["kv_blocks_used"], st
    with httpx.Client(timeout=120) as client, contextlib.ExitStack() as held:
        statuses = []
        for i in range(N_STREAMS + 1):  # all held open at once: each needs a slot of its own
            body = chat_body(gw, LONG, max_tokens=2000, seed=i, stream=True)
            req = client.stream("POST", gw.base_url + CHAT, json=body, headers=gw.headers())
            statuses.append(held.enter_context(req).status_code)
        assert statuses == [200] * (N_STREAMS + 1), statuses
    st = gw.wait_idle(30, baseline_kv=base["kv_blocks_used"])  # the held streams were aborted on close
    assert st["running"] == 0 and st["kv_blocks_used"] <= base["kv_blocks_used"], st
    deadline = time.monotonic() + 10  # the held streams' handlers end once their abort is settled
    while (n := in_flight_gauge(gw)) > 1:  # the /metrics scrape itself
        assert time.monotonic() < deadline, n
        time.sleep(0.05)

    # graceful shutdown: an in-flight stream completes, then the process exits 0 and leaves no child
    children = psutil.Process(gw.proc.pid).children(recursive=True)
    last = Stream(gw, chat_body(gw, "Count to five.", max_tokens=32, ignore_eos=True, stream=True))
    last.start()
    deadline = time.monotonic() + 60
    while last.contents() < 1:  # generating, 31 tokens to go
        assert time.monotonic() < deadline and not last.done
        time.sleep(0.01)
    gw.proc.send_signal(signal.SIGTERM)
    last.join(60)
    assert last.status == 200 and last.done and last.error_at is None, last.events[-2:]
    finals = [c["finish_reason"] for e in last.events for c in e["choices"] if c["finish_reason"]]
    assert finals == ["length"], finals  # all 32 tokens: the drain let it finish
    assert gw.proc.wait(60) == 0
    time.sleep(0.2)
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
