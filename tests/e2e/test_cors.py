"""CORS middleware: preflight 204 without auth, CORS headers on 200/401/429/500, origin lists, and with the
gateway's route table an ``Allow`` of the route's methods only.

The wrapped app is a small real Starlette app whose middleware requires a bearer key (401 otherwise)
and whose routes raise the gateway's own errors; the middleware sits outside it, as in the gateway.
"""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from gateway.errors import APIError, RateLimited
from gateway.middleware.cors import EXPOSE_HEADERS, CORSMiddleware
from gateway.settings import load_settings


def _inner_app():
    async def ok(request):
        return PlainTextResponse(
            "ok", headers={"x-request-id": "req-1", "x-ratelimit-remaining-requests": "9"}
        )

    async def limited(request):
        raise RateLimited(
            "slow down", code="rate_limit_exceeded", headers={"retry-after": "2", "retry-after-ms": "1500"}
        )

    async def boom(request):
        raise RuntimeError("bug")

    async def on_api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    app = Starlette(
        routes=[
            Route("/v1/ok", ok, methods=["GET", "POST"]),
            Route("/v1/limited", limited),
            Route("/v1/boom", boom),
        ],
        exception_handlers={APIError: on_api_error},
    )

    async def auth(scope, receive, send):
        if scope["type"] == "http":
            hdrs = dict(scope["headers"])
            if hdrs.get(b"authorization") != b"Bearer good":
                resp = JSONResponse(
                    {
                        "error": {
                            "message": "Incorrect API key provided.",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": "invalid_api_key",
                        }
                    },
                    status_code=401,
                )
                await resp(scope, receive, send)
                return
        await app(scope, receive, send)

    return auth


def _client(**kw):
    app = CORSMiddleware(_inner_app(), **kw)
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://gw"
    )


PREFLIGHT = {
    "origin": "http://page.example:3000",
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization, content-type",
}


async def test_preflight_is_204_without_auth():
    async with _client() as c:
        r = await c.options("/v1/ok", headers=PREFLIGHT)
        assert r.status_code == 204 and r.content == b""
        assert r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        assert int(r.headers["access-control-max-age"]) > 0
        # even on a route that does not exist, and a bare OPTIONS
        r = await c.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 204
        assert (await c.options("/anything")).status_code == 204


@pytest.mark.parametrize("path,status", [("/v1/ok", 200), ("/v1/limited", 429), ("/v1/boom", 500)])
async def test_cors_headers_on_every_response(path, status):
    async with _client() as c:
        r = await c.get(path, headers={"origin": "http://page.example:3000", "authorization": "Bearer good"})
        assert r.status_code == status
        assert r.headers["access-control-allow-origin"] == "*"
        exposed = {h.strip() for h in r.headers["access-control-expose-headers"].split(",")}
        assert {
            "x-request-id",
            "retry-after",
            "retry-after-ms",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-tokens",
        } <= exposed
        assert set(EXPOSE_HEADERS) == exposed


async def test_401_carries_cors_headers():
    async with _client() as c:
        r = await c.post("/v1/ok", headers={"origin": "http://page.example:3000"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["access-control-allow-origin"] == "*"
        assert "x-request-id" in r.headers["access-control-expose-headers"]


async def test_origin_allowlist():
    async with _client(origins=["http://good.example", "http://127.0.0.1:9999/"]) as c:
        r = await c.get("/v1/ok", headers={"origin": "http://good.example", "authorization": "Bearer good"})
        assert (
            r.headers["access-control-allow-origin"] == "http://good.example"
            and "origin" in r.headers["vary"].lower()
        )
        r = await c.get("/v1/ok", headers={"origin": "http://127.0.0.1:9999", "authorization": "Bearer good"})
        assert r.headers["access-control-allow-origin"] == "http://127.0.0.1:9999"
        r = await c.get("/v1/ok", headers={"origin": "http://evil.example", "authorization": "Bearer good"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = await c.options("/v1/ok", headers={**PREFLIGHT, "origin": "http://evil.example"})
        assert r.status_code == 204 and "access-control-allow-origin" not in r.headers
        r = await c.options("/v1/ok", headers={**PREFLIGHT, "origin": "http://good.example"})
        assert r.headers["access-control-allow-origin"] == "http://good.example"


def test_origins_from_env():
    """``GATEWAY_CORS_ORIGINS`` (the old name of ``LLM_GATEWAY_CORS_ORIGINS``): comma-separated origins."""
    any_origin = CORSMiddleware(_inner_app(), origins=load_settings(["serve"], {})[0].http.cors_origins)
    assert any_origin.any_origin
    env = {"GATEWAY_CORS_ORIGINS": "http://a.example, http://b.example/"}
    listed = CORSMiddleware(_inner_app(), origins=load_settings(["serve"], env)[0].http.cors_origins)
    assert not listed.any_origin and listed.origins == {"http://a.example", "http://b.example"}


def _routed_client():
    """The CORS middleware with a route table (as the gateway builds it): /v1/ok serves GET and POST."""
    table = {"/v1/ok": frozenset({"GET", "HEAD", "POST"}), "/v1/limited": frozenset({"GET", "HEAD"})}
    app = CORSMiddleware(_inner_app(), methods_for=table.get)
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://gw"
    )


async def test_options_lists_only_the_route_methods():
    """With the route table, OPTIONS and a preflight list the methods of the route on that path (and OPTIONS),
    not every method the gateway serves (RFC 9110 section 9.3.7)."""
    async with _routed_client() as c:
        r = await c.options("/v1/ok")
        assert r.status_code == 204 and r.headers["allow"] == "GET, HEAD, POST, OPTIONS"
        r = await c.options("/v1/limited", headers=PREFLIGHT)
        assert r.status_code == 204 and r.headers["allow"] == "GET, HEAD, OPTIONS"
        assert r.headers["access-control-allow-methods"] == "GET, HEAD, OPTIONS"
        assert r.headers["access-control-allow-origin"] == "*"
        # a plain OPTIONS on a path no route has is a 404 with a code; a preflight there still answers
        r = await c.options("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_route"
        assert r.headers["access-control-allow-origin"] == "*"
        assert (await c.options("/v1/nothing", headers=PREFLIGHT)).status_code == 204
