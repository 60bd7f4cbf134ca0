"""Unit-level tests of gateway/observability/ (metrics, the request record, the middleware; no backend).

A small real Starlette app stands in for the request pipeline: its handlers feed the request's
``RecordObserver`` the same typed events a generation run emits (``gateway.generation.events``).
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from backend.protocol import SamplingParams, Stats
from gateway.app import _api_error
from gateway.errors import APIError, ContentFiltered, RateLimited
from gateway.generation.events import ChoiceFinished, Ended, TextDelta
from gateway.generation.request import GenerationRequest
from gateway.observability.access_log import ACCESS_LOGGER_NAME
from gateway.observability.exposition import parse_exposition, sample_sum
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.middleware import ObservabilityMiddleware, valid_request_id
from gateway.observability.record import RecordObserver, get_record

SECRET_KEY = "sk-test-UNIQUEKEY-9f8e7d6c5b4a"
PROMPT = "zebra-quasar-lighthouse distinctive prompt"


def ns(queue: float = 0.0, prefill: float = 0.0, decode: float = 0.0, ttft: float = 0.0) -> dict[str, int]:
    """Backend phases (seconds) as a run's timings (ns, Ollama names)."""
    return {
        "queue_duration": int(queue * 1e9),
        "prompt_eval_duration": int(prefill * 1e9),
        "eval_duration": int(decode * 1e9),
        "backend_ttft_duration": int(ttft * 1e9),
    }


def observer(request: Request, *, prompt: object = None, stream: bool = False) -> RecordObserver:
    req = GenerationRequest(
        request_id="r",
        api="openai",
        model="m",
        prompt_ids=[1],
        sampling=SamplingParams(),
        stream=stream,
        prompt_log=prompt,
    )
    return RecordObserver(get_record(request), req)


async def tokens(obs: RecordObserver, n: int, text: str | None = None) -> None:
    for i in range(n):
        await obs.emit(TextDelta(index=0, text=f"tok{i} " if text is None else text, tokens=1))


async def finish(obs: RecordObserver, reason: str, timings: dict[str, int], **ended: object) -> None:
    await obs.emit(ChoiceFinished(index=0, reason=reason, completion_tokens=0, timings=timings))  # type: ignore[arg-type]
    await obs.emit(Ended(status=200, reason=reason, submitted=True, timings=timings, **ended))  # type: ignore[arg-type]


def make_app(metrics: GatewayMetrics, *, log_content: bool = False):
    async def chat(request: Request):
        body = await request.json()
        obs = observer(request, prompt=body["messages"], stream=bool(body.get("stream")))
        get_record(request).tenant = body.get("tenant", "t1")
        if body.get("rate_limit"):
            raise RateLimited("slow down", type=body["rate_limit"], code="rate_limit_exceeded")
        if body.get("filter"):
            raise ContentFiltered("blocked", result={"hate": {"filtered": True}})
        n = int(body.get("n_tokens", 3))
        await tokens(obs, n)
        timings = ns(queue=0.001, prefill=0.002, decode=0.003, ttft=0.003)
        if "spec" in body:  # speculative decoding: (drafted, accepted), summed over choices by the run
            timings.update(draft_tokens=body["spec"][0], accepted_tokens=body["spec"][1])
        await finish(
            obs,
            body.get("finish", "length"),
            timings,
            prompt_tokens=7,
            completion_tokens=n,
            cached_tokens=body.get("cached", 0),
            preemptions=body.get("preempt", 0),
        )
        return JSONResponse({"ok": True})

    async def abort(request: Request):
        obs = observer(request)
        await tokens(obs, 2)
        # the client "goes away": the run ends as cancelled, before the backend finished the request
        await obs.emit(Ended(status=499, reason="abort", submitted=True, completion_tokens=2))
        return PlainTextResponse("partial")

    async def boom(request: Request):
        raise RuntimeError("boom")

    async def stream(request: Request):
        obs = observer(request, stream=True)

        async def gen():
            for _ in range(4):
                await tokens(obs, 1, text="x")
                yield b"data: x\n\n"
            await finish(obs, "stop", ns(prefill=0.001, decode=0.002), prompt_tokens=5, completion_tokens=4)

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def cut(request: Request):
        """An output filter cut the response after one token: the run ends it as "content_filter"."""
        obs = observer(request)
        await tokens(obs, 1, text="x")
        await finish(obs, "content_filter", ns(prefill=0.001), prompt_tokens=5, completion_tokens=1)
        return JSONResponse(
            {"choices": [{"index": 0, "message": {"content": ""}, "finish_reason": "content_filter"}]}
        )

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/abort", abort),
            Route("/boom", boom),
            Route("/stream", stream),
            Route("/cut", cut),
            Route("/metrics", metrics.endpoint),
        ],
        exception_handlers={APIError: _api_error},
    )
    return ObservabilityMiddleware(app, metrics, log_content=log_content)


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://test"
    )


