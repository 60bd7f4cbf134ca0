"""The Ollama API (gateway/ollama/) with a stand-in generation run, driven by the official ``ollama`` client.

The real routes, translation, renderers, ``generation_response`` plumbing and observability middleware run;
only ``prepare_chat`` (recording the ``ChatRequest`` the translation built) and ``run_generation`` (pushing
the events a real run pushes, or raising its 429) are stand-ins, so no backend is needed. The end-to-end
test against the real gateway is tests/e2e/test_observability_http.py.
"""

from __future__ import annotations

import json

import httpx
import msgspec
import ollama
import pytest
from starlette.applications import Starlette

import gateway.generation.response as response_module
import gateway.ollama.routes as routes_module
from backend.protocol import ModelCard, SamplingParams
from gateway.catalog import ModelCatalog, ServedModel
from gateway.errors import APIError, AuthenticationError, RateLimited
from gateway.generation.events import ChoiceFinished, Completed, Ended, Heartbeat, Started, TextDelta
from gateway.generation.request import GenerationRequest
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.middleware import ObservabilityMiddleware
from gateway.ollama.routes import OllamaAPI
from gateway.ollama.translate import Options, parse_options, to_chat_request
from gateway.settings import HTTPSettings

KEY = "sk-ollama-test"
WORDS = ["Hello", " there", "!"]
seen_bodies: list[dict] = []
CARD = ModelCard(name="smol", context_length=2048, quantization="Q4_1", model_path="/nonexistent/smol.gguf")
TIMINGS = {"queue_duration": 1_000, "prompt_eval_duration": 2_000, "eval_duration": 3_000}


class Pool:
    card = CARD


class StandInGateway:
    """What the Ollama routes read of ``gateway.state.Gateway``."""

    config = HTTPSettings()
    pool = Pool()
    catalog = ModelCatalog([ServedModel(None, pool=Pool())])  # type: ignore[arg-type]

    async def authenticate(self, request):
        if request.headers.get("authorization") != f"Bearer {KEY}":
            raise AuthenticationError()

    def model_names(self) -> list[str]:
        return [CARD.name]


async def fake_prepare(gw, req, *, principal, api, t_arrival, request_id=None, constraint=None):
    body = msgspec.to_builtins(req)
    seen_bodies.append(body)
    return GenerationRequest(
        request_id="chatcmpl-test",
        api=api,
        model=req.model,
        prompt_ids=[1] * 11,
        sampling=SamplingParams(max_tokens=req.max_tokens or 16),
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        prompt_log=req.messages,
        t_arrival=t_arrival,
    )


async def fake_run(gw, req, sink):
    if seen_bodies[-1]["messages"][-1]["content"] == "limit me":
        raise RateLimited("Too many requests", code="rate_limit_exceeded", headers={"retry-after": "1"})
    await sink.emit(Started(headers={"x-ratelimit-limit-requests": "10"}))
    await sink.emit(Heartbeat())
    for w in WORDS:
        await sink.emit(TextDelta(index=0, text=w, tokens=1))
    await sink.emit(ChoiceFinished(index=0, reason="stop", completion_tokens=len(WORDS)))
    done = Completed(prompt_tokens=11, completion_tokens=len(WORDS), cached_tokens=3, timings=TIMINGS)
    await sink.emit(done)
    await sink.emit(
        Ended(
            status=200, reason="stop", submitted=True, prompt_tokens=11, completion_tokens=3, cached_tokens=3
        )
    )


@pytest.fixture(autouse=True)
def stand_in_generation(monkeypatch):
    monkeypatch.setattr(routes_module, "prepare_chat", fake_prepare)
    monkeypatch.setattr(response_module, "run_generation", fake_run)


def make_app():
    async def api_error(request, exc: APIError):
        from starlette.responses import JSONResponse

        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    app = Starlette(routes=OllamaAPI(StandInGateway()).routes(), exception_handlers={APIError: api_error})
    return ObservabilityMiddleware(app, GatewayMetrics("smol"))


