"""Tenants restricted to a list of models, and limits per tenant and model, through the real gateway (``python -m
gateway serve`` + backend, the shared fixture), the admin API over HTTP and the official openai client.

The admin API is checked on the shared gateway; the restriction and the limits per model on a second gateway
that serves two names (``alpha``, ``beta``) on the shared gateway's backend (``--serve-model ...,backend_url=``).
"""

from __future__ import annotations

import os

import httpx
import openai
import pytest
from plugins.gateway_server import start_gateway

MESSAGES = [{"role": "user", "content": "Say hi."}]
ELSEWHERE = "a-model-served-elsewhere"


def admin(gp, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(
        method, gp.base_url + "/admin/v1" + path, json=body, headers=gp.admin_headers(), timeout=30
    )


def tenant_with_key(gp, key_body: dict | None = None, **tenant_body) -> tuple[dict, str]:
    r = admin(gp, "POST", "/tenants", {"name": "models-" + os.urandom(4).hex(), **tenant_body})
    assert r.status_code == 201, r.text
    t = r.json()
    r = admin(gp, "POST", f"/tenants/{t['id']}/keys", key_body or {})
    assert r.status_code == 201, r.text
    return t, r.json()["key"]


def client(gp, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gp.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def chat(gp, key: str, model: str):
    return client(gp, key).chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=1
    )


def test_admin_api_models_and_model_limits(gateway):
    """Created, read back, changed and cleared; a bad shape is a 400 naming the place; the OpenAPI document
    has the members."""
    t, _ = tenant_with_key(
        gateway,
        models=[gateway.model, ELSEWHERE, gateway.model],
        model_limits={ELSEWHERE: {"rpm": 5, "window_s": 30}},
    )
    assert t["models"] == [gateway.model, ELSEWHERE]  # each name once
    assert t["model_limits"] == {
        ELSEWHERE: {"rpm": 5, "tpm": None, "max_concurrent": None, "daily_tokens": None, "window_s": 30.0}
    }
    assert admin(gateway, "GET", f"/tenants/{t['id']}").json()["models"] == [gateway.model, ELSEWHERE]
    r = admin(gateway, "PATCH", f"/tenants/{t['id']}", {"model_limits": {ELSEWHERE: {"tpm": 9}}})
    assert r.json()["model_limits"][ELSEWHERE] == {  # replaced; the entry's window stays
        "rpm": None,
        "tpm": 9,
        "max_concurrent": None,
        "daily_tokens": None,
        "window_s": 30.0,
    }
    r = admin(gateway, "PATCH", f"/tenants/{t['id']}", {"models": None, "model_limits": None})
    assert (r.json()["models"], r.json()["model_limits"]) == (None, {})
    r = admin(gateway, "POST", f"/tenants/{t['id']}/keys", {"models": [ELSEWHERE]})
    assert r.status_code == 201 and r.json()["models"] == [ELSEWHERE]
    r = admin(gateway, "PATCH", f"/keys/{r.json()['id']}", {"models": None})
    assert r.status_code == 200 and r.json()["models"] is None

    bad = [
        ("POST", "/tenants", {"name": "x", "models": [gateway.model, ""]}, "models[1]", "invalid_value"),
        ("POST", "/tenants", {"name": "x", "models": gateway.model}, "models", "invalid_type"),
        (
            "POST",
            "/tenants",
            {"name": "x", "model_limits": {"": {"rpm": 1}}},
            "model_limits",
            "invalid_value",
        ),
        (
            "PATCH",
            f"/tenants/{t['id']}",
            {"model_limits": {"m": {"rpm": -1}}},
            "model_limits.m.rpm",
            "invalid_value",
        ),
        (
            "PATCH",
            f"/tenants/{t['id']}",
            {"model_limits": {"m": {"x": 1}}},
            "model_limits.m.x",
            "unknown_parameter",
        ),
        ("POST", f"/tenants/{t['id']}/keys", {"models": [" padded"]}, "models[0]", "invalid_value"),
    ]
    for method, path, body, param, code in bad:
        r = admin(gateway, method, path, body)
        err = r.json()["error"]
        assert (r.status_code, err["param"], err["code"]) == (400, param, code), (body, r.text)
    assert "without leading or trailing white space" in err["message"]  # the last one, said in words

    schemas = httpx.get(gateway.base_url + "/openapi.json", timeout=30).json()["components"]["schemas"]
    for name in ("TenantCreate", "TenantPatch", "Tenant"):
        assert {"models", "model_limits"} <= set(schemas[name]["properties"]), name
    for name in ("KeyCreate", "KeyPatch", "ApiKey"):
        assert "models" in schemas[name]["properties"], name


@pytest.fixture(scope="module")
def two_models(gateway):
    """A second gateway serving two names, ``alpha`` and ``beta``, both on the shared gateway's backend (reached
    by its URL: nothing spawned, so it starts in seconds, and its stop leaves that backend running)."""
    url = gateway.stats()["backends"][0]["url"]
    gp = start_gateway(
        "--serve-model", f"name=alpha,backend_url={url}", "--serve-model", f"name=beta,backend_url={url}"
    )
    try:
        yield gp
    finally:
        gp.stop()


def test_a_tenant_restricted_to_models_gets_404_for_another(two_models):
    """Allowed: the model answers. Another served model: 404 model_not_found, as for an unknown model, and the
    listing holds only the allowed one. A key's own list narrows its tenant's the same way."""
    gp = two_models
    _, key = tenant_with_key(gp, models=["alpha", ELSEWHERE])
    assert chat(gp, key, "alpha").http_response.status_code == 200
    with pytest.raises(openai.NotFoundError) as ei:
        chat(gp, key, "beta")
    assert ei.value.status_code == 404 and ei.value.code == "model_not_found" and ei.value.param == "model"
    assert ei.value.message.endswith("Available: alpha.")  # only what this tenant may use is named
    assert [m.id for m in client(gp, key).models.list()] == ["alpha"]

    _, narrowed = tenant_with_key(gp, key_body={"models": ["beta"]})  # the tenant may use every model
    with pytest.raises(openai.NotFoundError) as ei:
        chat(gp, narrowed, "alpha")
    assert ei.value.code == "model_not_found"
    assert [m.id for m in client(gp, narrowed).models.list()] == ["beta"]


def test_a_limit_per_model_gives_429_on_that_model_only(two_models):
    """``alpha``'s rpm (1 an hour) is spent by the first request: the second gets the 429 naming the model,
    while a request to ``beta`` passes, charged to the tenant-wide limit (50) only."""
    gp = two_models
    t, key = tenant_with_key(
        gp, limits={"rpm": 50, "window_s": 3600}, model_limits={"alpha": {"rpm": 1, "window_s": 3600}}
    )
    first = chat(gp, key, "alpha")
    assert first.http_response.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "1"  # the tightest scope: the model's
    with pytest.raises(openai.RateLimitError) as ei:
        chat(gp, key, "alpha")
    e = ei.value
    assert e.status_code == 429 and e.code == "rate_limit_exceeded"
    assert f"model alpha of tenant {t['name']}" in e.message and "Limit 1" in e.message
    assert (
        e.response.headers["x-ratelimit-limit-requests"] == "1"
        and int(e.response.headers["retry-after"]) >= 1
    )
    other = chat(gp, key, "beta")
    assert other.http_response.status_code == 200
    assert (other.headers["x-ratelimit-limit-requests"], other.headers["x-ratelimit-remaining-requests"]) == (
        "50",
        "48",
    )
    usage = httpx.get(gp.base_url + "/v1/usage", headers={"authorization": f"Bearer {key}"}, timeout=30)
    assert usage.json()["totals"]["requests"] == 2  # the refused one is not billed