async def scrape(c: httpx.AsyncClient) -> dict:
    r = await c.get("/metrics")
    assert r.status_code == 200
    return parse_exposition(r.text)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return sample_sum(after, name, **labels) - sample_sum(before, name, **labels)


async def test_request_id_kept_or_made_on_every_response():
    app = make_app(GatewayMetrics())
    async with client(app) as c:
        r = await c.get("/nope", headers={"x-request-id": "abc-123"})
        assert r.status_code == 404 and r.headers["x-request-id"] == "abc-123"
        r = await c.get("/metrics")
        assert r.headers["x-request-id"].startswith("req-")
        r = await c.get("/boom")
        assert r.status_code == 500 and r.headers["x-request-id"].startswith("req-")
        bad = "x" * 300
        r = await c.get("/metrics", headers={"x-request-id": bad})
        assert r.headers["x-request-id"] != bad
    assert valid_request_id("a.b:c/d=e") and not valid_request_id("a b") and not valid_request_id("")


async def test_request_metrics_exact():
    m = GatewayMetrics("m")
    app = make_app(m)
    async with client(app) as c:
        b = await scrape(c)
        msgs = [{"role": "user", "content": "hi"}]
        assert (
            await c.post(
                "/v1/chat/completions", json={"messages": msgs, "n_tokens": 3, "cached": 4, "preempt": 1}
            )
        ).status_code == 200
        assert (
            await c.post("/v1/chat/completions", json={"messages": msgs, "n_tokens": 2, "finish": "stop"})
        ).status_code == 200
        assert (
            await c.post("/v1/chat/completions", json={"messages": msgs, "n_tokens": 0, "finish": "stop"})
        ).status_code == 200
        r = await c.post("/v1/chat/completions", json={"messages": msgs, "rate_limit": "tokens"})
        assert r.status_code == 429
        r = await c.post("/v1/chat/completions", json={"messages": msgs, "rate_limit": "insufficient_quota"})
        assert r.status_code == 429
        r = await c.post("/v1/chat/completions", json={"messages": msgs, "filter": True})
        assert r.status_code == 400
        assert (await c.get("/abort")).status_code == 200
        assert (await c.get("/stream")).status_code == 200
        assert (await c.get("/cut")).status_code == 200
        a = await scrape(c)
    P = "gateway:"
    assert delta(b, a, P + "prompt_tokens_total") == 7 * 3 + 5 + 5
    assert delta(b, a, P + "generation_tokens_total") == 3 + 2 + 0 + 2 + 4 + 1
    assert delta(b, a, P + "prompt_tokens_cached_total") == 4
    assert delta(b, a, P + "request_success_total", finished_reason="length") == 1
    assert delta(b, a, P + "request_success_total", finished_reason="stop") == 3
    assert delta(b, a, P + "request_success_total", finished_reason="abort") == 1
    assert delta(b, a, P + "request_aborts_total") == 1
    assert delta(b, a, P + "rate_limited_requests_total", kind="tokens") == 1
    assert delta(b, a, P + "rate_limited_requests_total", kind="insufficient_quota") == 1
    assert delta(b, a, P + "content_filter_blocks_total", stage="input") == 1
    assert delta(b, a, P + "content_filter_blocks_total", stage="output") == 1
    assert delta(b, a, P + "request_success_total", finished_reason="content_filter") == 1
    assert delta(b, a, P + "http_requests_total", path="/v1/chat/completions", status="200") == 3
    assert delta(b, a, P + "http_requests_total", path="/v1/chat/completions", status="429") == 2
    # one TTFT observation per request that produced a token: 2 chats + abort + stream + cut
    assert delta(b, a, P + "time_to_first_token_seconds_count") == 5
    # ITL: (3-1) + (2-1) + (2-1) + (4-1)
    assert delta(b, a, P + "inter_token_latency_seconds_count") == 7
    assert delta(b, a, P + "e2e_request_latency_seconds_count") == 6
    assert delta(b, a, P + "request_prefill_time_seconds_count") == 5
    assert sample_sum(a, P + "http_requests_in_flight") == 1  # the /metrics scrape itself


