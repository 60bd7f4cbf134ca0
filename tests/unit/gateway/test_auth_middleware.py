"""The auth middleware over raw ASGI: path classification, one authentication per request, the principal and
the admin verdict in the scope, credentials in the URL refused and redacted."""

from __future__ import annotations

import json

import pytest

from gateway.middleware.auth import AuthMiddleware, classify_path, normalize_path
from gateway.tenants import Tenants


def test_path_classification():
    assert normalize_path("/v1/../admin//v1/./tenants/") == "/admin/v1/tenants/"
    for p in ("/", "/healthz", "/readyz", "/openapi.json", "/static/app.js"):
        assert classify_path(p) == "public", p
    for p in ("/admin/v1/tenants", "/v1/../admin/v1/tenants", "/ADMIN/v1/x", "//admin/v1/tenants"):
        assert classify_path(p) == "admin", p
    for p in (
        "/v1/chat/completions",
        "/v1/chat/completions/",
        "/chat/completions",
        "/nope",
        "/healthz/../v1/models",
        "/static/../v1/chat/completions",
        "/v1//chat/completions",
    ):
        assert classify_path(p) == "tenant", p
    assert classify_path("/v1/chat/completions", "OPTIONS") == "public"
    assert classify_path("/admin") == classify_path("/admin", "HEAD") == "public"  # the dashboard page
    assert classify_path("/admin", "POST") == classify_path("/admin", "TRACE") == "public"  # its route: 405
    for p, m in (
        ("/admin/", "GET"),
        ("/ADMIN", "GET"),
        ("//admin", "GET"),
        ("/v1/../admin", "GET"),
    ):
        assert classify_path(p, m) == "admin", (p, m)


@pytest.fixture
async def tenants(tmp_path):
    async with Tenants(str(tmp_path / "g.db"), admin_key="adm", announce=lambda s: None).running() as t:
        yield t


async def call(app, path: str, key: str | None = None, query: bytes = b"") -> tuple[int, dict, dict]:
    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "query_string": query,
        "headers": [(b"authorization", f"Bearer {key}".encode())] if key else [],
    }
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return (
        start["status"],
        {k.decode(): v.decode() for k, v in start["headers"]},
        {"scope": scope, "body": body},
    )


async def test_one_authentication_per_request(tenants):
    tn = await tenants.store.create_tenant("a")
    key, _ = await tenants.store.create_key(tn.id)
    seen: list[dict] = []

    async def app(scope, receive, send):
        seen.append(dict(scope.get("state", {})))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    lookups = 0
    real = tenants.authenticator.authenticate

    async def counting(*a, **kw):
        nonlocal lookups
        lookups += 1
        return await real(*a, **kw)

    tenants.authenticator.authenticate = counting
    mw = AuthMiddleware(app, tenants)
    status, _, _ = await call(mw, "/v1/models", key)
    assert status == 200 and lookups == 1 and seen[-1]["principal"].tenant_id == tn.id
    status, _, _ = await call(mw, "/admin/v1/tenants", "adm")
    assert status == 200 and seen[-1] == {"admin": True}
    status, _, _ = await call(mw, "/healthz")
    assert status == 200 and "principal" not in seen[-1] and lookups == 1  # public: no lookup at all
    for path, k, want in (("/v1/models", None, 401), ("/admin/v1/x", key, 403), ("/admin/v1/x", None, 401)):
        status, headers, out = await call(mw, path, k)
        assert status == want and headers["content-type"] == "application/json"
        assert set(json.loads(out["body"])["error"]) == {"message", "type", "param", "code"}
    assert len(seen) == 3  # refusals never reach the app


async def test_query_credentials_are_refused_and_redacted(tenants):
    async def app(scope, receive, send):
        raise AssertionError("not reached")

    mw = AuthMiddleware(app, tenants)
    for path in ("/healthz", "/v1/models", "/admin/v1/tenants"):
        status, headers, out = await call(mw, path, "adm", b"x=1&api_key=sk-gw-secret")
        assert status == 401 and "www-authenticate" not in headers
        assert out["scope"]["query_string"] == b"x=1&api_key=REDACTED"
        assert json.loads(out["body"])["error"]["message"].startswith("API keys are not accepted")
