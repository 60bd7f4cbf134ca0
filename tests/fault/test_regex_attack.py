"""A tenant's catastrophic regex cannot stall the other tenants (nor ``/healthz``).

Tenant A configures the prompt blocklist patterns ``(a+)+$`` and ``!$`` through the admin API. With a
backtracking engine (Python ``re``) ``'a' * k + '!'`` costs about ``2**k`` steps on the event loop before
``!$`` matches (k = 23: a second or two, k = 30: minutes); with RE2 it is linear. Every prompt of A ends in
``!``, so each is blocked (400 ``content_filter``) and costs the backend nothing. Tenant B streams greedily
meanwhile and its inter-token latency (ITL: the gaps between its SSE content events) is measured on the client.

Like is compared with like, in the same stream: A sends one request at a time, ``PAUSE_S`` apart, in blocks
of ``BLOCK_S`` seconds that alternate a benign prompt (``'b' * k + '!'``: ``(a+)+$`` fails at once) and the
attack (``'a' * k + '!'``) of the same lengths. Each of B's gaps is an attack sample when more than half of it
lies in an attack block, else a baseline sample; load from outside the test falls on both.

Bounds (the issue's): B's ITL p99 under attack at most 2x its baseline p99, and every ``/healthz`` that
overlaps an attack answers within 0.5 s. Round 1 attacks with k = 23 only, so that a backtracking gateway
fails it within seconds (each attack stalls it for a second or two); round 2 adds k = 30 and 100,000.
A round whose ITL bound fails on a loaded machine is measured once more (a backtracking gateway fails
every measurement).
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

import httpx
import pytest

PATTERNS = ["(a+)+$", "!$"]
STREAM_S = 2.5  # B streams at least this long per measurement (then disconnects)
STREAM_MAX_S = 20.0  # ... and at most this long, if it takes that long to get MIN_SAMPLES of each kind
MAX_TOKENS = 2048
PAUSE_S = 0.02  # between two of A's requests
BLOCK_S = 0.5  # A's benign and attack blocks alternate
HEALTH_EVERY_S = 0.05
HEALTH_LIMIT_S = 0.5
ITL_FACTOR = 2.0
MIN_SAMPLES = 8  # gaps per kind for a measurement to count
ROUNDS = [[23], [23, 30, 100_000]]  # attack lengths (before the '!') of round 1, round 2

pytestmark = pytest.mark.timeout(120)


def _tenant(gp, name: str, filters: dict | None = None) -> str:
    """A new tenant (its filters PUT through the admin API) and its API key."""
    A = gp.admin_headers()
    r = httpx.post(
        gp.base_url + "/admin/v1/tenants",
        json={"name": f"{name}-{os.urandom(3).hex()}"},
        headers=A,
        timeout=30,
    )
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    if filters is not None:
        r = httpx.put(gp.base_url + f"/admin/v1/tenants/{tid}/filters", json=filters, headers=A, timeout=30)
        assert r.status_code == 200, r.text
    r = httpx.post(gp.base_url + f"/admin/v1/tenants/{tid}/keys", json={"name": name}, headers=A, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["key"]


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[98]


class _Load:
    """A's requests and the /healthz poller, on threads, until the block ends.

    Attributes:
        requests: ``(start, end, kind, status)`` of A's requests, kind ``"base"`` or ``"attack"``
            (status None: the client gave up), in blocks of BLOCK_S seconds per kind.
        health: ``(start, seconds)`` of each /healthz.
    """

    def __init__(self, gp, key: str, lengths: list[int]) -> None:
        self.gp, self.key, self.lengths = gp, key, lengths
        self.stop = threading.Event()
        self.requests: list[tuple[float, float, str, int | None]] = []
        self.health: list[tuple[float, float]] = []
        self.threads = [threading.Thread(target=self._send), threading.Thread(target=self._poll)]

    def __enter__(self) -> _Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _send(self) -> None:
        h = {"authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.gp.base_url, headers=h, timeout=60) as c:
            i, t_start = 0, time.monotonic()
            while not self.stop.is_set():
                kind = "attack" if int((time.monotonic() - t_start) / BLOCK_S) % 2 else "base"
                n = self.lengths[i % len(self.lengths)]
                i += 1
                prompt = ("a" if kind == "attack" else "b") * n + "!"
                body = {
                    "model": self.gp.model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 1,
                }
                t0 = time.monotonic()
                try:
                    status: int | None = c.post("/v1/chat/completions", json=body).status_code
                except httpx.HTTPError:
                    status = None
                self.requests.append((t0, time.monotonic(), kind, status))
                self.stop.wait(PAUSE_S)

    def _poll(self) -> None:
        with httpx.Client(base_url=self.gp.base_url, timeout=10) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    c.get("/healthz")
                except httpx.HTTPError:
                    pass
                self.health.append((t0, time.monotonic() - t0))
                self.stop.wait(HEALTH_EVERY_S)

    def attack_blocks(self) -> list[tuple[float, float]]:
        """``(first start, last end)`` of each run of consecutive attack requests (seconds, monotonic)."""
        blocks: list[list[float]] = []
        prev = "base"
        for s, e, k, _ in list(self.requests):
            if k == "attack":
                if prev == "attack":
                    blocks[-1][1] = e
                else:
                    blocks.append([s, e])
            prev = k
        return [(s, e) for s, e in blocks]

    def attacked(self, a: float, b: float, blocks: list[tuple[float, float]] | None = None) -> bool:
        """Whether the interval from ``a`` to ``b`` overlaps an attack block (a blocked attack request takes
        milliseconds, so a poll is compared with the block around it, not only with the requests in flight).
        ``blocks``: ``attack_blocks()`` when the caller already has them."""
        return any(s < b and e > a for s, e in (self.attack_blocks() if blocks is None else blocks))

    def stalled(self) -> bool:
        """A /healthz during an attack took HEALTH_LIMIT_S or more (the measurement has failed)."""
        blocks = self.attack_blocks()
        return any(
            lat >= HEALTH_LIMIT_S and self.attacked(t0, t0 + lat, blocks) for t0, lat in list(self.health)
        )

    def samples(self, arrivals: list[float]) -> dict[str, list[float]]:
        """B's gaps (seconds) from its second token on, by kind: ``attack`` when more than half of the gap
        lies in attack blocks (from a block's first attack request to the end of its last), else ``base``."""
        attacks = self.attack_blocks()
        gaps: dict[str, list[float]] = {"base": [], "attack": []}
        for a, b in zip(arrivals[1:], arrivals[2:]):
            under = sum(max(0.0, min(e, b) - max(s, a)) for s, e in attacks)
            gaps["attack" if under > (b - a) / 2 else "base"].append(b - a)
        return gaps


def _stream_arrivals(gp, key: str, load: _Load) -> list[float]:
    """B streams greedily for STREAM_S seconds (longer, up to STREAM_MAX_S, until each kind has MIN_SAMPLES
    gaps; shorter once the gateway is seen stalled); the arrival time of each content event."""
    body = {
        "model": gp.model,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals: list[float] = []
    h = {"authorization": f"Bearer {key}"}
    t0 = time.monotonic()
    with httpx.stream("POST", gp.base_url + "/v1/chat/completions", json=body, headers=h, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                if any(c["delta"].get("content") for c in ev.get("choices", [])):
                    arrivals.append(time.monotonic())
            now = time.monotonic()
            if (
                now > t0 + STREAM_MAX_S
                or (now > t0 + STREAM_S and min(map(len, load.samples(arrivals).values())) >= MIN_SAMPLES)
                or load.stalled()
            ):
                break  # disconnect: the gateway aborts the request
    return arrivals


def _measure(gp, key_a: str, key_b: str, lengths: list[int]) -> tuple[bool, str, _Load]:
    with _Load(gp, key_a, lengths) as load:
        time.sleep(0.2)  # A's load runs before B starts
        arrivals = _stream_arrivals(gp, key_b, load)
    gaps = load.samples(arrivals)
    blocks = load.attack_blocks()
    health = [lat for t0, lat in load.health if load.attacked(t0, t0 + lat, blocks)]
    base, attack = gaps["base"], gaps["attack"]
    statuses = sorted({s for *_, s in load.requests})
    detail = (
        f"attack lengths {lengths}: B's {len(arrivals)} tokens; ITL gaps {len(base)} baseline, {len(attack)} "
        f"attack; /healthz worst {max(health, default=0) * 1e3:.0f} ms over {len(health)} polls during "
        f"attacks; A's answers {statuses}"
    )
    assert health and max(health) < HEALTH_LIMIT_S, detail
    assert len(base) >= MIN_SAMPLES and len(attack) >= MIN_SAMPLES, detail
    b99, a99 = _p99(base), _p99(attack)
    detail += f"; ITL p99 {a99 * 1e3:.1f} ms under attack vs {b99 * 1e3:.1f} ms baseline (max {max(attack) * 1e3:.0f})"
    print(detail)
    assert statuses == [400], detail  # every prompt of A was blocked ("!$"), none timed out
    return a99 <= ITL_FACTOR * b99, detail, load


def test_catastrophic_regex_does_not_stall_other_tenants(borrow_gateway):
    gp = borrow_gateway()  # the shared fault gateway: the served default dtype (no text is compared)
    filters = {"hooks": [{"type": "blocklist", "patterns": PATTERNS, "stages": ["prompt"]}]}
    key_a = _tenant(gp, "regex-a", filters)
    key_b = _tenant(gp, "stream-b")
    r = httpx.post(
        gp.base_url + "/v1/chat/completions",
        json={"model": gp.model, "messages": [{"role": "user", "content": "b!"}], "max_tokens": 2},
        headers={"authorization": f"Bearer {key_a}"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "content_filter", r.text
    for lengths in ROUNDS:
        ok, detail, _ = _measure(gp, key_a, key_b, lengths)
        if not ok:
            ok, detail, _ = _measure(gp, key_a, key_b, lengths)
        assert ok, detail
