"""Request bodies that trickle in are cut off after ``http.body_timeout`` (real gateway, raw sockets).

Bodies had no read timeout: connections sending a byte a second were held open for good, each with a
handler waiting on it. Now a body must arrive within ``--body-timeout`` seconds of its headers, on every
route that reads one: the answer is 408 ``request_timeout`` and the connection is closed. A body that is
slow but in time is read as usual.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

BODY_TIMEOUT = 2.0  # seconds: conftest.SHARED_BODY_TIMEOUT, the shared fault gateway's --body-timeout
SLACK = 3.0  # seconds past the timeout by which every trickler must have its 408 (a shared 2-core machine)
TRICKLERS = 24


def in_flight(gp) -> float:
    for line in httpx.get(gp.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("gateway:http_requests_in_flight"):
            return float(line.split()[-1])
    raise AssertionError("no http_requests_in_flight gauge")


def head(gp, path: str, key: str, *, chunked: bool) -> bytes:
    framing = "Transfer-Encoding: chunked" if chunked else "Content-Length: 1000"
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\n{framing}\r\n\r\n"
    ).encode()


def trickle(gp, path: str, key: str, chunked: bool) -> tuple[float, bytes]:
    """Send the headers, then one body byte every 0.4 s until the server answers and closes. Returns the
    seconds from the headers to the close, and what was read."""
    s = socket.create_connection(("127.0.0.1", gp.port), timeout=BODY_TIMEOUT + SLACK + 5)
    stop = threading.Event()

    def writer() -> None:
        try:
            while not stop.is_set():
                s.sendall(b"1\r\n{\r\n" if chunked else b"{")
                time.sleep(0.4)
        except OSError:
            pass

    try:
        s.sendall(head(gp, path, key, chunked=chunked))
        t0 = time.monotonic()
        threading.Thread(target=writer, daemon=True).start()
        got = b""
        while True:
            try:
                part = s.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                break
            if not part:
                break
            got += part
        return time.monotonic() - t0, got
    finally:
        stop.set()
        s.close()


def parse(raw: bytes) -> tuple[int, dict[str, str], dict]:
    header, _, body = raw.partition(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return status, headers, json.loads(body)


@pytest.mark.timeout(120)
def test_trickled_bodies_get_408_and_are_closed(borrow_gateway):
    gp = borrow_gateway()  # the shared fault gateway runs with --body-timeout BODY_TIMEOUT
    base = in_flight(gp)
    routes = [
        ("/v1/chat/completions", gp.api_key, False),
        ("/v1/completions", gp.api_key, True),
        ("/api/chat", gp.api_key, True),
        ("/api/generate", gp.api_key, False),
        ("/admin/v1/tenants", gp.admin_key, False),
        ("/admin/v1/tenants", gp.admin_key, True),
    ]
    jobs = [routes[i % len(routes)] for i in range(TRICKLERS)]
    with ThreadPoolExecutor(TRICKLERS) as pool:
        results = list(pool.map(lambda job: (job, trickle(gp, *job)), jobs))
    for (path, _, chunked), (took, raw) in results:
        assert raw, (path, chunked, took, "no answer: the connection was held")
        status, headers, body = parse(raw)
        assert status == 408, (path, chunked, raw[:300])
        error = body["error"]
        code = body["code"] if path.startswith("/api/") else error["code"]
        assert code == "request_timeout", (path, body)
        assert headers.get("connection") == "close", headers
        assert BODY_TIMEOUT - 0.2 <= took <= BODY_TIMEOUT + SLACK, (path, chunked, took)
    deadline = time.monotonic() + 5
    while in_flight(gp) > base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert in_flight(gp) == base

    # a body slower than the network but within the timeout is read as usual
    body = json.dumps({"model": gp.model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    with socket.create_connection(("127.0.0.1", gp.port), timeout=30) as s:
        raw = body.encode()
        s.sendall(
            head(gp, "/v1/chat/completions", gp.api_key, chunked=False).replace(b"1000", b"%d" % len(raw))
        )
        for i in range(0, len(raw), len(raw) // 4 + 1):
            s.sendall(raw[i : i + len(raw) // 4 + 1])
            time.sleep(BODY_TIMEOUT / 8)
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