def oclient(app, key: str = KEY) -> ollama.AsyncClient:
    return ollama.AsyncClient(
        host="http://test:80",
        headers={"Authorization": f"Bearer {key}"},
        transport=httpx.ASGITransport(app=app),
    )


def check_stats(r, *, prompt=11):
    assert r.done and r.done_reason == "stop"
    assert r.prompt_eval_count == prompt and r.eval_count == len(WORDS)
    assert r.prompt_eval_duration == 2_000 and r.eval_duration == 3_000
    assert r.prompt_eval_duration + r.eval_duration <= r.total_duration


async def test_chat_and_generate_with_official_client():
    app = make_app()
    c = oclient(app)
    r = await c.chat(
        model="smol",
        messages=[{"role": "user", "content": "hi"}],
        options={
            "temperature": 0,
            "num_predict": 5,
            "seed": 3,
            "repeat_penalty": 1.1,
            "top_k": 4,
            "stop": ["x"],
        },
    )
    assert r.message.role == "assistant" and r.message.content == "Hello there!"
    check_stats(r)
    sent = seen_bodies[-1]
    assert (
        sent["temperature"] == 0
        and sent["max_tokens"] == 5
        and sent["seed"] == 3
        and sent["repetition_penalty"] == 1.1
        and sent["top_k"] == 4
        and sent["stop"] == ["x"]
    )
    parts = [
        p async for p in await c.chat(model="smol", messages=[{"role": "user", "content": "hi"}], stream=True)
    ]
    assert "".join(p.message.content for p in parts) == "Hello there!"
    assert [p.done for p in parts] == [False] * len(WORDS) + [True]
    check_stats(parts[-1])
    assert seen_bodies[-1]["stream_options"]["include_usage"] is True
    r = await c.generate(model="smol", prompt="hi", system="be brief")
    assert r.response == "Hello there!"
    check_stats(r)
    assert seen_bodies[-1]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    parts = [p async for p in await c.generate(model="smol", prompt="hi", stream=True)]
    assert "".join(p.response for p in parts) == "Hello there!"
    check_stats(parts[-1])
    r = await c.generate(model="smol", prompt="")
    assert r.done_reason == "load"
    r = await c.chat(model="smol", messages=[], keep_alive=0)
    assert r.done_reason == "unload" and r.message.content == ""
    with pytest.raises(ollama.ResponseError) as ei:
        await c.generate(model="nope", prompt="")
    assert ei.value.status_code == 404