async def test_backend_counters_survive_restart_and_gauges():
    m = GatewayMetrics("m")
    polls = [
        Stats(
            running=2,
            waiting=1,
            kv_blocks_used=3,
            kv_blocks_total=12,
            preemptions=4,
            prefix_cache_queries=100,
            prefix_cache_hits=32,
        ),
        Stats(running=0, kv_blocks_total=12, preemptions=1, prefix_cache_queries=10, prefix_cache_hits=0),
    ]

    async def source():
        return polls.pop(0)

    m.set_stats_source(source)
    s1 = parse_exposition((await m.render()).decode())
    assert sample_sum(s1, "gateway:num_requests_running") == 2
    assert sample_sum(s1, "gateway:kv_cache_usage_perc") == pytest.approx(0.25)
    assert sample_sum(s1, "gateway:prefix_cache_hits_total") == 32
    s2 = parse_exposition((await m.render()).decode())  # the backend restarted: counters continue
    assert sample_sum(s2, "gateway:num_preemptions_total") == 5
    assert sample_sum(s2, "gateway:prefix_cache_queries_total") == 110
    assert sample_sum(s2, "gateway:num_requests_running") == 0
    # a new backend process (epoch) that already counted past the old values between two polls
    m.update_backend_stats(Stats(preemptions=1), "b", epoch=0)
    m.update_backend_stats(Stats(preemptions=3), "b", epoch=1)
    assert m.backend.counter_value("preemptions", "b") == 4

    # a failing source does not break rendering
    async def broken():
        raise ConnectionError("backend gone")

    m.set_stats_source(broken)
    assert b"gateway:num_preemptions_total" in await m.render()


async def test_spec_decode_counters_per_backend_and_position():
    m = GatewayMetrics("m")
    m.set_backend_models({"0": "m", "1": "other"})
    m.update_backend_stats(
        Stats(spec_drafts=4, spec_draft_tokens=12, spec_accepted_tokens=7, spec_accepted_per_pos=[4, 2, 1]),
        "0",
    )
    m.update_backend_stats(Stats(spec_drafts=1, spec_draft_tokens=3, spec_accepted_per_pos=[0, 0, 0]), "1")
    s = parse_exposition((await m.render()).decode())
    P = "gateway:spec_decode_"
    assert sample_sum(s, P + "num_drafts_total", backend="0", model_name="m") == 4
    assert sample_sum(s, P + "num_draft_tokens_total") == 15  # both backends
    assert sample_sum(s, P + "num_accepted_tokens_total", backend="0") == 7
    assert sample_sum(s, P + "num_accepted_tokens_total", backend="1", model_name="other") == 0
    pos = {
        dict(lv)["position"]: v
        for (n, lv), v in s.items()
        if n == P + "num_accepted_tokens_per_pos_total" and dict(lv)["backend"] == "0"
    }
    assert pos == {"0": 4, "1": 2, "2": 1}
    assert sample_sum(s, P + "num_accepted_tokens_per_pos_total", backend="1", position="2") == 0
    # a restart (counters lower): every counter of that backend carried over, the positions included, so
    # the sum over positions still equals the accepted total; a new position appears with its own series
    m.update_backend_stats(
        Stats(spec_drafts=5, spec_draft_tokens=2, spec_accepted_tokens=2, spec_accepted_per_pos=[1, 0, 0, 1]),
        "0",
    )
    s = parse_exposition((await m.render()).decode())
    assert sample_sum(s, P + "num_drafts_total", backend="0") == 9  # 4 + 5: it restarted, though 5 > 4
    assert sample_sum(s, P + "num_draft_tokens_total", backend="0") == 14
    accepted = sample_sum(s, P + "num_accepted_tokens_total", backend="0")
    assert accepted == 9 == sample_sum(s, P + "num_accepted_tokens_per_pos_total", backend="0")
    assert sample_sum(s, P + "num_accepted_tokens_per_pos_total", backend="0", position="0") == 5
    assert sample_sum(s, P + "num_accepted_tokens_per_pos_total", backend="0", position="3") == 1
    # an engine without speculative decoding: the counters are there, at zero, and no position series
    m0 = GatewayMetrics("m")
    m0.update_backend_stats(Stats(), "0")
    s0 = parse_exposition((await m0.render()).decode())
    assert s0[(P + "num_drafts_total", (("backend", "0"), ("model_name", "m")))] == 0
    assert not any(n == P + "num_accepted_tokens_per_pos_total" for (n, _) in s0)


