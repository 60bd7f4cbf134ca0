"""Exact limits across the cluster: a tenant with rpm 10 and max_concurrent 3, hit by a burst of 100 requests
split across gateways A and B, gets exactly 10 admitted, never more than 3 running at once, and a correct 429
for every other request.

The burst: ``REQUESTS`` requests (streams of ``MAX_TOKENS`` tokens), half through each gateway, all sent at
once, each by a task of its own. A request refused for concurrency is sent again after what the 429's
``retry-after-ms`` says, plus up to half as much again (an honest client, with jitter), until it is admitted or refused for the rpm; so every request ends
as a 200 or an rpm 429, whatever the machine's speed. The tenant's window is long (``WINDOW_S``): what refills
during the burst is less than one request, so exactly ``RPM`` admissions is the only right count.

"Running at once" is measured server-side, twice, by a sampler thread every ``SAMPLE_S`` seconds during the
burst: the tenant's lease set in Redis (ZCARD: the admitted requests not yet released, as the limiter counts
them) and the shared backend's ``running + waiting`` sequences (``GET /admin/v1/stats`` on B: the requests
actually generating, whichever gateway admitted them; nothing else runs meanwhile). A gateway that admitted
without a lease would show in the second. The admitted count is checked three ways: the 200s the clients
read, the tenant's ledger rows (read from the database: one per response ``id``) and the rpm refusals.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest
import trio
from cluster_nodes import Cluster, chat

pytestmark = pytest.mark.slow

RPM = 10
MAX_CONCURRENT = 3
WINDOW_S = 3600.0  # rpm refill: one request per WINDOW_S / RPM = 360 s
REQUESTS = 100
MAX_TOKENS = 2  # an admitted request runs a while (a stream of a few tokens): slots are held, then freed
SAMPLE_S = 0.005


class Sampler:
    """Samples, in two threads, the tenant's live leases in Redis and the backend's sequences (through B's
    admin stats, the slower read); keeps the maxima and the sample counts."""

    def __init__(self, cluster: Cluster, tenant_id: str) -> None:
        self.cluster, self.tenant_id = cluster, tenant_id
        self.max_leases = self.max_sequences = self.lease_samples = self.stats_samples = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._leases, self._sequences)]

    def _leases(self) -> None:
        while not self._stop.is_set():
            self.max_leases = max(self.max_leases, self.cluster.lease_count(self.tenant_id))
            self.lease_samples += 1
            time.sleep(SAMPLE_S)

    def _sequences(self) -> None:
        b = self.cluster.node("B")
        while not self._stop.is_set():
            st = b.stats()
            self.max_sequences = max(self.max_sequences, st["running"] + st["waiting"])
            self.stats_samples += 1
            time.sleep(4 * SAMPLE_S)

    def __enter__(self) -> Sampler:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)


@pytest.mark.timeout(120, func_only=True)
async def test_burst_across_both_gateways_is_limited_exactly(cluster: Cluster):
    nodes = {name: cluster.node(name) for name in ("A", "B")}
    t = cluster.new_tenant("A", rpm=RPM, max_concurrent=MAX_CONCURRENT, window_s=WINDOW_S)
    await trio.to_thread.run_sync(nodes["B"].wait_idle)  # nothing else runs on the backend

    admitted: list[tuple[str, str]] = []  # (gateway, response id)
    refused: list[tuple[str, httpx.Response, dict]] = []  # (gateway, response, error body): every 429
    other: list[tuple[str, int, str]] = []

    async def one_request(c: httpx.AsyncClient, name: str) -> None:
        g = nodes[name]
        while True:
            req = c.build_request(
                "POST",
                g.base_url + "/v1/chat/completions",
                json=chat(g, MAX_TOKENS, stream=True),
                headers=t.headers,
            )
            r = await c.send(req, stream=True)
            try:
                if r.status_code == 200:
                    lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                    assert lines[-1] == "data: [DONE]", lines[-2:]
                    last = json.loads(lines[-2][6:])
                    assert last["choices"][0]["finish_reason"] == "length", last
                    admitted.append((name, last["id"]))
                    return
                body = await r.aread()
            finally:
                await r.aclose()
            if r.status_code != 429:
                other.append((name, r.status_code, body[:300].decode(errors="replace")))
                return
            error = json.loads(body)["error"]
            refused.append((name, r, error))
            if not error["message"].startswith("Too many concurrent requests"):
                return  # the rpm: final
            await trio.sleep(int(r.headers["retry-after-ms"]) / 1000 * random.uniform(1.0, 1.5))

    t0 = time.monotonic()
    with Sampler(cluster, t.tenant_id) as sampler:
        limits = httpx.Limits(max_connections=REQUESTS + 8)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            async with trio.open_nursery() as nursery:
                for i in range(REQUESTS):
                    nursery.start_soon(one_request, c, "AB"[i % 2])
    took = time.monotonic() - t0

    per_node = {n: sum(1 for m, _ in admitted if m == n) for n in nodes}
    conc = sum(1 for _, _, e in refused if e["message"].startswith("Too many concurrent"))
    print(
        f"burst of {REQUESTS} over {took:.2f}s: admitted {len(admitted)} {per_node}, 429 {len(refused)} "
        f"({conc} for concurrency, then sent again); most leases at once {sampler.max_leases}, most backend "
        f"sequences {sampler.max_sequences} ({sampler.lease_samples} and {sampler.stats_samples} samples)"
    )
    assert other == []
    assert len(admitted) + len(refused) - conc == REQUESTS
    assert len(admitted) == RPM, (per_node, len(refused))
    assert sampler.lease_samples > 20 and sampler.stats_samples > 5
    assert sampler.max_leases <= MAX_CONCURRENT
    assert sampler.max_sequences <= MAX_CONCURRENT
    assert sampler.max_leases == MAX_CONCURRENT  # the sampler saw the limit reached: it measures something

    # every 429 is OpenAI's: the code, the type, an integer retry-after (s) and retry-after-ms that fit
    # the dimension that refused (a slot: within the lease's 6 s; the rpm: the refill time of one request)
    rpm_refusals = 0
    for name, r, error in refused:
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests", error
        assert error["param"] is None
        retry_s, retry_ms = int(r.headers["retry-after"]), int(r.headers["retry-after-ms"])
        assert retry_s >= 1 and retry_s == max(1, -(-retry_ms // 1000)), r.headers
        if error["message"].startswith("Too many concurrent"):
            assert 0 < retry_ms <= 6000, (name, r.headers)
        else:
            assert "requests per 3600s (RPM): Limit 10, Used 10" in error["message"], error
            assert 0 < retry_ms <= WINDOW_S / RPM * 1000, (name, r.headers)
            rpm_refusals += 1
    assert rpm_refusals == REQUESTS - RPM

    # the ledger in the shared store holds exactly the admitted requests, from both gateways
    rows = await trio.to_thread.run_sync(lambda: cluster.usage(t.tenant_id, at_least=RPM))
    assert sorted(r["request_id"] for r in rows) == sorted(rid for _, rid in admitted)
    assert all(r["status"] == 200 and r["completion_tokens"] == MAX_TOKENS for r in rows), rows
