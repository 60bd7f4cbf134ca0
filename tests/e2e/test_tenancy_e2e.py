"""End-to-end tenancy through the real gateway (``python -m gateway serve`` + backend, shared fixture).

Skipped while the gateway does not serve the tenancy admin API yet.
"""

from __future__ import annotations

import json

import httpx
import pytest
import trio
from plugins.redis_server import start_redis

pytestmark = pytest.mark.slow


def _tenancy_wired(gp) -> bool:
    r = httpx.get(gp.base_url + "/admin/v1/tenants", headers=gp.admin_headers(), timeout=30)
    return r.status_code == 200


@pytest.fixture
def gw(gateway):
    if not _tenancy_wired(gateway):
        pytest.skip("gateway does not serve the tenancy admin API yet")
    return gateway


def new_tenant(gp, name: str, **limits) -> tuple[dict, str]:
    import os

    A = gp.admin_headers()
    r = httpx.post(
        gp.base_url + "/admin/v1/tenants",
        json={"name": f"{name}-{os.urandom(4).hex()}", "limits": limits},
        headers=A,
        timeout=30,
    )
    assert r.status_code == 201, r.text
    t = r.json()
    r = httpx.post(
        gp.base_url + f"/admin/v1/tenants/{t['id']}/keys", json={"name": "e2e"}, headers=A, timeout=30
    )
    assert r.status_code == 201, r.text
    return t, r.json()["key"]


def chat(
    gp, key: str | None, *, max_tokens: int = 1, path: str = "/v1/chat/completions", **kw
) -> httpx.Response:
    h = {"authorization": f"Bearer {key}"} if key else {}
    body = {
        "model": gp.model,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": max_tokens,
        **kw,
    }
    return httpx.post(gp.base_url + path, json=body, headers=h, timeout=300)


