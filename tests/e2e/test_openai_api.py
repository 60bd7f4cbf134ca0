"""Gateway HTTP API against a real server + backend: shapes, validation errors, limits, SSE framing.

Uses the session ``gateway`` fixture (tests/plugins/gateway_server.py). Requests are small (few tokens).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from plugins.gateway_server import chat_body, post_json, stream_post

CHAT = "/v1/chat/completions"


def _err(r: httpx.Response, status: int, param: str | None = "__any__", code: str | None = "__any__") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if param != "__any__":
        assert err["param"] == param, err
    if code != "__any__":
        assert err["code"] == code, err
    return err


def test_health_ready_models(gateway):
    assert httpx.get(gateway.base_url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(gateway.base_url + "/readyz").status_code == 200
    models = httpx.get(gateway.base_url + "/v1/models", headers=gateway.headers()).json()
    assert models["object"] == "list"
    m = models["data"][0]
    assert m["object"] == "model" and m["id"] == gateway.model
    for k in ("context_length", "quantization", "device", "attention_backend"):
        assert k in m
    assert m["context_length"] > 0 and m["quantization"] == "Q4_1"
    # the official client sees the same
    assert gateway.openai().models.list().data[0].id == gateway.model


def test_admin_stats(gateway):
    st = gateway.stats()
    for k in (
        "running",
        "waiting",
        "kv_blocks_used",
        "kv_blocks_total",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "preemptions",
        "aborts",
        "device",
        "attention_backend",
    ):
        assert k in st, k
    assert st["kv_blocks_total"] > 0
    assert httpx.get(gateway.base_url + "/admin/v1/stats").status_code == 401
    r = httpx.get(gateway.base_url + "/admin/v1/stats", headers={"Authorization": "Bearer nope"})
    assert r.status_code in (401, 403)


def test_nonstream_shape_and_timings(gateway):
    r = post_json(gateway, CHAT, chat_body(gateway, "Say hi.", max_tokens=4, temperature=0))
    assert r.status_code == 200, r.text
    d = r.json()
    assert (
        d["id"].startswith("chatcmpl-") and d["object"] == "chat.completion" and d["model"] == gateway.model
    )
    assert isinstance(d["created"], int)
    (c,) = d["choices"]
    assert (
        c["index"] == 0 and c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
    )
    assert c["finish_reason"] in ("stop", "length")
    u = d["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert "cached_tokens" in u["prompt_tokens_details"]
    t = d["timings"]
    for k in (
        "prompt_eval_duration",
        "eval_duration",
        "total_duration",
        "backend_ttft_duration",
        "ttft_duration",
    ):
        assert isinstance(t[k], int) and t[k] >= 0, k
    assert t["total_duration"] >= t["ttft_duration"] >= t["backend_ttft_duration"]


def test_stream_headers_and_chunks(gateway):
    res = stream_post(
        gateway,
        CHAT,
        chat_body(gateway, "Say hi.", max_tokens=4, temperature=0, stream_options={"include_usage": True}),
    )
    assert res.status == 200
    assert res.headers["content-type"].startswith("text/event-stream")
    assert res.headers["cache-control"] == "no-cache"
    assert res.headers["x-accel-buffering"] == "no"
    assert res.done
    first = res.events[0]
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    ids = {e["id"] for e in res.events}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    usage = res.events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert "cached_tokens" in usage["usage"]["prompt_tokens_details"]
    assert "backend_ttft_duration" in usage["timings"]
    # without include_usage: no usage chunk
    res2 = stream_post(gateway, CHAT, chat_body(gateway, "Say hi.", max_tokens=2, temperature=0))
    assert res2.done and all("usage" not in e for e in res2.events) and all(e["choices"] for e in res2.events)


def test_logprobs_shape(gateway):
    r = post_json(
        gateway,
        CHAT,
        chat_body(gateway, "Say hi.", max_tokens=3, temperature=0, logprobs=True, top_logprobs=2),
    )
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for item in content:
        assert isinstance(item["token"], str) and item["logprob"] <= 0 and isinstance(item["bytes"], list)
        assert len(item["top_logprobs"]) == 2
        for alt in item["top_logprobs"]:
            assert set(alt) == {"token", "logprob", "bytes"}
        # greedy: the chosen token is the most likely one
        assert item["logprob"] >= item["top_logprobs"][0]["logprob"] - 1e-4
    res = stream_post(
        gateway,
        CHAT,
        chat_body(gateway, "Say hi.", max_tokens=3, temperature=0, logprobs=True, top_logprobs=1),
    )
    toks = [lp for e in res.events for c in e["choices"] if c["logprobs"] for lp in c["logprobs"]["content"]]
    assert [t["token"] for t in toks] == [t["token"] for t in content]


def test_completions_endpoint(gateway):
    body = {"model": gateway.model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    r = post_json(gateway, "/v1/completions", body)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "text_completion" and d["id"].startswith("cmpl-")
    text = d["choices"][0]["text"]
    assert d["usage"]["completion_tokens"] == 4
    res = stream_post(gateway, "/v1/completions", body)
    assert res.done and "".join(c["text"] for e in res.events for c in e["choices"]) == text
    r = post_json(gateway, "/v1/completions", {**body, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    # the official client parses it
    out = gateway.openai().completions.create(
        model=gateway.model, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert out.choices[0].text == text


# ----------------------------------------------------------------------------- errors (no generation)


def test_malformed_json_and_types(gateway):
    _err(post_json(gateway, CHAT, b'{"model": "x", "messages": ['), 400, code="invalid_json")
    _err(post_json(gateway, CHAT, b""), 400)
    _err(post_json(gateway, CHAT, {"model": gateway.model, "messages": "hi"}), 400, param="messages")
    _err(post_json(gateway, CHAT, chat_body(gateway, "hi", max_tokens="5")), 400, param="max_tokens")
    _err(post_json(gateway, CHAT, chat_body(gateway, "hi", stream="yes")), 400, param="stream")
    _err(post_json(gateway, CHAT, chat_body(gateway, "hi", temperature=[1])), 400, param="temperature")
    _err(post_json(gateway, CHAT, {"messages": [{"role": "user", "content": "hi"}]}), 400)
    _err(
        post_json(gateway, CHAT, chat_body(gateway, messages=[{"role": "user", "content": 5}])),
        400,
        param="messages[0].content",
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("n", 17),
        ("temperature", 2.5),
        ("temperature", -0.1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("seed", 2**64),
        ("max_completion_tokens", 0),
    ],
)
def test_out_of_range_names_param(gateway, field, value):
    _err(post_json(gateway, CHAT, chat_body(gateway, "hi", **{field: value})), 400, param=field)


def test_logprob_limits(gateway):
    _err(
        post_json(gateway, CHAT, chat_body(gateway, "hi", logprobs=True, top_logprobs=21)),
        400,
        param="top_logprobs",
    )
    _err(post_json(gateway, CHAT, chat_body(gateway, "hi", top_logprobs=2)), 400, param="top_logprobs")
    _err(
        post_json(gateway, CHAT, chat_body(gateway, "hi", stream_options={"include_usage": True})),
        400,
        param="stream_options",
    )
    _err(
        post_json(gateway, "/v1/completions", {"model": gateway.model, "prompt": "x", "logprobs": 6}),
        400,
        param="logprobs",
    )


def test_unknown_model_and_route(gateway):
    r = post_json(gateway, CHAT, {"model": "gpt-nope", "messages": [{"role": "user", "content": "hi"}]})
    _err(r, 404, param="model", code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        gateway.openai().chat.completions.create(
            model="gpt-nope", messages=[{"role": "user", "content": "hi"}]
        )
    _err(httpx.get(gateway.base_url + "/v1/nothing-here", headers=gateway.headers()), 404)
    assert httpx.get(gateway.base_url + CHAT, headers=gateway.headers()).status_code == 405
    # without a key, tenancy answers 401 before routing (docs/tenancy.md)
    assert httpx.post(gateway.base_url + CHAT, json={}).status_code == 401


def test_body_too_large(gateway):
    big = json.dumps(chat_body(gateway, "x" * (5 * 1024 * 1024))).encode()
    _err(post_json(gateway, CHAT, big), 413)

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    # chunked transfer encoding: no Content-Length, counted while reading
    r = httpx.post(
        gateway.base_url + CHAT,
        content=chunks(),
        headers={"Content-Type": "application/json", **gateway.headers()},
        timeout=60,
    )
    _err(r, 413)


def test_validation_errors_never_start_a_stream(gateway):
    # a validation error on a stream request (n 0) -> 400 JSON, no event stream
    res = stream_post(gateway, CHAT, chat_body(gateway, "hi", n=0))
    assert res.status == 400 and json.loads(res.body)["error"]["param"] == "n"
    assert not res.headers["content-type"].startswith("text/event-stream")


def test_cors_preflight_needs_no_key_and_errors_carry_cors_headers(gateway):
    """OPTIONS preflight is 204 with CORS headers and needs no auth; 401s carry CORS headers; streams
    carry X-Accel-Buffering: no and Cache-Control: no-cache (checked in test_stream_headers_and_chunks)."""
    origin = "http://example.test"
    r = httpx.options(
        gateway.base_url + CHAT,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert r.status_code == 204
    assert r.headers.get("access-control-allow-origin") in ("*", origin)
    assert "authorization" in r.headers.get("access-control-allow-headers", "").lower()
    r = httpx.post(
        gateway.base_url + CHAT,
        json=chat_body(gateway, "hi"),
        headers={"Origin": origin, "Authorization": "Bearer wrong"},
    )
    assert r.status_code == 401 and r.headers.get("access-control-allow-origin") in ("*", origin)
    res = stream_post(gateway, CHAT, chat_body(gateway, "hi", max_tokens=1))
    assert res.headers["x-accel-buffering"] == "no" and res.headers["cache-control"] == "no-cache"
