"""Upstream models (kind ``openai``) are bounded: a loop back to the gateway, an upstream that only sends
``: ping`` comments or streams past its deadline, and one that reports 2^64 tokens.

A front gateway (``start_gateway``, no backend of its own) serves only upstream models:

* ``loop``: its own listener, reached through a TCP relay in this process (as through a proxy or load
  balancer: the start-up check of ``urls`` cannot see it), with a valid API key of the gateway's own store
  (so each level would authenticate and nest again), so only the ``Via`` hop header can stop it;
* ``pings``: a stub that answers 200 and then only ``: ping`` comments for 30 s (``event_timeout = 1``);
* ``slow``: a stub that streams one token every 0.2 s for 30 s (``deadline = 2``);
* ``huge``: a stub whose answer reports ``completion_tokens`` = 2^64; ``ok``: a well-formed answer.

Measured: the loop costs the client one 508 (OpenAI's shape on /v1, Ollama's on /api) and the gateway two
requests; ``pings`` and ``slow`` end with 504 ``upstream_timeout`` within a few seconds, the stub sees its
connection closed, and the tenant's one concurrency slot is free at once; ``huge`` is a 502 and no 2^64
reaches the ledger, while another tenant's request of the same ledger batch is billed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from plugins.gateway_server import GatewayProc, start_gateway

from auth.sqlite_store import open_sqlite

EVENT_TIMEOUT = 1.0  # seconds: the ``pings`` model's
DEADLINE = 2.0  # seconds: the ``slow`` model's
LIMIT = 10.0  # seconds: each of them ends well within this on a loaded 2-core machine (the stubs go on 30 s)
pytestmark = pytest.mark.timeout(120)  # the gateway's start (the module's fixture) included


def _chunk(content: str | None = None, finish: str | None = None, usage: dict | None = None) -> bytes:
    choices = (
        [] if content is None else [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]
    )
    obj = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": choices}
    return b"data: " + json.dumps(obj | ({"usage": usage} if usage else {})).encode() + b"\n\n"


class Stub(BaseHTTPRequestHandler):
    """An OpenAI-compatible stub: what it streams is chosen by the request's model (see the module
    docstring); ``server.closed`` is set when the gateway closed the connection of a ``pings``/``slow``
    answer before its 30 s were over."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.vias.append(self.headers.get("via"))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        model = body["model"]
        if model in ("huge", "ok"):
            tokens = 2**64 if model == "huge" else 2
            usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": tokens + 5}
            for part in (_chunk("Hi"), _chunk(" there", "stop"), _chunk(usage=usage), b"data: [DONE]\n\n"):
                self.wfile.write(part)
            return
        t_end = time.monotonic() + 30
        try:
            while time.monotonic() < t_end:
                self.wfile.write(b": ping\n\n" if model == "pings" else _chunk("x"))
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:  # the gateway closed the upstream request
            self.server.closed.set()  # type: ignore[attr-defined]


