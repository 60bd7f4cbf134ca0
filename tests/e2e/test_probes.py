"""Probes and model lookup clients expect: ``GET /health`` (liveness as vLLM's, public), ``GET /api/version``
(public, as in Ollama), ``GET /v1/models/{model_id}`` (OpenAI "Retrieve model", ``client.models.retrieve``).

The HTTP tests use the session ``gateway`` fixture (tests/plugins/gateway_server.py: a real gateway subprocess
with the real backend and tenancy); the classification, drain and ``org/model`` routing checks run in process.
"""

from __future__ import annotations

import logging
import socket
from functools import partial
from types import SimpleNamespace

import httpx
import openai
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.routing import Route

from backend.protocol import ModelCard
from gateway.app import _api_error
from gateway.errors import APIError
from gateway.middleware.auth import classify_path
from gateway.middleware.drain import DrainGate
from gateway.openai.models import list_models, retrieve_model
from gateway.settings import HTTPSettings, Settings
from gateway.state import Gateway


def test_health_is_public_liveness(gateway):
    """vLLM's /health: 200 with an empty body, no key needed; HEAD answers too. /healthz is unchanged."""
    r = httpx.get(gateway.base_url + "/health", timeout=30)
    assert r.status_code == 200, r.text
    assert "authorization" not in {k.lower() for k in r.request.headers}
    assert r.content == b""
    assert httpx.head(gateway.base_url + "/health", timeout=30).status_code == 200
    assert httpx.get(gateway.base_url + "/healthz", timeout=30).json() == {"status": "ok"}
    # exactly /health: a look-alike needs a key like any unknown path
    for p in ("/health/", "/health/x", "/Health"):
        assert httpx.get(gateway.base_url + p, timeout=30).status_code == 401, p


def test_api_version_is_public(gateway):
    """Ollama's GET /api/version needs no key (the route said so; the middleware answered 401 before)."""
    r = httpx.get(gateway.base_url + "/api/version", timeout=30)
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["version"], str) and r.json()["version"]
    # the rest of the Ollama API still needs a key
    assert httpx.get(gateway.base_url + "/api/tags", timeout=30).status_code == 401


def test_models_retrieve(gateway):
    """client.models.retrieve(id) -> GET /v1/models/{id}: the same object as the /v1/models entry."""
    m = gateway.openai().models.retrieve(gateway.model)
    assert m.id == gateway.model and m.object == "model" and m.owned_by == "gateway"
    r = httpx.get(gateway.base_url + "/v1/models/" + gateway.model, headers=gateway.headers(), timeout=30)
    assert r.status_code == 200, r.text
    listed = httpx.get(gateway.base_url + "/v1/models", headers=gateway.headers(), timeout=30).json()["data"]
    assert r.json() == next(e for e in listed if e["id"] == gateway.model)
    assert r.json()["context_length"] > 0


@pytest.mark.parametrize("model_id", ["no-such-model", "org/no-such-model", "no.such.model-1.5"])
def test_models_retrieve_unknown_is_404(gateway, model_id):
    """An unknown id is 404 in OpenAI's shape, the same error as an unknown ``model`` in a chat request."""
    with pytest.raises(openai.NotFoundError) as ei:
        gateway.openai().models.retrieve(model_id)
    err = ei.value.body
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error",
        "model",
        "model_not_found",
    ), err
    assert err["message"].startswith(f"The model '{model_id}' does not exist"), err
    chat = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        headers=gateway.headers(),
        timeout=30,
        json={"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    )
    assert chat.status_code == 404 and chat.json()["error"] == err


def test_models_retrieve_needs_a_key(gateway):
    for h in ({}, {"Authorization": "Bearer sk-gw-not-a-key"}):
        for mid in (gateway.model, "no-such-model"):  # no 404 before auth
            r = httpx.get(gateway.base_url + "/v1/models/" + mid, headers=h, timeout=30)
            assert r.status_code == 401, (h, mid, r.status_code)
            assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=gateway.base_url + "/v1", api_key="sk-gw-not-a-key", max_retries=0
        ).models.retrieve(gateway.model)


def test_probe_paths_classification():
    """Only the exact public paths are public; their ``..``/slash variants are not."""
    for p in ("/health", "/healthz", "/readyz", "/api/version"):
        assert classify_path(p) == "public", p
        assert classify_path(p, "HEAD") == "public", p
    for p in (
        "/v1/models/x",
        "/v1/models/org/model",
        "/v1/models",
        "/health/",
        "/health/x",
        "/Health",
        "/health/../v1/models",
        "/api/version/../v1/models",
        "/api/version/",
        "/api/tags",
        "/v1/models/../../health",
        "/health//",
        "//health",
    ):
        assert classify_path(p) == "tenant", p
    for p in ("/health/../admin", "/health/../admin/v1/stats", "/api/version/../../admin/v1/tenants"):
        assert classify_path(p) == "admin", p


async def test_drain_still_answers_health():
    """DrainGate lets /health through (200) during a drain like /healthz; other paths get 503."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    gate = DrainGate(app, SimpleNamespace(draining=True))

    async def status(path: str) -> int:
        sent: list[dict] = []

        async def send(msg: dict) -> None:
            sent.append(msg)

        await gate({"type": "http", "method": "GET", "path": path, "headers": []}, None, send)
        return sent[0]["status"]

    assert await status("/health") == 200
    assert await status("/healthz") == 200
    assert await status("/v1/models/x") == 503


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_models_retrieve_ids_with_slash_and_dots():
    """A served name like ``org/model-1.5``: the SDK percent-encodes the ``/`` (``org%2Fmodel-1.5``), hypercorn
    decodes it, and the ``{model_id:path}`` route matches it whole (the real handlers, in process)."""
    card = ModelCard(name="SmolLM2.Q4_1", context_length=128, vocab_size=10)
    settings = Settings(http=HTTPSettings(served_model_name=["org/model-1.5"]))
    gw = Gateway(settings, SimpleNamespace(card=card), None, None)
    app = Starlette(
        routes=[Route("/v1/models", list_models), Route("/v1/models/{model_id:path}", retrieve_model)],
        exception_handlers={APIError: _api_error},
    )
    app.state.gateway = gw
    cfg = Config()
    cfg.bind = [f"127.0.0.1:{_free_port()}"]
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("test.error")
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, cfg, shutdown_trigger=done.wait))
        client = openai.AsyncOpenAI(base_url=binds[0] + "/v1", api_key="x", max_retries=0, timeout=30)
        try:
            listed = {m.id: m for m in (await client.models.list()).data}
            assert set(listed) == {"SmolLM2.Q4_1", "org/model-1.5"}
            for name in listed:
                m = await client.models.retrieve(name)
                assert m.id == name and m.object == "model" and m.model_dump() == listed[name].model_dump()
            for bad in ("org", "org/model-1.5/x", "model-1.5", "SmolLM2"):
                with pytest.raises(openai.NotFoundError):
                    await client.models.retrieve(bad)
        finally:
            await client.close()
            done.set()
