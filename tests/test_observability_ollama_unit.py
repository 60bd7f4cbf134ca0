"""The Ollama layer (gateway/ollama_api.py) against a stand-in /v1 endpoint, driven by the official ``ollama`` client.

The stand-in answers like the gateway's pipeline does (``gateway.streaming.CallResponse``:
JSON, or SSE chunks ending with a usage chunk and ``[DONE]``) and fills the
``RequestRecord`` with real ``backend.protocol`` Usage/Timings. The end-to-end
test against the real gateway is tests/test_observability_e2e.py.
"""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
from starlette.applications import Starlette
from starlette.requests import Request

from backend.protocol import ModelCard, Timings, Usage
from gateway.errors import APIError, AuthenticationError, RateLimited
from gateway.metrics import GatewayMetrics
from gateway.ollama_api import OllamaAPI, SSEParser, chat_to_openai, generate_to_openai, options_to_openai
from gateway.request_log import ObservabilityMiddleware, get_record
from gateway.streaming import CallResponse

KEY = "sk-ollama-test"
WORDS = ["Hello", " there", "!"]
seen_bodies: list[dict] = []


async def fake_chat_endpoint(request: Request):
    if request.headers.get("authorization") != f"Bearer {KEY}":
        raise AuthenticationError()
    body = await request.json()
    seen_bodies.append(body)
    if body["messages"][-1]["content"] == "limit me":
        raise RateLimited("Too many requests", code="rate_limit_exceeded", headers={"retry-after": "1"})
    rec = get_record(request)
    rec.model = body["model"]
    rec.on_submit(prompt_tokens=11)
    usage = {
        "prompt_tokens": 11,
        "completion_tokens": len(WORDS),
        "total_tokens": 11 + len(WORDS),
        "prompt_tokens_details": {"cached_tokens": 3},
    }

    async def produce(w):
        for t in WORDS:
            rec.on_tokens(1, text=t)
        rec.on_finish(
            "stop",
            Usage(prompt_tokens=11, completion_tokens=len(WORDS), cached_tokens=3),
            Timings(queue=1e-6, prefill=2e-6, decode=3e-6),
        )
        if not body.get("stream"):
            msg = {"role": "assistant", "content": "".join(WORDS)}
            await w.json(
                200,
                {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [{"index": 0, "message": msg, "finish_reason": "stop", "logprobs": None}],
                    "usage": usage,
                },
            )
            return
        await w.start()
        await w.ping()
        for t in WORDS:
            await w.event(
                json.dumps(
                    {"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]}
                ).encode()
            )
        await w.event(json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}).encode())
        await w.event(json.dumps({"choices": [], "usage": usage}).encode())
        await w.done()

    return CallResponse(produce)


async def authenticate(request: Request):
    if request.headers.get("authorization") != f"Bearer {KEY}":
        raise AuthenticationError()


def make_app():
    card = ModelCard(
        name="smol", context_length=2048, quantization="Q4_1", model_path="/nonexistent/smol.gguf"
    )
    api = OllamaAPI(fake_chat_endpoint, lambda: card, authenticate)

    async def api_error(request, exc: APIError):
        from starlette.responses import JSONResponse

        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    app = Starlette(routes=api.routes(), exception_handlers={APIError: api_error})
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
    assert seen_bodies[-1]["stream_options"] == {"include_usage": True}
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
        lines = [
            json.loads(x)
            for x in (
                await h.post(
                    "/api/chat",
                    json={"model": "smol", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"authorization": f"Bearer {KEY}"},
                )
            ).text.splitlines()
        ]
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
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        assert (await h.get("/api/version")).json()["version"]


def test_translation_helpers():
    assert options_to_openai({"num_predict": -1, "num_ctx": 4096, "min_p": 0.1}) == {"min_p": 0.1}
    assert options_to_openai({"presence_penalty": 0.5, "frequency_penalty": 0.25, "top_p": 0.9}) == {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "top_p": 0.9,
    }
    with pytest.raises(APIError):
        options_to_openai({"num_predict": "lots"})
    with pytest.raises(APIError):
        generate_to_openai({"model": "m", "prompt": "x", "raw": True})
    assert chat_to_openai({"model": "m", "messages": [], "stream": False, "tools": []})["stream"] is False
    p = SSEParser()
    assert p.feed(b'data: {"a":1}\n\n: ping\n\ndata: [DO') == [{"a": 1}]
    assert p.feed(b"NE]\n\n") == ["[DONE]"]
