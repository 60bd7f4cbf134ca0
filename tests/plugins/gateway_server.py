"""Pytest fixtures that run a real gateway (``python -m gateway serve``) with a real backend process.

* ``gateway`` (session scope): ONE gateway subprocess on a free loopback port, spawned backend with the
  default model in float32 with int4 weights, admin key, temp tenancy DB, 1 s SSE heartbeats. Most gateway tests share it.
* ``make_gateway`` (function scope factory): a private gateway for tests that break it (crash test);
  stopped at the end of the test.

Every gateway started here runs its backend with ``--dtype float32 --weights int4`` unless the caller passes
another ``dtype`` (``None``: the served default mode, ``backend.model_path.default_dtype()`` with ``--weights
auto``) or ``weights``: float32 activations with every row through the row-invariant int4 kernel give the
same bits on every x86 ISA the kernels build for, are invariant to batching and prefix caching (which the
tests that repeat a seed or run requests side by side rely on) and decode ~2.5x faster than the exact mode
(``weights="dense"``: logits within 1e-3 of the reference), whose greedy text they follow up to the
reference's first near tie (``reference_prefix``).

``GatewayProc`` gives the base URL, the admin key, the API key to use (a tenant key created through the
admin API when tenancy is wired in, else a dummy), the served model name, and helpers: ``stats()``
(GET /admin/v1/stats), ``wait_idle()``, ``openai()`` (official client), ``log_tail()``.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = float(os.environ.get("GATEWAY_TEST_STARTUP_TIMEOUT", "300"))  # seconds (slow shared CI)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class GatewayProc:
    proc: subprocess.Popen
    port: int
    admin_key: str
    log_path: Path
    tmpdir: str
    api_key: str = "sk-test-no-tenancy"
    model: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stats(self) -> dict:
        """GET /admin/v1/stats on a kept-alive connection (a fresh client costs tens of ms: polls stay fast)."""
        with self.extra.setdefault("_lock", threading.Lock()):
            client = self.extra.get("_client")
            if client is None:
                client = self.extra["_client"] = httpx.Client(timeout=30)
            r = client.get(self.base_url + "/admin/v1/stats", headers=self.admin_headers())
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 30.0, baseline_kv: int | None = None) -> dict:
        """Poll stats until running == waiting == 0 (and kv_blocks_used <= baseline_kv if given)."""
        deadline = time.monotonic() + timeout
        st = self.stats()
        while time.monotonic() < deadline:
            if (
                st["running"] == 0
                and st["waiting"] == 0
                and (baseline_kv is None or st["kv_blocks_used"] <= baseline_kv)
            ):
                return st
            time.sleep(0.05)
            st = self.stats()
        return st

    def openai(self, **kw):
        import openai

        return openai.OpenAI(
            base_url=self.base_url + "/v1",
            api_key=self.api_key,
            max_retries=0,
            timeout=kw.pop("timeout", 300),
            **kw,
        )

    def backend_pid(self) -> int | None:
        return self.stats()["backends"][0]["pid"]

    def stop(self) -> None:
        client = self.extra.pop("_client", None)
        if client is not None:
            client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _setup_tenancy(gp: GatewayProc) -> None:
    """If the tenancy admin API is served, create a tenant (no limits) and an API key for the tests."""
    A = gp.admin_headers()
    r = httpx.post(
        gp.base_url + "/admin/v1/tenants",
        json={"name": "gateway-tests-" + os.urandom(4).hex()},
        headers=A,
        timeout=30,
    )
    if r.status_code == 404:
        return  # tenancy not wired: no auth, the dummy key is ignored
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    r = httpx.post(
        gp.base_url + f"/admin/v1/tenants/{tid}/keys", json={"name": "tests"}, headers=A, timeout=30
    )
    assert r.status_code == 201, r.text
    gp.api_key = r.json()["key"]
    gp.extra["tenant_id"] = tid


def _die_with_pytest() -> None:
    """In the child: SIGTERM us when pytest dies (a killed test run must not leave gateways behind)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _limit_files(nofile: int) -> Callable[[], None]:
    """A ``preexec_fn``: ``_die_with_pytest``, and soft and hard ``RLIMIT_NOFILE`` set to ``nofile``."""

    def preexec() -> None:
        _die_with_pytest()
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    return preexec