async def test_two_apps_one_process_and_tenant_label():
    m1, m2 = GatewayMetrics("m", tenant_label=True, max_tenants=1), GatewayMetrics("m")
    async with client(make_app(m1)) as c1, client(make_app(m2)) as c2:
        for tenant in ("alpha", "beta"):
            await c1.post("/v1/chat/completions", json={"messages": [], "tenant": tenant})
        await c2.post("/v1/chat/completions", json={"messages": []})
        s1, s2 = await scrape(c1), await scrape(c2)
    assert sample_sum(s1, "gateway:prompt_tokens_total", tenant="alpha") == 7
    assert sample_sum(s1, "gateway:prompt_tokens_total", tenant="other") == 7  # past max_tenants
    assert sample_sum(s2, "gateway:prompt_tokens_total") == 7
    assert all("tenant" not in dict(lv) for (n, lv) in s2 if n == "gateway:prompt_tokens_total")


@pytest.mark.parametrize("log_content", [False, True])
async def test_access_log_has_no_key_and_content_only_when_enabled(caplog, log_content):
    app = make_app(GatewayMetrics(), log_content=log_content)
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER_NAME)
    async with client(app) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": PROMPT}], "n_tokens": 2, "spec": [6, 4]},
            headers={"authorization": f"Bearer {SECRET_KEY}", "x-request-id": "rid-42"},
        )
        assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == ACCESS_LOGGER_NAME]
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["request_id"] == "rid-42" and entry["status"] == 200 and entry["tenant"] == "t1"
    assert (
        entry["prompt_tokens"] == 7 and entry["completion_tokens"] == 2 and entry["finish_reason"] == "length"
    )
    assert entry["ttft_s"] is not None and entry["prefill_s"] == 0.002
    assert entry["draft_tokens"] == 6 and entry["accepted_tokens"] == 4
    assert SECRET_KEY not in lines[0]
    assert (PROMPT in lines[0]) is log_content
    assert ("tok1" in lines[0]) is log_content


async def test_tenant_taken_from_auth_principal_when_handler_failed_early(caplog):
    """A request refused before the handler named its tenant (e.g. a blocked prompt) is still logged and counted with it."""
    from auth.principal import Principal
    from ratelimit.core import Limits

    m = GatewayMetrics("m", tenant_label=True)
    inner = make_app(m)

    async def with_principal(scope, receive, send):  # what AuthMiddleware leaves in the scope
        if scope["type"] == "http":
            scope.setdefault("state", {})["principal"] = Principal("tn_x", "x", "key_1", "sk-gw-Ab", Limits())
        await inner.app(scope, receive, send)

    app = ObservabilityMiddleware(with_principal, m, known_paths=["/v1/chat/completions"])
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER_NAME)
    async with client(app) as c:
        r = await c.post("/v1/chat/completions", json={"messages": [], "filter": True, "tenant": None})
        assert r.status_code == 400
    entry = json.loads([r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER_NAME][-1])
    assert entry["tenant"] == "tn_x" and entry["error_code"] == "content_filter"
    s = parse_exposition(generate_latest(m.registry).decode())
    assert sample_sum(s, "gateway:content_filter_blocks_total", tenant="tn_x", stage="input") == 1


async def test_fail_open_admissions_are_read_at_scrape_time():
    m = GatewayMetrics("m")
    assert b"gateway:rate_limiter_fail_open_admissions_total 0.0" in await m.render()
    admitted = [0]
    m.set_fail_open_source(lambda: admitted[0])
    admitted[0] = 3
    assert b"gateway:rate_limiter_fail_open_admissions_total 3.0" in await m.render()
