"""The OpenAPI document: every route of the real app is in it with its error statuses, and its request and
response schemas are the msgspec types the handlers decode and encode."""

from __future__ import annotations

import json
import re

import msgspec
from starlette.routing import BaseRoute, Mount, Route

from gateway.admin.schemas import KeyCreate, LimitsPatch, LimitsPut, TenantCreate
from gateway.app import build_app
from gateway.backends.pool import BackendPool
from gateway.observability.metrics import GatewayMetrics
from gateway.openai.schemas import ChatRequest, CompletionRequest
from gateway.openapi import ROUTES, OllamaChatRequest, error_statuses, openapi_spec
from gateway.settings import Settings
from gateway.state import Gateway
from gateway.tenants import Tenants


def served(routes: list[BaseRoute], prefix: str = "") -> set[tuple[str, str]]:
    """(method, OpenAPI path) of every route (HEAD left out: Starlette adds it to every GET)."""
    out: set[tuple[str, str]] = set()
    for r in routes:
        if isinstance(r, Mount):
            out |= served(r.routes, prefix + r.path) if r.routes else {("GET", prefix + r.path + "/{path}")}
        elif isinstance(r, Route):
            path = re.sub(r"\{(\w+):\w+\}", r"{\1}", prefix + r.path)  # {model_id:path} -> {model_id}
            out |= {(m, path) for m in r.methods or () if m != "HEAD"}
    return out


def app_routes() -> set[tuple[str, str]]:
    gw = Gateway(
        Settings(), BackendPool([]), None, None, tenancy=Tenants(":memory:"), metrics=GatewayMetrics("m")
    )
    return served(build_app(gw).starlette.routes)


def test_every_route_is_documented_with_its_errors():
    doc = openapi_spec()
    documented = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    routes = app_routes()
    assert routes == documented, (sorted(routes - documented), sorted(documented - routes))
    assert len(ROUTES) == len(documented)  # one table entry per route
    for op in ROUTES:
        responses = doc["paths"][op.path][op.method.lower()]["responses"]
        assert str(op.status) in responses, op
        error = "OllamaError" if op.path.startswith("/api/") else "Error"
        for status in error_statuses(op):
            assert responses[str(status)]["content"]["application/json"]["schema"] == {
                "$ref": f"#/components/schemas/{error}"
            }, (op, status)
        if op.caller == "tenant":
            assert "401" in responses, op
        if op.caller == "admin":
            assert {"401", "403"} <= set(responses), op
        if op.method in ("POST", "PUT", "PATCH"):  # every body is read with a size limit and a timeout
            assert {"400", "408", "413"} <= set(responses), op
        if op.admitted:
            assert {"404", "503"} <= set(responses), op  # unknown model; no backend ready
            assert "retry-after" in responses["429"]["headers"], op
        assert not any(s.startswith("5") and s != "503" for s in responses), op  # a 500 is a fault
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "404", "408", "413", "429", "503"} <= set(chat)
    assert {"400", "401", "403", "404", "408", "409", "413"} <= set(
        doc["paths"]["/admin/v1/tenants/{tenant_id}"]["patch"]["responses"]
    )
    json.dumps(doc)


def test_every_json_answer_has_a_schema():
    """A route answering JSON declares the schema of its 200/201 body (schemathesis validates answers against
    it), and the Ollama routes are described in Ollama's shapes."""
    doc = openapi_spec()
    for op in ROUTES:
        ok = doc["paths"][op.path][op.method.lower()]["responses"][str(op.status)]
        if op.media == "application/json":
            assert ok["content"]["application/json"]["schema"], op
    components = doc["components"]["schemas"]
    assert components["OllamaError"]["required"] == ["error", "type", "code"]
    assert components["OllamaError"]["properties"]["error"] == {"type": "string"}
    assert {"model", "created_at", "done", "message"} <= set(components["OllamaChatAnswer"]["required"])
    assert {"model", "created_at", "done", "response"} <= set(components["OllamaGenerateAnswer"]["required"])
    assert components["OllamaChatRequest"]["required"] == ["model"]
    assert components["ModelList"]["properties"]["data"]["items"] == {"$ref": "#/components/schemas/Model"}
    stats = components["EngineStats"]
    assert {"running", "waiting", "kv_blocks_used", "kv_blocks_total", "draining"} <= set(stats["required"])


def test_request_schemas_are_the_msgspec_ones():
    doc = openapi_spec()
    components = doc["components"]["schemas"]
    types = (
        ChatRequest,
        CompletionRequest,
        TenantCreate,
        KeyCreate,
        LimitsPut,
        LimitsPatch,
        OllamaChatRequest,
    )
    _, expected = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    for name, schema in expected.items():
        assert components[name] == schema, name

    def body(path: str, method: str) -> dict:
        return doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]

    assert body("/v1/chat/completions", "post") == {"$ref": "#/components/schemas/ChatRequest"}
    assert body("/v1/completions", "post") == {"$ref": "#/components/schemas/CompletionRequest"}
    assert body("/api/chat", "post") == {"$ref": "#/components/schemas/OllamaChatRequest"}
    assert body("/api/generate", "post") == {"$ref": "#/components/schemas/OllamaGenerateRequest"}
    limits = "/admin/v1/tenants/{tenant_id}/limits"
    assert body(limits, "put") == {"$ref": "#/components/schemas/LimitsPut"}
    assert body(limits, "patch") == {"$ref": "#/components/schemas/LimitsPatch"}
    assert set(components["LimitsPut"]["required"]) == {"rpm", "tpm", "max_concurrent", "daily_tokens"}
    assert "required" not in components["LimitsPatch"] or not components["LimitsPatch"]["required"]
    assert "messages" in components["ChatRequest"]["required"]
    refs = re.findall(r'"#/components/schemas/(\w+)"', json.dumps(doc))
    assert set(refs) <= set(components)  # every reference resolves
