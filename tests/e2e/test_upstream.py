"""Models of kind ``openai`` (``gateway.upstream``): a front gateway proxying a real OpenAI-compatible server.

The upstream is the shared ``gateway`` fixture (a real gateway with its real backend and tenancy); the front
is a second gateway (``start_gateway``, no backend of its own) serving only upstream models from a
``[[models]]`` config:

* ``up``: the upstream's model (no tokenizer here: the reservation is the documented estimate);
* ``up-limited``: the same, through an upstream key whose tenant allows 1 request a minute (upstream 429);
* ``down``: a URL where nothing listens (503 ``upstream_unavailable``, fast);
* ``failover``: that URL first, then the upstream's (failover before the first byte).

Checked: chat with the official openai client, streamed and not, the same greedy text as the upstream
itself; usage in the front's ledger (admin usage API) as the upstream counted it; the front's tenant limits
(429); an upstream 429 with its retry-after; an upstream 400 with its param; a streaming output filter
cutting the upstream's text; a client leaving mid-stream closes the upstream request (the upstream's
``running`` returns to 0); the Ollama API (/api/chat) for an upstream model.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import openai
import pytest
from plugins.gateway_server import GatewayProc, free_port, start_gateway

COUNT = "Count from 1 to 10, one number per line."
CUT_AT_THREE = {  # greedy COUNT starts "1. 1\n2. 2\n3. ..." with the default model: cut at the first "3"
    "output_window": 8,
    "hooks": [
        {
            "type": "blocklist",
            "name": "no-threes",
            "patterns": ["3"],
            "stages": ["output"],
            "category": "digits",
        }
    ],
}


def _tenant(gp: GatewayProc, *, limits: dict | None = None, filters: dict | None = None) -> tuple[str, str]:
    """A new tenant of ``gp`` (with ``limits``/``filters``) and one key: ``(tenant_id, key)``."""
    body: dict = {"name": "upstream-test-" + os.urandom(4).hex()}
    if limits is not None:
        body["limits"] = limits
    if filters is not None:
        body["filters"] = filters
    r = httpx.post(gp.base_url + "/admin/v1/tenants", json=body, headers=gp.admin_headers(), timeout=30)
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    r = httpx.post(
        gp.base_url + f"/admin/v1/tenants/{tid}/keys",
        json={"name": "t"},
        headers=gp.admin_headers(),
        timeout=30,
    )
    assert r.status_code == 201, r.text
    return tid, r.json()["key"]


@pytest.fixture(scope="module")
def front(gateway):
    """The front gateway; ``extra``: the upstream (``up``) and the models' names."""
    _, limited_key = _tenant(gateway, limits={"rpm": 1})
    closed = f"http://127.0.0.1:{free_port()}/v1"  # bound once, now nothing listens there
    real = f"{gateway.base_url}/v1"

    def model(name: str, urls: list[str], key_env: str) -> str:
        quoted = ", ".join(f'"{u}"' for u in urls)
        return (
            f'[[models]]\nname = "{name}"\nkind = "openai"\nurls = [{quoted}]\n'
            f'upstream_model = "{gateway.model}"\napi_key_env = "{key_env}"\nconnect_timeout = 2.0\n\n'
        )

    cfg = Path(gateway.tmpdir) / f"front-{os.urandom(3).hex()}.toml"
    cfg.write_text(
        model("up", [real], "UP_KEY")
        + model("up-limited", [real], "UP_LIMITED_KEY")
        + model("down", [closed], "UP_KEY")
        + model("failover", [closed, real], "UP_KEY")
    )
    env = {"UP_KEY": gateway.api_key, "UP_LIMITED_KEY": limited_key}
    gp = start_gateway("--config", str(cfg), env=env, dtype=None)
    gp.extra["upstream"] = gateway
    try:
        yield gp
    finally:
        gp.stop()


