"""A 413 decided on Content-Length leaves nothing stuck (real gateway, real clients).

httpx, hence the OpenAI SDK, writes the whole request body before it reads the response. A 413 answered
without reading the body left such a client blocked on a full socket and the server-side request in flight
for good: hypercorn's queue of body messages filled, and its ``http.disconnect`` at the end of the response
blocked the response's last send. SIGTERM then waited the whole drain timeout. Now the rest of a refused body
is drained before the 413 ends, or read while it ends (gateway.middleware.body), and a drain stops when the
server begins to stop.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest

CHAT = "/v1/chat/completions"
MIB = 1024 * 1024
EAGER = 6  # raw clients per check, started EAGER_GAP seconds apart
EAGER_GAP = 0.5


def in_flight(gp) -> float:
    """``gateway:http_requests_in_flight`` from /metrics (the scrape itself counts one)."""
    for line in httpx.get(gp.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("gateway:http_requests_in_flight"):
            return float(line.split()[-1])
    raise AssertionError("no http_requests_in_flight gauge")


def wait_in_flight(gp, pred, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    n = in_flight(gp)
    while not pred(n) and time.monotonic() < deadline:
        time.sleep(0.05)
        n = in_flight(gp)
    return n


def chat_json(gp, size: int) -> bytes:
    head = b'{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": "' % gp.model.encode()
    return head + b"a" * size + b'"}]}'


class EagerClient:
    """A raw HTTP/1.1 client that writes the headers and the first ``first`` body bytes in one go, before the
    server reads any, and reads nothing until asked: as httpx does, which writes its whole body before it
    reads (here the rest of the body is never sent)."""

    def __init__(self, gp, length: int, first: int) -> None:
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {gp.api_key}\r\nContent-Length: {length}\r\n\r\n"
        ).encode()
        self.sock = socket.create_connection(("127.0.0.1", gp.port), timeout=30)
        self.data = head + b"a" * first
        self.thread = threading.Thread(target=self._write, daemon=True)
        self.thread.start()

    def _write(self) -> None:
        try:
            self.sock.sendall(self.data)
        except OSError:
            pass

    def read(self, timeout: float) -> bytes:
        """What the server sent within ``timeout`` seconds or until it closed."""
        self.sock.settimeout(timeout)
        got = b""
        try:
            while b"\r\n\r\n" not in got or not got.endswith(b"}"):
                part = self.sock.recv(65536)
                if not part:
                    break
                got += part
        except OSError:
            pass
        return got

    def close(self) -> None:
        self.sock.close()


def start_eager(gp) -> list[EagerClient]:
    """EAGER clients announcing 48 MiB over the limit (within what is drained, 64 MiB) with 8 MiB written,
    started EAGER_GAP seconds apart; none reads yet."""
    started = []
    for _ in range(EAGER):
        started.append(EagerClient(gp, 48 * MIB, 8 * MIB))
        time.sleep(EAGER_GAP)
    return started


@pytest.mark.timeout(60)
def test_clients_writing_the_whole_body_read_their_413(gateway):
    """Clients that send an announced body over the 4 MiB limit before they read get their 413
    ``request_too_large``: raw ones whose first 8 MiB are in the socket before the server reads (whether the
    server's queue of body messages is full when the 413 ends is a race: EAGER of them, started apart), httpx
    and the OpenAI SDK. Then no request is left in flight."""
    eager = start_eager(gateway)
    try:
        for e in eager:
            answer = e.read(10)
            assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
            assert b"request_too_large" in answer
    finally:
        for e in eager:
            e.close()
    hdrs = {"Content-Type": "application/json", **gateway.headers()}
    for path, size in ((CHAT, 8 * MIB), (CHAT, 48 * MIB), ("/api/chat", 8 * MIB)):
        t0 = time.monotonic()
        r = httpx.post(gateway.base_url + path, content=chat_json(gateway, size), headers=hdrs, timeout=10)
        assert r.status_code == 413, r.text[:300]
        assert "request_too_large" in r.text
        assert time.monotonic() - t0 < 10
    client = gateway.openai(timeout=10)
    with pytest.raises(openai.APIStatusError) as ei:
        client.chat.completions.create(
            model=gateway.model, messages=[{"role": "user", "content": "a" * (8 * MIB)}], max_tokens=1
        )
    assert ei.value.status_code == 413 and ei.value.code == "request_too_large"
    assert wait_in_flight(gateway, lambda n: n <= 1, 5) == 1  # the scrape alone


@pytest.mark.timeout(90)
def test_sigterm_with_a_413_client_in_flight_exits_within_the_drain(make_gateway, gateway):
    """A client still writing an announced oversized body when SIGTERM comes does not hold the shutdown:
    the gateway exits in under 5 s (its drain timeout is 30 s). The gateway stopped is a second client of the
    session gateway's backend (``--backend-url``: no model load of its own), which it must leave running: a
    backend reached by URL was not started by it."""
    backend = gateway.stats()["backends"][0]
    gp = make_gateway("--max-body-bytes", "65536", "--backend-url", backend["url"])
    # 48 MiB announced, within what is drained (64 MiB), 8 MiB written: the rest is still to come at the SIGTERM
    eager = start_eager(gp)
    try:
        assert wait_in_flight(gp, lambda n: n >= 2, 10) >= 2  # refused requests and the scrape
        time.sleep(0.5)
        t0 = time.monotonic()
        gp.proc.send_signal(signal.SIGTERM)
        try:
            rc = gp.proc.wait(20)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        print(f"SIGTERM with {EAGER} refused bodies being drained: exited in {took:.2f} s (rc {rc})")
        assert rc is not None and took < 5.0, (rc, took, gp.log_tail(20))
        assert rc == 0, gp.log_tail(20)
        for e in eager:
            answer = e.read(5)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 413"), answer[:200]
        # the shared backend lives on and still serves the gateway that started it
        assert gateway.stats()["backends"][0]["pid"] == backend["pid"]
        r = httpx.post(
            gateway.base_url + "/v1/chat/completions",
            json={"model": gateway.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
            headers=gateway.headers(),
            timeout=30,
        )
        assert r.status_code == 200, r.text
    finally:
        for e in eager:
            e.close()
