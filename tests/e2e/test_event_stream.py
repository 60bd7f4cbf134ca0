"""One event stream feeds every API: the same greedy request (float32, temperature 0, 24 tokens) through
/v1/chat/completions (stream and not), /v1/completions (the chat-templated prompt as token ids) and
/api/chat gives the same text and the same token counts, and moves the /metrics request counters by
exactly one request each. Real gateway and backend (the shared ``gateway`` fixture, float32)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from backend.model_path import default_model_path
from gateway.observability.exposition import parse_exposition, sample_sum
from templating import ChatTemplate, cached_tokenizer

pytestmark = pytest.mark.slow

P = "gateway:"
MESSAGES = [{"role": "user", "content": "Name three colors of the rainbow."}]
MAX_TOKENS = 24


def _scrape(gp) -> dict:
    r = httpx.get(gp.base_url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return parse_exposition(r.text)


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return sample_sum(after, name, **labels) - sample_sum(before, name, **labels)


def _counted(gp, before: dict, path: str) -> dict:
    """The scrape once the request to ``path`` is counted (the count lands as its response ends)."""
    deadline = time.monotonic() + 30
    while True:
        after = _scrape(gp)
        if _delta(before, after, P + "http_requests_total", path=path, status="200") >= 1:
            return after
        assert time.monotonic() < deadline, f"{path} never counted"
        time.sleep(0.05)


def _chat(gp) -> tuple[str, int, int, str]:
    body = {"model": gp.model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(gp.base_url + "/v1/chat/completions", json=body, headers=gp.headers(), timeout=300)
    assert r.status_code == 200, r.text
    d = r.json()
    u = d["usage"]
    return (
        d["choices"][0]["message"]["content"],
        u["prompt_tokens"],
        u["completion_tokens"],
        d["choices"][0]["finish_reason"],
    )


def _chat_stream(gp) -> tuple[str, int, int, str]:
    body = {
        "model": gp.model,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage, reason = [], None, None
    url = gp.base_url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=gp.headers(), timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                text.append(c["delta"].get("content") or "")
                reason = c["finish_reason"] or reason
            usage = chunk.get("usage") or usage
    assert usage is not None
    return "".join(text), usage["prompt_tokens"], usage["completion_tokens"], reason


def _completion(gp, prompt_ids: list[int]) -> tuple[str, int, int, str]:
    body = {"model": gp.model, "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(gp.base_url + "/v1/completions", json=body, headers=gp.headers(), timeout=300)
    assert r.status_code == 200, r.text
    d = r.json()
    u = d["usage"]
    return (
        d["choices"][0]["text"],
        u["prompt_tokens"],
        u["completion_tokens"],
        d["choices"][0]["finish_reason"],
    )


def _ollama_chat(gp) -> tuple[str, int, int, str]:
    body = {
        "model": gp.model,
        "messages": MESSAGES,
        "stream": False,
        "options": {"num_predict": MAX_TOKENS, "temperature": 0},
    }
    r = httpx.post(gp.base_url + "/api/chat", json=body, headers=gp.headers(), timeout=300)
    assert r.status_code == 200, r.text
    d = r.json()
    return d["message"]["content"], d["prompt_eval_count"], d["eval_count"], d["done_reason"]


def test_one_event_stream_feeds_every_api(gateway):
    gp = gateway
    prompt_ids = ChatTemplate(cached_tokenizer(default_model_path())).render(MESSAGES).ids
    calls = [
        ("/v1/chat/completions", lambda: _chat(gp)),
        ("/v1/chat/completions", lambda: _chat_stream(gp)),
        ("/v1/completions", lambda: _completion(gp, prompt_ids)),
        ("/api/chat", lambda: _ollama_chat(gp)),
    ]
    results = []
    gp.wait_idle(120)  # what earlier tests left running must not count in our windows
    for path, call in calls:
        before = _scrape(gp)
        text, prompt_tokens, completion_tokens, reason = call()
        after = _counted(gp, before, path)
        results.append((text, prompt_tokens, completion_tokens))
        # exactly one request each, counted with the tokens it reported
        assert _delta(before, after, P + "http_requests_total", path=path, status="200") == 1, path
        assert _delta(before, after, P + "request_success_total") == 1, path
        assert _delta(before, after, P + "request_success_total", finished_reason=reason) == 1, path
        assert _delta(before, after, P + "e2e_request_latency_seconds_count") == 1, path
        assert _delta(before, after, P + "time_to_first_token_seconds_count") == 1, path
        assert _delta(before, after, P + "prompt_tokens_total") == prompt_tokens, path
        assert _delta(before, after, P + "generation_tokens_total") == completion_tokens, path
    text, prompt_tokens, completion_tokens = results[0]
    assert text and prompt_tokens == len(prompt_ids) and 1 <= completion_tokens <= MAX_TOKENS
    assert all(r == results[0] for r in results), results
