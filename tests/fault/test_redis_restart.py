"""Redis, which holds the shared rate limits, stalls for a moment, restarts between two requests, then stops during traffic and comes
back on the same port. While it stalls a response that needs no admission is not held by its best-effort
``x-ratelimit-*`` headers. After a restart the very next requests pass (no pooled connection to the dead server is
used). While it is down every admitted route answers 503 ``rate_limiter_unavailable`` with ``retry-after`` at
once (never a 500, never a hang), a stream admitted before goes on to its end, the routes that need no
admission still answer. Once it is back service resumes and the limits are exact again, without restarting the
gateway (requests that reuse one ``x-request-id`` hold a slot each); the gateway logs no traceback.

One private gateway with ``--redis-url`` (tests/plugins/gateway_server.py) and one redis-server
(tests/plugins/redis_server.py), stopped with SIGTERM and started again on its port.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
import trio
from plugins.gateway_server import GatewayProc
from plugins.redis_server import redis_port, start_redis, stop_redis

pytestmark = pytest.mark.slow

MAX_CONCURRENT = 4
WARM_CONCURRENCY = 4  # requests at once before the restarts: the gateway pools several Redis connections
OUTAGE_ANSWER_S = 3.0  # a refused request answers within this while Redis is down (it is not waited for)


def new_tenant(g: GatewayProc, **limits: int) -> str:
    """The API key of a new tenant with ``limits``, created through ``g``'s admin API."""
    a = g.admin_headers()
    r = httpx.post(
        g.base_url + "/admin/v1/tenants",
        json={"name": "redis-" + os.urandom(4).hex(), "limits": limits},
        headers=a,
        timeout=30,
    )
    assert r.status_code == 201, r.text
    r = httpx.post(g.base_url + f"/admin/v1/tenants/{r.json()['id']}/keys", json={}, headers=a, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["key"]


def requests_of(g: GatewayProc) -> list[tuple[str, dict]]:
    """One request of each admitted API: chat (JSON and SSE), completions, Ollama chat and generate."""
    msgs = [{"role": "user", "content": "Say hi."}]
    return [
        ("/v1/chat/completions", {"model": g.model, "messages": msgs, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": g.model, "messages": msgs, "max_tokens": 1, "stream": True}),
        ("/v1/completions", {"model": g.model, "prompt": "Hello", "max_tokens": 1}),
        ("/api/chat", {"model": g.model, "messages": msgs, "stream": False, "options": {"num_predict": 1}}),
        ("/api/generate", {"model": g.model, "prompt": "Hello", "options": {"num_predict": 1}}),
    ]


def stream_body(g: GatewayProc, max_tokens: int) -> dict:
    return {
        "model": g.model,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


@pytest.mark.timeout(300)
async def test_redis_stopped_and_restarted_during_traffic(tmp_path, fault_gateway):
    redis_proc, redis_url = start_redis(tmp_path)
    g: GatewayProc | None = None
    try:
        g = fault_gateway("--redis-url", redis_url)
        key = new_tenant(g, rpm=100_000)  # a limit: every admission goes to Redis
        capped = {"authorization": f"Bearer {new_tenant(g, max_concurrent=MAX_CONCURRENT)}"}
        auth = {"authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(
            base_url=g.base_url, headers=auth, timeout=60, limits=httpx.Limits(max_connections=64)
        ) as c:
            # traffic, several requests at once: the gateway pools several Redis connections
            codes: list[int] = []

            async def post(path: str, body: dict) -> None:
                codes.append((await c.post(path, json=body)).status_code)

            async with trio.open_nursery() as nursery:
                for i in range(WARM_CONCURRENCY):
                    nursery.start_soon(post, *requests_of(g)[i % 5])
            assert codes == [200] * WARM_CONCURRENCY, codes

            # Redis stalls (SIGSTOP: it accepts connections, never answers): a response that needs no admission
            # is not held by its best-effort rate-limit headers
            redis_proc.send_signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                r = await c.get("/v1/models", timeout=OUTAGE_ANSWER_S + 5)
                assert r.status_code == 200 and time.monotonic() - t0 < OUTAGE_ANSWER_S
            finally:
                redis_proc.send_signal(signal.SIGCONT)

            # a quick restart between two requests: the next ones pass (no dead pooled connection is used)
            stop_redis(redis_proc)
            redis_proc, _ = start_redis(tmp_path, port=redis_port(redis_url))
            for path, body in requests_of(g)[:3]:
                r = await c.post(path, json=body)
                assert r.status_code == 200, (path, r.status_code, r.text[:300])

            # a stream admitted before the outage; Redis stops while it runs
            req = c.build_request("POST", "/v1/chat/completions", json=stream_body(g, 8))
            running = await c.send(req, stream=True)
            assert running.status_code == 200
            stop_redis(redis_proc)

            for path, body in requests_of(g):
                t0 = time.monotonic()
                r = await c.post(path, json=body)
                took = time.monotonic() - t0
                assert r.status_code == 503, (path, r.status_code, r.text[:300])
                error = r.json()["error"]  # Ollama's routes answer Ollama's shape: {"error": "<message>"}
                if path.startswith("/v1/"):
                    assert error["code"] == "rate_limiter_unavailable", (path, r.text[:300])
                else:
                    assert "rate limiter is unavailable" in error, (path, r.text[:300])
                assert int(r.headers["retry-after"]) >= 1, path
                assert took < OUTAGE_ANSWER_S, (path, took)
            t0 = time.monotonic()
            r = await c.get("/v1/models")  # no admission: served, its rate-limit headers left out
            assert r.status_code == 200 and time.monotonic() - t0 < OUTAGE_ANSWER_S
            r = await c.get("/healthz")
            assert r.status_code == 200

            # the stream admitted before the outage runs to its end
            events = [
                json.loads(line[6:])
                async for line in running.aiter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
            await running.aclose()
            assert events and events[-1]["choices"][0]["finish_reason"] == "length", events[-1:]

            # Redis back on its port: service resumes
            redis_proc, _ = start_redis(tmp_path, port=redis_port(redis_url))
            for path, body in requests_of(g):
                r = await c.post(path, json=body)
                assert r.status_code == 200, (path, r.status_code, r.text[:300])

            # and the concurrency limit is exact again, also for requests that reuse one x-request-id
            held = []
            capped["x-request-id"] = "one-id-for-all"
            for _ in range(MAX_CONCURRENT):
                req = c.build_request(
                    "POST", "/v1/chat/completions", json=stream_body(g, 500), headers=capped
                )
                held.append(await c.send(req, stream=True))
                assert held[-1].status_code == 200
            path, body = requests_of(g)[0]
            r = await c.post(path, json=body, headers=capped)
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text[:300]
            for s in held:
                await s.aclose()
        assert "Traceback" not in g.log_path.read_text(errors="replace"), g.log_tail(80)
    finally:
        if g is not None:
            g.stop()
        stop_redis(redis_proc)