class Relay:
    """A TCP relay on loopback to ``target`` (set once the gateway listens), as a proxy in front of it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.target: int | None = None
        self.requests = 0  # HTTP requests relayed to the gateway
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            assert self.target is not None
            out = socket.create_connection(("127.0.0.1", self.target))
            for a, b, count in ((conn, out, True), (out, conn, False)):
                threading.Thread(target=self._pump, args=(a, b, count), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(65536):
                self.requests += data.count(b"POST /v1/") if count else 0
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture(scope="module")
def front():
    stub = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    stub.daemon_threads = True
    stub.vias, stub.closed = [], threading.Event()  # type: ignore[attr-defined]
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    relay = Relay()
    fake = f"http://127.0.0.1:{stub.server_address[1]}/v1"

    def model(name: str, url: str, extra: str = "") -> str:
        return f'[[models]]\nname = "{name}"\nkind = "openai"\nurls = ["{url}"]\n{extra}\n'

    tmp = Path(tempfile.mkdtemp(prefix="gw-bounds-"))
    db = open_sqlite(str(tmp / "tenancy.sqlite"))  # a key made before the start, which the loop sends
    loop_key, _ = db.create_key(db.create_tenant("loop").id)
    db.db.close()
    cfg = tmp / "models.toml"
    cfg.write_text(
        model("loop", f"http://127.0.0.1:{relay.port}/v1", 'api_key_env = "LOOP_KEY"\n')
        + model("pings", fake, f"event_timeout = {EVENT_TIMEOUT}\n")
        + model("slow", fake, f"deadline = {DEADLINE}\n")
        + model("huge", fake)
        + model("ok", fake)
    )
    # the last --db wins: the store holding the loop's key (an authenticated loop nests until a limit)
    gp = start_gateway(
        "--config", str(cfg), "--db", str(tmp / "tenancy.sqlite"), env={"LOOP_KEY": loop_key}, dtype=None
    )
    relay.target = gp.port
    gp.extra.update(stub=stub, relay=relay)
    try:
        yield gp
    finally:
        gp.stop()
        relay.sock.close()
        stub.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _key(gp: GatewayProc, **limits) -> tuple[str, str]:
    """A new tenant (with ``limits``) and its API key: (tenant id, key)."""
    A, url = gp.admin_headers(), gp.base_url + "/admin/v1/tenants"
    t = httpx.post(url, json={"name": f"b-{os.urandom(4).hex()}", "limits": limits}, headers=A).json()
    k = httpx.post(f"{url}/{t['id']}/keys", json={}, headers=A).json()
    return t["id"], k["key"]


def _chat(gp: GatewayProc, key: str, model: str, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **kw}
    return httpx.post(gp.base_url + "/v1/chat/completions", json=body, headers=_auth(key), timeout=60)


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _answered(gp: GatewayProc, status: int) -> int:
    """Responses of ``status`` the gateway gave (``gateway:http_requests_total``, every path)."""
    text = httpx.get(gp.base_url + "/metrics", timeout=10).text
    pattern = rf'^gateway:http_requests_total\{{path="[^"]*",status="{status}"\}} (\S+)$'
    return int(sum(float(v) for v in re.findall(pattern, text, re.M)))


def test_an_upstream_that_leads_back_to_the_gateway_is_one_508(front):
    _, key = _key(front)
    relay = front.extra["relay"]
    before = _answered(front, 508)
    r = _chat(front, key, "loop")
    assert r.status_code == 508, r.text
    err = r.json()["error"]
    assert err["code"] == "loop_detected" and err["type"] == "server_error" and "loop" in err["message"]
    # two requests in all: the client's, and the one the gateway sent itself (refused on arrival)
    assert relay.requests == 1 and _answered(front, 508) - before == 2
    r = httpx.post(  # Ollama's API: its error shape
        front.base_url + "/api/chat",
        json={"model": "loop", "messages": [{"role": "user", "content": "Hi"}], "stream": False},
        headers=_auth(key),
        timeout=60,
    )
    assert r.status_code == 508 and isinstance(r.json()["error"], str) and r.json()["code"] == "loop_detected"
    assert relay.requests == 2 and _answered(front, 508) - before == 4  # the Ollama request's one hop
    assert _chat(front, key, "ok").status_code == 200
    via = front.extra["stub"].vias[-1]
    assert re.fullmatch(r"1\.1 llm-gateway-[0-9a-f]{12}", via), via  # the hop header every upstream gets


@pytest.mark.parametrize("model", ["pings", "slow"])
def test_an_upstream_that_only_pings_or_outlasts_its_deadline_ends_and_frees_the_slot(front, model):
    _, key = _key(front, max_concurrent=1)
    stub = front.extra["stub"]
    stub.closed.clear()
    t0 = time.monotonic()
    if model == "pings":
        r = _chat(front, key, model)
        took = time.monotonic() - t0
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "upstream_timeout"
        assert EVENT_TIMEOUT <= took < LIMIT
    else:  # streamed: the deadline cuts the stream with an error event
        with httpx.stream(
            "POST",
            front.base_url + "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "stream": True},
            headers=_auth(key),
            timeout=60,
        ) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        took = time.monotonic() - t0
        assert r.status_code == 200 and len(events) > 3  # tokens came, then the deadline
        error = json.loads(next(e[6:] for e in events if '"error"' in e))["error"]
        assert error["code"] == "upstream_timeout"
        assert DEADLINE <= took < LIMIT
    assert stub.closed.wait(LIMIT)  # the upstream request was closed, not left to run its 30 s
    r = _chat(front, key, "ok")  # the tenant's one concurrency slot is free again
    assert r.status_code == 200, r.text


def test_an_upstream_reporting_2_64_tokens_is_a_502_and_no_other_row_is_lost(front):
    bad_tenant, bad = _key(front)
    other_tenant, other = _key(front)
    results: dict[str, httpx.Response] = {}
    threads = [
        threading.Thread(target=lambda k=k, m=m: results.__setitem__(m, _chat(front, k, m)))
        for k, m in ((bad, "huge"), (other, "ok"))
    ]
    for t in threads:  # within one 0.5 s ledger batch
        t.start()
    for t in threads:
        t.join()
    assert results["huge"].status_code == 502, results["huge"].text
    assert "malformed" in results["huge"].json()["error"]["message"]
    assert results["ok"].status_code == 200
    A = front.admin_headers()
    usage = {
        tid: httpx.get(f"{front.base_url}/admin/v1/tenants/{tid}/usage", headers=A).json()["totals"]
        for tid in (bad_tenant, other_tenant)
    }
    assert usage[other_tenant]["requests"] == 1 and usage[other_tenant]["completion_tokens"] == 2
    assert usage[bad_tenant]["requests"] == 1 and usage[bad_tenant]["completion_tokens"] < 100