def _client(gp: GatewayProc, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=gp.base_url + "/v1", api_key=key or gp.api_key, max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, model: str, n: int = 6, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": COUNT}], max_tokens=n, temperature=0, **kw
    )


def test_chat_streamed_and_not_is_the_upstreams_text(front):
    up = front.extra["upstream"]
    direct = _chat(up.openai(), up.model)
    r = _chat(_client(front), "up")
    assert r.model == "up"
    assert r.choices[0].message.content == direct.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (direct.usage.prompt_tokens, 6)
    chunks = list(_chat(_client(front), "up", stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_usage_is_in_the_front_ledger(front):
    tid, key = _tenant(front)
    r = _chat(_client(front, key), "up", n=4)
    deadline = time.monotonic() + 10
    while True:
        u = httpx.get(
            front.base_url + f"/admin/v1/tenants/{tid}/usage", headers=front.admin_headers(), timeout=30
        ).json()["totals"]
        if u["requests"] >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert u["requests"] == 1
    assert (u["prompt_tokens"], u["completion_tokens"]) == (r.usage.prompt_tokens, 4)


def test_front_tenant_limits(front):
    _, key = _tenant(front, limits={"rpm": 1})
    _chat(_client(front, key), "up", n=1)
    with pytest.raises(openai.RateLimitError) as e:
        _chat(_client(front, key), "up", n=1)
    assert e.value.body["code"] == "rate_limit_exceeded"


def test_upstream_429_keeps_its_retry_after(front):
    client = _client(front)
    statuses, last = [], None
    for _ in range(2):  # the upstream tenant allows one request a minute
        try:
            _chat(client, "up-limited", n=1)
            statuses.append(200)
        except openai.RateLimitError as exc:
            statuses.append(429)
            last = exc
    assert statuses == [200, 429]
    assert int(last.response.headers["retry-after"]) >= 1
    assert last.body["code"] == "rate_limit_exceeded"


def test_upstream_400_keeps_status_and_param(front):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(_client(front), "up", top_p=7.0)
    assert e.value.body["param"] == "top_p"
    assert e.value.body["code"]


def test_streaming_output_filter_cuts_the_upstream_text(front):
    _, key = _tenant(front, filters=CUT_AT_THREE)
    chunks = list(_chat(_client(front, key), "up", n=40, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "1" in text and "3" not in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "content_filter"
    ]


def test_client_leaving_mid_stream_closes_the_upstream_request(front):
    up = front.extra["upstream"]
    aborts = up.stats()["aborts"]
    body = {
        "model": "up",
        "messages": [{"role": "user", "content": COUNT}],
        "max_tokens": 400,
        "stream": True,
    }
    with httpx.stream(
        "POST", front.base_url + "/v1/chat/completions", json=body, headers=front.headers(), timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break  # the first text: the upstream is generating (400 tokens: minutes on CPU)
    deadline = time.monotonic() + 15
    st = up.stats()
    while time.monotonic() < deadline and not (st["aborts"] > aborts and st["running"] == 0):
        time.sleep(0.05)
        st = up.stats()
    assert st["aborts"] > aborts and st["running"] == 0 and st["waiting"] == 0, st


def test_unreachable_upstream_fails_fast_and_failover_serves(front):
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        _chat(_client(front), "down", n=1)
    assert time.monotonic() - t0 < 3.0
    assert e.value.status_code == 503 and e.value.body["code"] == "upstream_unavailable"
    r = _chat(_client(front), "failover", n=2)
    assert r.choices[0].message.content and r.usage.completion_tokens == 2


def test_ollama_chat_for_an_upstream_model(front):
    import ollama

    c = ollama.Client(host=front.base_url, headers=front.headers(), timeout=120)
    r = c.chat(
        model="up",
        messages=[{"role": "user", "content": COUNT}],
        options={"num_predict": 4, "temperature": 0},
    )
    assert r.message.content and r.done_reason == "length"
    assert r.eval_count == 4