def start_gateway(
    *extra_args: str,
    heartbeat: float = 1.0,
    env: dict | None = None,
    dtype: str | None = "float32",
    weights: str = "int4",
    nofile: int | None = None,
) -> GatewayProc:
    """Start ``python -m gateway serve`` on a free port and wait until /readyz is 200.

    ``dtype`` is passed as ``--dtype`` and ``weights`` as ``--weights`` (``dtype=None``: neither, the served
    default mode). ``nofile``: the process's
    open-file limit, soft and hard (so the gateway cannot raise it), else the test run's.

    Raises:
        RuntimeError: the process exited or did not become ready within STARTUP_TIMEOUT seconds.
    """
    tmp = tempfile.mkdtemp(prefix="gw-test-")
    port = free_port()
    admin_key = "adm-" + os.urandom(8).hex()
    log_path = Path(tmp) / "gateway.log"
    cmd = [
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--admin-key",
        admin_key,
        "--db",
        str(Path(tmp) / "tenancy.sqlite"),
        "--sse-heartbeat",
        str(heartbeat),
        *(["--dtype", dtype] if dtype else []),
        *(["--weights", weights] if dtype else []),
        *extra_args,
    ]
    logf = open(log_path, "wb")
    proc = subprocess.Popen(
        cmd,
        cwd=str(ROOT),
        stdout=logf,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
        preexec_fn=_die_with_pytest if nofile is None else _limit_files(nofile),
    )
    gp = GatewayProc(proc=proc, port=port, admin_key=admin_key, log_path=log_path, tmpdir=tmp)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}:\n{gp.log_tail()}")
        try:
            if httpx.get(gp.base_url + "/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            gp.stop()
            raise RuntimeError(f"gateway not ready after {STARTUP_TIMEOUT}s:\n{gp.log_tail()}")
        time.sleep(0.2)
    _setup_tenancy(gp)
    models = httpx.get(gp.base_url + "/v1/models", headers=gp.headers(), timeout=10).json()
    gp.model = models["data"][0]["id"]
    return gp


#: the reference's top-2 logit gap under which a float32 run through the int4 kernel may pick the other token
#: (int8 activations: logits ~0.4 from the exact mode, at most ~1.4; tests/unit/backend/test_q4_gemm.py)
NEAR_TIE_INT4 = 0.2


def reference_prefix(case: dict, near_tie: float = NEAR_TIE_INT4) -> list[int]:
    """A fixture chat's reference greedy ids before the first step whose top-2 gap is under ``near_tie``."""
    out = []
    for tok, gap in zip(case["greedy_ids"], case["greedy_top2_gap"]):
        if gap < near_tie:
            break
        out.append(tok)
    return out


@pytest.fixture(scope="session")
def gateway():
    gp = start_gateway()
    try:
        yield gp
    finally:
        gp.stop()


@pytest.fixture
def make_gateway():
    started: list[GatewayProc] = []

    def make(*args: str, **kw) -> GatewayProc:
        gp = start_gateway(*args, **kw)
        started.append(gp)
        return gp

    try:
        yield make
    finally:
        for gp in started:
            gp.stop()


# ----------------------------------------------------------------------------- request helpers


@dataclass
class StreamResult:
    status: int
    headers: dict
    events: list  # decoded JSON of each `data:` event (the [DONE] marker excluded)
    done: bool  # `data: [DONE]` seen
    pings: int  # `:` comment lines
    body: bytes = b""  # the raw body when the status is not 200

    def content(self, index: int = 0) -> str:
        return "".join(
            (c["delta"].get("content") or "")
            for e in self.events
            for c in e.get("choices", [])
            if c["index"] == index
        )

    def finish_reasons(self, index: int = 0) -> list:
        return [c["finish_reason"] for e in self.events for c in e.get("choices", []) if c["index"] == index]


def post_json(gp: GatewayProc, path: str, body: dict | bytes, timeout: float = 300, **kw) -> httpx.Response:
    import json as _json

    data = body if isinstance(body, bytes) else _json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **gp.headers(), **kw.pop("headers", {})}
    return httpx.post(gp.base_url + path, content=data, headers=headers, timeout=timeout, **kw)


def stream_post(gp: GatewayProc, path: str, body: dict, timeout: float = 300) -> StreamResult:
    """POST with ``stream: true`` and collect the SSE events."""
    import json as _json

    body = {**body, "stream": True}
    events, pings, done = [], 0, False
    with httpx.stream("POST", gp.base_url + path, json=body, headers=gp.headers(), timeout=timeout) as r:
        if r.status_code != 200:
            return StreamResult(r.status_code, dict(r.headers), [], False, 0, r.read())
        for line in r.iter_lines():
            if line.startswith(":"):
                pings += 1
            elif line.startswith("data: "):
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                else:
                    assert not done, "event after [DONE]"
                    events.append(_json.loads(payload))
        return StreamResult(r.status_code, dict(r.headers), events, done, pings)


def chat_body(
    gp: GatewayProc, content: str | list | None = None, *, messages: list | None = None, **kw
) -> dict:
    msgs = messages if messages is not None else [{"role": "user", "content": content}]
    return {"model": gp.model, "messages": msgs, **kw}
