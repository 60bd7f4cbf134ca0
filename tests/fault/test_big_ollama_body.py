"""A 400 MB chunked body to the Ollama API is refused early, in bounded memory (real gateway, psutil).

``/api/chat`` once read its whole body with ``request.json()``: a 400 MB chunked body was accepted and the
gateway's RSS went from 287 MB to 3 GB. Now the body is counted while read (``max_body_bytes``, 4 MiB by
default): the gateway answers 413 ``request_too_large``, drains at most 64 MiB more so that the client can
read it, then closes the connection, and its RSS grows by at most 64 MB. The body is generated lazily here:
the test process never holds it.
"""

from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest

MB = 1000 * 1000
TOTAL = 400 * MB  # bytes the client would send
RSS_BOUND = 64 * 1024 * 1024  # bytes the gateway's RSS may grow by
CHUNK = 256 * 1024


class Peak:
    """The highest RSS (bytes) of a process, sampled every 10 ms in a thread."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.01)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


@pytest.mark.timeout(120)
def test_400mb_chunked_ollama_body_is_refused_in_bounded_memory(gateway):
    proc = gateway.proc
    baseline = psutil.Process(proc.pid).memory_info().rss
    sent = 0

    def body():
        nonlocal sent
        head = b'{"model": "%s", "messages": [{"role": "user", "content": "' % gateway.model.encode()
        sent += len(head)
        yield head
        chunk = b"a" * CHUNK
        while sent < TOTAL:
            sent += len(chunk)
            yield chunk
        yield b'"}]}'

    hdrs = {"Content-Type": "application/json", **gateway.headers()}  # a generator: chunked, no length
    t0 = time.monotonic()
    with Peak(proc.pid) as rss:
        try:
            r = httpx.post(gateway.base_url + "/api/chat", content=body(), headers=hdrs, timeout=60)
            outcome: object = r
        except httpx.TransportError as exc:  # cut off while still writing, after the drain: allowed
            outcome = exc
    took = time.monotonic() - t0
    grew = rss.peak - baseline
    assert grew <= RSS_BOUND, f"gateway RSS grew by {grew / 2**20:.0f} MiB"
    assert sent < TOTAL / 2, f"the gateway read {sent / MB:.0f} MB of a body over its limit"
    if isinstance(outcome, httpx.Response):
        assert outcome.status_code == 413, outcome.text[:300]
        assert outcome.json()["code"] == "request_too_large"
    assert took < 30, took
    # the gateway is fine afterwards: another request is answered at once
    assert httpx.get(gateway.base_url + "/api/tags", headers=gateway.headers(), timeout=10).status_code == 200