def test_e2e_auth_and_admin_security(gw):
    t, key = new_tenant(gw, "sec")
    r = chat(gw, key)
    assert r.status_code == 200, r.text
    for path in (
        "/v1/chat/completions",
        "/v1/chat/completions/",
        "/chat/completions",
        "/v1/models",
        "/v1/nope",
        "/healthz/../v1/chat/completions",
    ):
        for k in (None, "sk-gw-wrong-key"):
            r = chat(gw, k, path=path)
            assert r.status_code == 401, (path, k, r.status_code, r.text[:200])
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and "message" in err and "code" in err
    r = chat(gw, key, path=f"/v1/chat/completions?api_key={key}")
    assert r.status_code == 401
    for path in ("/admin/v1/tenants", f"/admin/v1/tenants/{t['id']}/usage", "/admin/v1/stats"):
        r = httpx.get(gw.base_url + path, headers={"authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 403, (path, r.status_code)
        r = httpx.get(gw.base_url + path, timeout=30)
        assert r.status_code == 401, (path, r.status_code)
    # revoke -> 401 at once
    keys = httpx.get(
        gw.base_url + f"/admin/v1/tenants/{t['id']}/keys", headers=gw.admin_headers(), timeout=30
    ).json()
    kid = keys["data"][0]["id"]
    assert (
        httpx.delete(
            gw.base_url + f"/admin/v1/keys/{kid}", headers=gw.admin_headers(), timeout=30
        ).status_code
        == 200
    )
    r = chat(gw, key)
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]
    # the keys used here never reach the gateway's log
    log = gw.log_path.read_text(errors="replace")
    assert key not in log and gw.admin_key not in log


async def test_e2e_rpm_exact_with_headers(gw):
    t, key = new_tenant(gw, "rpm", rpm=10, window_s=3600)
    codes: list[int] = []
    limited: list[httpx.Response] = []
    ok: list[httpx.Response] = []
    body = {"model": gw.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    async with httpx.AsyncClient(
        base_url=gw.base_url, timeout=300, limits=httpx.Limits(max_connections=60)
    ) as c:

        async def one():
            r = await c.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
            codes.append(r.status_code)
            (limited if r.status_code == 429 else ok).append(r)

        async with trio.open_nursery() as n:
            for _ in range(50):
                n.start_soon(one)
    assert codes.count(200) == 10 and codes.count(429) == 40, codes
    for r in limited:
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(r.headers["retry-after"]) >= 1 and int(r.headers["retry-after-ms"]) >= 1
        assert (
            r.headers["x-ratelimit-limit-requests"] == "10"
            and r.headers["x-ratelimit-remaining-requests"] == "0"
        )
    assert all(r.headers.get("x-ratelimit-limit-requests") == "10" for r in ok)
    # raise the limit: passes at once (PATCH changes the limits it names; PUT takes the whole object)
    httpx.patch(
        gw.base_url + f"/admin/v1/tenants/{t['id']}/limits",
        json={"rpm": 20, "window_s": 3600},
        headers=gw.admin_headers(),
        timeout=30,
    ).raise_for_status()
    assert chat(gw, key).status_code == 200


def test_e2e_cancelled_stream_gives_back_its_reservation(gw):
    t, key = new_tenant(gw, "cancel", tpm=5000, window_s=36000)
    body = {
        "model": gw.model,
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 1500,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        gw.base_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=300,
    ) as r:
        assert r.status_code == 200
        reserved_remaining = r.headers.get("x-ratelimit-remaining-tokens")
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break  # first token seen: the client goes away
    if reserved_remaining is not None:
        assert int(reserved_remaining) <= 5000 - 1500
    gw.wait_idle()
    # the next request's headers show the unused part of the 1500 came back
    r = chat(gw, key, max_tokens=1)
    assert r.status_code == 200
    remaining = int(r.headers["x-ratelimit-remaining-tokens"])
    assert remaining >= 5000 - 400, remaining  # without the true-up it would be < 3500
    # the aborted request is in the ledger with the tokens it did generate
    u = httpx.get(
        gw.base_url + f"/admin/v1/tenants/{t['id']}/usage", headers=gw.admin_headers(), timeout=30
    ).json()
    assert u["totals"]["requests"] == 2
    assert 0 < u["totals"]["completion_tokens"] < 1500


def test_e2e_openapi_covers_admin_and_chat(gw):
    r = httpx.get(gw.base_url + "/openapi.json", timeout=30)
    assert r.status_code == 200
    paths = r.json()["paths"]
    assert "/v1/chat/completions" in paths and "/admin/v1/tenants/{tenant_id}/limits" in paths
    json.dumps(r.json())


# ----------------------------------------------------------------------------- several gateway processes


def _start_backend(tmp_path, model_path):
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    sock = str(tmp_path / "backend.sock")
    log = open(tmp_path / "backend.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "backend",
            "--model",
            model_path,
            "--listen",
            f"unix:{sock}",
            "--dtype",
            "float32",
            "--weights",
            "dense",
        ],
        cwd=str(Path(__file__).resolve().parents[2]),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((tmp_path / "backend.log").read_text(errors="replace")[-2000:])
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(sock)
            break
        except OSError:
            time.sleep(0.2)
    return proc, f"unix:{sock}"


def test_e2e_two_gateways_share_redis_limits_and_db_survives_restart(gw, make_gateway, tmp_path, model_path):
    """Two gateway processes (one shared backend, one SQLite DB, one Redis) admit exactly the limit in total;
    a revocation made through one applies in the other; a third process started on the same DB still has
    the usage and the revocation."""
    redis_proc, redis_url = start_redis(tmp_path)
    backend_proc, backend_url = _start_backend(tmp_path, model_path)
    db = str(tmp_path / "shared.sqlite")
    try:
        common = ("--backend-url", backend_url, "--redis-url", redis_url, "--db", db)
        g1 = make_gateway(*common)
        g2 = make_gateway(*common)
        t, key = new_tenant(g1, "shared", rpm=10, window_s=3600)
        _, key2 = new_tenant(g1, "other")
        body = {"model": g1.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        codes: list[int] = []

        async def burst():
            async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=60)) as c:

                async def one(g):
                    r = await c.post(
                        g.base_url + "/v1/chat/completions",
                        json=body,
                        headers={"authorization": f"Bearer {key}"},
                    )
                    codes.append(r.status_code)

                async with trio.open_nursery() as n:
                    for i in range(50):
                        n.start_soon(one, (g1, g2)[i % 2])

        trio.run(burst)
        assert codes.count(200) == 10 and codes.count(429) == 40, codes

        # revoke key2 through g1: g2 refuses it within its 1 s cache TTL
        assert chat(g2, key2).status_code == 200
        keys = httpx.get(g1.base_url + "/admin/v1/tenants", headers=g1.admin_headers(), timeout=30).json()[
            "data"
        ]
        other = [x for x in keys if x["name"].startswith("other-")][0]
        kid = httpx.get(
            g1.base_url + f"/admin/v1/tenants/{other['id']}/keys", headers=g1.admin_headers(), timeout=30
        ).json()["data"][0]["id"]
        assert (
            httpx.delete(
                g1.base_url + f"/admin/v1/keys/{kid}", headers=g1.admin_headers(), timeout=30
            ).status_code
            == 200
        )
        import time as _time

        _time.sleep(1.2)
        assert chat(g2, key2).status_code == 401

        # restart: the usage API flushes the ledger; then both processes are killed hard (a graceful stop would
        # also shut the shared backend down; graceful ledger flushing is tested in tests/unit/gateway/test_tenants.py) and
        # a new gateway process opens the same DB
        for g in (g1, g2):
            httpx.get(
                g.base_url + f"/admin/v1/tenants/{t['id']}/usage", headers=g.admin_headers(), timeout=30
            )
            g.proc.kill()
            g.proc.wait(10)
        g3 = make_gateway("--redis-url", redis_url, "--db", db, "--backend-url", backend_url)
        u = httpx.get(
            g3.base_url + f"/admin/v1/tenants/{t['id']}/usage", headers=g3.admin_headers(), timeout=30
        ).json()
        assert u["totals"]["requests"] == 10
        r = chat(g3, key2)
        assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]
        r = chat(g3, key)
        assert r.status_code == 429  # the shared window is still spent (state in Redis)
    finally:
        for p in (backend_proc, redis_proc):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except Exception:
                    p.kill()
