"""Every client error carries a code, methods are honest, and admin replacements need a body (real gateway).

* A battery of bad requests to /v1/chat/completions, /v1/completions, /api/chat, /api/generate, /api/show, the
  admin API, /v1/usage and unknown routes: each is a 4xx whose error has a non-empty string ``code`` (OpenAI's
  ``{"error": {"message", "type", "param", "code"}}``; Ollama's ``{"error": message, "type", "code"}`` under
  ``/api/``). ``messages: []``, stop limits and role errors used to answer ``code: null``.
* ``OPTIONS`` lists the methods of the route on that path only (``Allow``), ``TRACE`` and unknown methods
  get 405 ``method_not_allowed`` with ``Allow`` (RFC 9110 sections 9.3.7 and 15.5.6) instead of a 404; a
  CORS preflight still answers 204.
* ``PUT .../limits`` and ``PUT .../filters`` with no body are 400 and change nothing (an empty PUT used to
  remove every limit, or disable the filters).
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

CHAT = "/v1/chat/completions"


def user(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


def bad_requests(gp) -> list[tuple[str, str, object, int]]:
    """(method, path, JSON body or raw bytes or None, expected status), all with the tenant key."""
    m = gp.model
    chat = {"model": m, "messages": user(), "max_tokens": 1}
    return [
        ("POST", CHAT, {"model": m, "messages": []}, 400),
        ("POST", CHAT, {"model": m, "messages": [{"role": "bogus", "content": "x"}]}, 400),
        ("POST", CHAT, {"model": m, "messages": [{"role": "user"}]}, 400),
        ("POST", CHAT, {"model": m, "messages": [{"content": "x"}]}, 400),
        ("POST", CHAT, {"model": m, "messages": "hi"}, 400),
        ("POST", CHAT, {**chat, "stop": ["x" * 1000]}, 400),
        ("POST", CHAT, {**chat, "stop": [str(i) for i in range(40)]}, 400),
        ("POST", CHAT, {**chat, "stop": 5}, 400),
        ("POST", CHAT, {**chat, "n": 0}, 400),
        ("POST", CHAT, {**chat, "temperature": 9}, 400),
        ("POST", CHAT, {**chat, "max_tokens": -1}, 400),
        ("POST", CHAT, {**chat, "bogus_field": 1}, 400),
        ("POST", CHAT, {**chat, "tools": "x"}, 400),
        ("POST", CHAT, {"messages": user()}, 400),
        ("POST", CHAT, {"model": "no-such-model", "messages": user()}, 404),
        ("POST", CHAT, b"{", 400),
        ("POST", CHAT, b"", 400),
        ("POST", CHAT, b"[1, 2]", 400),
        ("POST", "/v1/completions", {"model": m, "prompt": ""}, 400),
        ("POST", "/v1/completions", {"model": m, "prompt": []}, 400),
        ("POST", "/v1/completions", {"model": m, "prompt": "x", "stop": [1]}, 400),
        ("POST", "/v1/completions", {"model": m, "prompt": "x", "stop": ["y" * 1000]}, 400),
        ("POST", "/v1/completions", {"model": m, "prompt": "x", "echo": True}, 400),
        ("POST", "/v1/completions", {"model": m, "prompt": "x", "logprobs": 50}, 400),
        ("POST", "/v1/completions", {"model": m}, 400),
        ("POST", "/api/chat", {"model": m, "messages": "x"}, 400),
        ("POST", "/api/chat", {"messages": user()}, 400),
        ("POST", "/api/chat", [1], 400),
        ("POST", "/api/chat", {"model": m, "messages": user(), "options": {"stop": [1]}}, 400),
        ("POST", "/api/chat", {"model": m, "messages": user(), "options": "x"}, 400),
        ("POST", "/api/chat", {"model": m, "messages": user(), "options": {"temperature": "hot"}}, 400),
        ("POST", "/api/chat", {"model": m, "messages": [{"role": "bogus", "content": "x"}]}, 400),
        ("POST", "/api/chat", {"model": m, "messages": [{"content": "x"}]}, 400),
        ("POST", "/api/chat", {"model": m, "messages": [{"role": "user", "content": 5}]}, 400),
        ("POST", "/api/chat", {"model": m, "messages": user(), "stream": "yes"}, 400),
        ("POST", "/api/chat", {"model": "no-such-model", "messages": user()}, 404),
        ("POST", "/api/chat", b"{nope", 400),
        ("POST", "/api/generate", {"model": m, "prompt": 1}, 400),
        ("POST", "/api/generate", {"model": m, "prompt": "x", "system": 5}, 400),
        ("POST", "/api/generate", {"prompt": "x"}, 400),
        ("POST", "/api/show", {}, 400),
        ("POST", "/api/show", {"model": "no-such-model"}, 404),
        ("GET", "/v1/usage?since=yesterday", None, 400),
        ("GET", "/v1/models/no-such-model", None, 404),
        ("GET", "/v1/nothing-here", None, 404),
        ("GET", "/api/nothing-here", None, 404),
        ("GET", CHAT, None, 405),
        ("DELETE", "/api/chat", None, 405),
        ("POST", "/admin/v1/tenants", {"name": "x"}, 403),  # a tenant key on an admin route
    ]


def admin_bad_requests(tid: str) -> list[tuple[str, str, object, int]]:
    t = f"/admin/v1/tenants/{tid}"
    return [
        ("POST", "/admin/v1/tenants", {}, 400),
        ("POST", "/admin/v1/tenants", {"name": 5}, 400),
        ("POST", "/admin/v1/tenants", b"{not json", 400),
        ("GET", "/admin/v1/tenants/tn_nope", None, 404),
        ("PATCH", t, {"disabled": "yes"}, 400),
        ("PATCH", t, {"filters": {"hooks": 3}}, 400),
        ("PUT", f"{t}/limits", {"rpm": 1}, 400),
        ("PATCH", f"{t}/limits", {"rpm": "many"}, 400),
        ("PUT", f"{t}/filters", {"hooks": 3}, 400),
        ("POST", f"{t}/keys", {"expires_at": "not a time"}, 400),
        ("POST", f"{t}/keys", {"expires_at": 1}, 400),
        ("GET", f"{t}/usage?since=yesterday", None, 400),
        ("GET", "/admin/v1/keys/key_nope", None, 404),
        ("DELETE", "/admin/v1/tenants", None, 405),
    ]


def send(gp, method: str, path: str, body: object, headers: dict[str, str]) -> httpx.Response:
    kw: dict = {}
    if isinstance(body, bytes):
        kw["content"] = body
    elif body is not None:
        kw["content"] = json.dumps(body).encode()
    return httpx.request(
        method,
        gp.base_url + path,
        headers={"Content-Type": "application/json", **headers},
        timeout=60,
        **kw,
    )


def code_problem(r: httpx.Response, path: str, status: int) -> str | None:
    """What is wrong with ``r`` as a client error with a code, or None."""
    if r.status_code != status:
        return f"status {r.status_code}, not {status}: {r.text[:200]}"
    try:
        body = r.json()
    except ValueError:
        return f"not JSON: {r.text[:200]}"
    if path.startswith("/api/"):
        if not isinstance(body.get("error"), str) or not body["error"]:
            return f"not Ollama's error shape: {body}"
        code = body.get("code")
    else:
        err = body.get("error")
        if not isinstance(err, dict) or set(err) < {"message", "type", "param", "code"}:
            return f"not OpenAI's error shape: {body}"
        code = err["code"]
    if not isinstance(code, str) or not code:
        return f"code {code!r}: {body}"
    return None


def test_every_client_error_has_a_code(gateway):
    problems = []
    for method, path, body, status in bad_requests(gateway):
        r = send(gateway, method, path, body, gateway.headers())
        if (why := code_problem(r, path, status)) is not None:
            problems.append(f"{method} {path} {str(body)[:60]}: {why}")
    assert not problems, "\n".join(problems)


def test_every_admin_error_has_a_code(gateway):
    name = "codes-" + os.urandom(4).hex()
    r = httpx.post(
        gateway.base_url + "/admin/v1/tenants",
        json={"name": name},
        headers=gateway.admin_headers(),
        timeout=30,
    )
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    problems = []
    for method, path, body, status in admin_bad_requests(tid):
        r = send(gateway, method, path, body, gateway.admin_headers())
        if (why := code_problem(r, path, status)) is not None:
            problems.append(f"{method} {path} {str(body)[:60]}: {why}")
    for method, path, headers in (
        ("POST", CHAT, {}),
        ("POST", CHAT, {"Authorization": "Bearer sk-wrong"}),
        ("GET", "/admin/v1/tenants", {}),
        ("GET", "/admin/v1/tenants", {"Authorization": "Bearer wrong-admin"}),
        ("POST", "/api/chat", {}),
    ):
        r = send(gateway, method, path, None, headers)
        if (why := code_problem(r, path, 401)) is not None:
            problems.append(f"{method} {path} without a valid key: {why}")
    assert not problems, "\n".join(problems)


def methods(header: str) -> set[str]:
    return {m.strip() for m in header.split(",") if m.strip()}


@pytest.mark.parametrize(
    "path, allowed",
    [
        (CHAT, {"POST", "OPTIONS"}),
        ("/v1/completions", {"POST", "OPTIONS"}),
        ("/v1/models", {"GET", "HEAD", "OPTIONS"}),
        ("/api/chat", {"POST", "OPTIONS"}),
        ("/api/tags", {"GET", "HEAD", "OPTIONS"}),
        ("/healthz", {"GET", "HEAD", "OPTIONS"}),
        ("/admin/v1/tenants", {"GET", "HEAD", "POST", "OPTIONS"}),
    ],
)
def test_options_lists_the_route_methods_only(gateway, path, allowed):
    r = httpx.options(gateway.base_url + path, timeout=30)
    assert r.status_code in (200, 204), r.text
    assert methods(r.headers["allow"]) == allowed, r.headers["allow"]
    # a CORS preflight still answers, without a key, with the same methods
    r = httpx.options(
        gateway.base_url + path,
        headers={"Origin": "http://page.example", "Access-Control-Request-Method": "POST"},
        timeout=30,
    )
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] in ("*", "http://page.example")
    assert methods(r.headers["access-control-allow-methods"]) == allowed


@pytest.mark.parametrize("method", ["TRACE", "FOO", "PUT", "DELETE"])
@pytest.mark.parametrize(
    "path, allowed, admin",
    [
        (CHAT, {"POST", "OPTIONS"}, False),
        ("/api/chat", {"POST", "OPTIONS"}, False),
        ("/v1/models", {"GET", "HEAD", "OPTIONS"}, False),
        ("/healthz", {"GET", "HEAD", "OPTIONS"}, False),
        ("/admin/v1/tenants", {"GET", "HEAD", "POST", "OPTIONS"}, True),
        ("/admin/v1/stats", {"GET", "HEAD", "OPTIONS"}, True),  # a path inside the admin mount's prefix
    ],
)
def test_unknown_and_wrong_methods_are_405_with_allow(gateway, method, path, allowed, admin):
    headers = gateway.admin_headers() if admin else gateway.headers()
    r = httpx.request(method, gateway.base_url + path, headers=headers, timeout=30)
    assert r.status_code == 405, (method, path, r.status_code, r.text[:200])
    assert methods(r.headers["allow"]) == allowed, r.headers.get("allow")
    assert code_problem(r, path, 405) is None, r.text
    code = r.json()["code"] if path.startswith("/api/") else r.json()["error"]["code"]
    assert code == "method_not_allowed"


def test_empty_put_on_limits_and_filters_is_400_and_changes_nothing(gateway):
    A = gateway.admin_headers()
    base = gateway.base_url + "/admin/v1/tenants"
    name = "empty-put-" + os.urandom(4).hex()
    r = httpx.post(base, json={"name": name, "limits": {"rpm": 5, "tpm": 100}}, headers=A, timeout=30)
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    filters = {"hooks": [{"type": "blocklist", "name": "words", "keywords": ["forbidden"]}]}
    assert httpx.put(f"{base}/{tid}/filters", json=filters, headers=A, timeout=30).status_code == 200
    limits_before = httpx.get(f"{base}/{tid}/limits", headers=A, timeout=30).json()
    filters_before = httpx.get(f"{base}/{tid}/filters", headers=A, timeout=30).json()
    assert limits_before["rpm"] == 5 and filters_before
    for what in ("limits", "filters"):
        r = httpx.put(f"{base}/{tid}/{what}", headers=A, timeout=30)
        assert r.status_code == 400, (what, r.status_code, r.text)
        assert isinstance(r.json()["error"]["code"], str), r.text
    assert httpx.get(f"{base}/{tid}/limits", headers=A, timeout=30).json() == limits_before
    assert httpx.get(f"{base}/{tid}/filters", headers=A, timeout=30).json() == filters_before


@pytest.mark.parametrize(
    "path, admin",
    [
        (CHAT, False),
        ("/v1/completions", False),
        ("/api/chat", False),
        ("/api/generate", False),
        ("/api/show", False),
        ("/admin/v1/tenants", True),
    ],
)
@pytest.mark.parametrize(
    "raw", [b"[" * 100_000, b'{"model": ' * 20_000 + b"1" + b"}" * 20_000], ids=["arrays", "objects"]
)
def test_deeply_nested_json_is_400_on_every_route_with_a_body(gateway, path, admin, raw):
    """Nesting deeper than the JSON decoders recurse is a 400 with a code (``invalid_json``, or the type error
    a typed decoder finds first), never a 500. Both bodies fit the admin limit (256 KiB)."""
    headers = gateway.admin_headers() if admin else gateway.headers()
    r = send(gateway, "POST", path, raw, headers)
    assert code_problem(r, path, 400) is None, r.text[:300]
