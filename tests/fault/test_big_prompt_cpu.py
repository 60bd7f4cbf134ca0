"""A tenant's huge prompt costs the others nothing and is refused before any work (real gateway, psutil).

Tenant A sends a 3.9 MB ``tools`` body and a 4 MiB prompt while tenant B streams. Before, only message
``content`` decided whether the template and tokenizer ran in a worker thread, so the tools were rendered on
the event loop (``/health`` and B's stream froze for 22 s), and the 4 MiB prompt was templated and fully
tokenized (7 CPU-seconds) before the context-length check and before admission. Now the size counts
everything rendered, a prompt whose characters alone cannot fit is refused before it is rendered
(``gateway.openai.prepare.check_fits``), and that happens after the request was counted against the
tenant's rpm: a tenant whose rpm is used up gets 429 for it, and a request refused for its size still counts.
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import psutil
import pytest

GAP_BOUND_S = 0.3  # B's largest inter-token gap and each /health while A's requests run
CPU_BOUND_S = 1.0  # gateway CPU (all its threads) for the refusal of a 4 MiB prompt
MIB = 1024 * 1024


def post(g, key: str, body: bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(g.base_url + "/v1/chat/completions", content=body, headers=headers, timeout=60)


def big_prompt(g) -> bytes:
    """A chat body whose one message is just under the 4 MiB body limit (a 4 MiB prompt)."""
    head = json.dumps({"model": g.model, "messages": [{"role": "user", "content": ""}]}).encode()
    return head.replace(b'""', b'"' + b"a" * (4 * MIB - len(head) - 64) + b'"')


def big_tools(g) -> bytes:
    tool = {"type": "function", "function": {"name": "f", "description": "word " * 780_000, "parameters": {}}}
    body = {"model": g.model, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    return json.dumps(body).encode()


def gateway_cpu(g) -> float:
    t = psutil.Process(g.proc.pid).cpu_times()
    return t.user + t.system


class Stream(threading.Thread):
    """Tenant B's stream: the arrival time of every content event."""

    def __init__(self, g) -> None:
        super().__init__(daemon=True)
        self.g = g
        self.times: list[float] = []
        self.started = threading.Event()
        self.status = 0

    def run(self) -> None:
        body = {
            "model": self.g.model,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 80,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", self.g.base_url + "/v1/chat/completions", json=body, headers=self.g.headers(), timeout=120
        ) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    self.times.append(time.monotonic())
                    if len(self.times) == 3:
                        self.started.set()
        self.started.set()


def test_big_tools_and_prompt_do_not_stall_others_and_are_refused_cheaply(borrow_gateway):
    a, b = borrow_gateway(), borrow_gateway()
    try:
        tools, prompt = big_tools(a), big_prompt(a)
        assert len(tools) > 3_900_000 and len(prompt) > 4 * MIB - 100
        stream = Stream(b)
        stream.start()
        assert stream.started.wait(60), "B's stream did not start"
        t_a = time.monotonic()
        health: list[float] = []
        done = threading.Event()

        def poll() -> None:
            with httpx.Client(timeout=30) as c:
                while not done.is_set():
                    t = time.monotonic()
                    c.get(a.base_url + "/health")
                    health.append(time.monotonic() - t)
                    time.sleep(0.02)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        r = post(a, a.api_key, tools)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
        cpu = gateway_cpu(a)
        r = post(a, a.api_key, prompt)
        cpu = gateway_cpu(a) - cpu
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
        assert cpu < CPU_BOUND_S, f"the refusal of a 4 MiB prompt took {cpu:.2f} s of gateway CPU"
        t_end = time.monotonic()
        done.set()
        poller.join(30)
        stream.join(120)
        assert stream.status == 200
        gaps = [t1 - t0 for t0, t1 in zip(stream.times, stream.times[1:]) if t1 > t_a and t0 < t_end]
        assert gaps, "B's stream ended before A's requests"
        assert max(gaps) < GAP_BOUND_S, f"B's largest inter-token gap {max(gaps):.3f} s"
        assert health and max(health) < GAP_BOUND_S, f"/health took {max(health):.3f} s"
    finally:
        a.stop()
        b.stop()


def test_a_tenant_over_its_rpm_gets_429_not_400_after_the_work(borrow_gateway):
    g = borrow_gateway()
    try:
        admin = g.admin_headers()
        r = httpx.post(
            g.base_url + "/admin/v1/tenants",
            json={"name": "rpm-" + os.urandom(4).hex(), "limits": {"rpm": 1}},
            headers=admin,
            timeout=30,
        )
        assert r.status_code == 201, r.text
        r = httpx.post(
            g.base_url + f"/admin/v1/tenants/{r.json()['id']}/keys", json={"name": "k"}, headers=admin
        )
        key = r.json()["key"]
        prompt = big_prompt(g)
        r = post(g, key, prompt)  # the one request of the minute: refused for its size, and counted
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
        cpu = gateway_cpu(g)
        r = post(g, key, prompt)
        cpu = gateway_cpu(g) - cpu
        assert r.status_code == 429, r.text[:300]
        assert r.json()["error"]["type"] == "requests" and r.headers["x-ratelimit-remaining-requests"] == "0"
        assert cpu < CPU_BOUND_S, f"a 429 took {cpu:.2f} s of gateway CPU"
        small = json.dumps(
            {"model": g.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        )
        assert post(g, key, small.encode()).status_code == 429  # the refused request counted
    finally:
        g.stop()


pytestmark = pytest.mark.timeout(300)