async def test_errors_in_ollama_shape():
    app = make_app()
    with pytest.raises(ollama.ResponseError) as ei:
        await oclient(app, "sk-wrong").chat(model="smol", messages=[{"role": "user", "content": "hi"}])
    assert ei.value.status_code == 401 and "API key" in ei.value.error
    with pytest.raises(ollama.ResponseError) as ei:
        await oclient(app).chat(model="smol", messages=[{"role": "user", "content": "limit me"}])
    assert ei.value.status_code == 429
    with pytest.raises(ollama.ResponseError) as ei:
        await oclient(app).chat(
            model="smol", messages=[{"role": "user", "content": "hi", "images": ["aGk="]}]
        )
    assert ei.value.status_code == 400
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        r = await h.post(
            "/api/chat",
            json={"model": "smol", "messages": [{"role": "user", "content": "limit me"}]},
            headers={"authorization": f"Bearer {KEY}"},
        )
        assert (
            r.status_code == 429
            and r.headers["retry-after"] == "1"
            and r.json()["code"] == "rate_limit_exceeded"
        )
        r = await h.post(
            "/api/generate",
            json={"model": "smol", "prompt": "hi", "stream": False},
            headers={"authorization": f"Bearer {KEY}"},
        )
        assert r.json()["prompt_eval_cached_count"] == 3  # extension field (the client drops unknown fields)
        assert r.headers["x-ratelimit-limit-requests"] == "10"
        resp = await h.post(
            "/api/chat",
            json={"model": "smol", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer {KEY}"},
        )
        assert resp.headers["content-type"] == "application/x-ndjson"
        assert resp.headers["x-ratelimit-limit-requests"] == "10"
        lines = [json.loads(x) for x in resp.text.splitlines()]
        assert (
            lines[-1]["done"]
            and lines[-1]["prompt_eval_cached_count"] == 3
            and lines[-1]["queue_duration"] == 1000
        )
        r = await h.get("/metrics")  # not routed here; just check x-request-id on a 404
        assert r.headers["x-request-id"]


async def test_tags_show_version():
    app = make_app()
    c = oclient(app)
    tags = await c.list()
    assert [m.model for m in tags.models] == ["smol"] and tags.models[0].details.quantization_level == "Q4_1"
    show = await c.show("smol")
    assert show.modelinfo["llama.context_length"] == 2048
    with pytest.raises(ollama.ResponseError):
        await oclient(app, "bad").list()
    with pytest.raises(ollama.ResponseError) as ei:
        await c.show("nope")
    assert ei.value.status_code == 404
    ps = await c.ps()
    assert [m.model for m in ps.models] == ["smol"] and ps.models[0].size_vram == 0
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        assert (await h.get("/api/version")).json()["version"]


def test_translation_helpers():
    assert parse_options({"num_predict": -1, "num_ctx": 4096, "min_p": 0.1}) == Options(
        num_predict=-1, min_p=0.1
    )
    assert parse_options({"presence_penalty": 0.5, "frequency_penalty": 0.25, "top_p": 0.9}) == Options(
        presence_penalty=0.5, frequency_penalty=0.25, top_p=0.9
    )
    assert parse_options({"top_k": 4.0, "stop": "x"}) == Options(top_k=4, stop=["x"])
    for bad in ({"num_predict": "lots"}, {"top_k": 1.5}, {"temperature": True}, {"stop": [1]}, [1]):
        with pytest.raises(APIError) as ei:
            parse_options(bad)
        assert ei.value.status == 400 and ei.value.param.startswith("options")
    req = to_chat_request({"model": "m", "prompt": "x", "options": {"num_predict": -1}}, "generate")
    assert req.max_tokens is None and req.stream and req.stream_options.include_usage
    with pytest.raises(APIError):
        to_chat_request({"model": "m", "prompt": "x", "raw": True}, "generate")
    assert (
        to_chat_request({"model": "m", "messages": [], "stream": False, "tools": []}, "chat").stream is False
    )
    for body, code in (({"messages": []}, "missing_required_parameter"), ({"model": 7}, "invalid_type")):
        with pytest.raises(APIError) as ei:
            to_chat_request(body, "chat")
        assert (ei.value.param, ei.value.code) == ("model", code)
    for body, param in (
        ({"messages": []}, "model"),
        ({"model": "m", "stream": "yes"}, "stream"),
        ({"model": "m", "messages": [{"content": "hi"}]}, "messages[0]"),
        ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ):
        with pytest.raises(APIError) as ei:
            to_chat_request(body, "chat")
        assert ei.value.param == param


async def test_a_fault_mid_stream_is_one_ollama_error_line(monkeypatch):
    async def broken_run(gw, req, sink):
        await sink.emit(Started())
        await sink.emit(TextDelta(index=0, text="Hel", tokens=1))
        raise RuntimeError("a bug")

    monkeypatch.setattr(response_module, "run_generation", broken_run)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=make_app()), base_url="http://t") as h:
        r = await h.post(
            "/api/chat",
            json={"model": "smol", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer {KEY}"},
        )
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert lines[0]["message"]["content"] == "Hel"
    assert (
        lines[-1] == {"error": lines[-1]["error"], "type": "server_error", "code": None} and len(lines) == 2
    )
