"""Models of kind ``openai`` (``gateway.upstream``): a front gateway proxying a real OpenAI-compatible server.

The upstream is the shared ``gateway`` fixture (a real gateway with its real backend and tenancy); the front
is a second gateway (``start_gateway``, no backend of its own) serving only upstream models from a
``[[models]]`` config:

* ``up``: the upstream's model (no tokenizer here: the reservation is the documented estimate);
* ``up-limited``: the same, through an upstream key whose tenant allows 1 request a minute (upstream 429);
* ``down``: a URL where nothing listens (503 ``upstream_unavailable``, fast);
* ``failover``: that URL first, then the upstream's (failover before the first byte);
* ``up-prompt``: the upstream's model with ``send = "prompt"`` (the front renders the chat template of the
  default model's tokenizer and calls /v1/completions);
* ``scripted``: a scripted OpenAI-compatible server in this process (``Scripted``: tool calls, an answer
  without usage, one that breaks off, a 500), and ``fail-then-up``: it first, then the real upstream;
* ``scripted-tls``: the same server over https with a self-signed certificate given as ``ca_file``, and
  ``scripted-tls-untrusted``: without it.

Checked: chat with the official openai client, streamed and not, the same greedy text as the upstream
itself; usage in the front's ledger (admin usage API) as the upstream counted it; the front's tenant limits
(429); an upstream 429 with its retry-after; an upstream 400 with its param; a streaming output filter
cutting the upstream's text; a client leaving mid-stream closes the upstream request (the upstream's
``running`` returns to 0; the front's ledger row is a 499 "abort"); the Ollama API (/api/chat) for an
upstream model; tool calls and the request's fields passed through; usage the upstream omits counted here
and marked estimated in the ledger row; an answer broken off mid-stream as an SSE error event; a 5xx as
502, and failover past it; /v1/completions.
"""

from __future__ import annotations

import json
import os
import sqlite3
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
from plugins.gateway_server import GatewayProc, free_port, start_gateway
from plugins.redis_server import self_signed
from test_filters_http import new_tenant

from backend.model_path import default_model_path

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
    return new_tenant(gp, "upstream", limits=limits, filters=filters)


def _chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    obj = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
SCRIPTS = {  # the last user message -> what the scripted upstream streams
    "no usage": [_chunk({"role": "assistant", "content": "Hello"}), _chunk({"content": " there"}, "stop")],
    "break off": [_chunk({"role": "assistant", "content": "Hello"}), _chunk({"content": " there"})],
    "call": [
        _chunk({"role": "assistant", "tool_calls": [CALL]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, "tool_calls"),
        _chunk(usage={"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29}),
    ],
}


class Scripted(BaseHTTPRequestHandler):
    """A scripted OpenAI-compatible server (``ThreadingHTTPServer``): ``SCRIPTS`` by the last message; "fail"
    is a 500. Every body received is kept in ``server.bodies``, its ``x-request-id`` in ``server.request_ids``."""

    protocol_version = "HTTP/1.0"  # the answer ends when the connection closes

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.bodies.append(body)  # type: ignore[attr-defined]
        self.server.request_ids.append(self.headers.get("x-request-id"))  # type: ignore[attr-defined]
        said = body["messages"][-1]["content"]
        if said not in SCRIPTS:
            self.send_response(500)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "scripted failure", "type": "server_error"}}')
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for part in SCRIPTS[said]:
            self.wfile.write(part)
            self.wfile.flush()
        if said != "break off":
            self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def front(gateway):
    """The front gateway; ``extra``: the upstream gateway and the bodies the scripted server received."""
    _, limited_key = _tenant(gateway, limits={"rpm": 1})
    closed = f"http://127.0.0.1:{free_port()}/v1"  # bound once, now nothing listens there
    real = f"{gateway.base_url}/v1"
    scripted = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    scripted.bodies, scripted.request_ids = [], []  # type: ignore[attr-defined]
    threading.Thread(target=scripted.serve_forever, daemon=True).start()
    fake = f"http://127.0.0.1:{scripted.server_address[1]}/v1"
    tls = self_signed(Path(gateway.tmpdir))
    secure = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    secure.bodies, secure.request_ids = [], []  # type: ignore[attr-defined]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls.cert, tls.key)
    secure.socket = ctx.wrap_socket(secure.socket, server_side=True)
    threading.Thread(target=secure.serve_forever, daemon=True).start()
    https = f"https://127.0.0.1:{secure.server_address[1]}/v1"

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
        + model("up-prompt", [real], "UP_KEY")
        + f'send = "prompt"\ntokenizer = "{default_model_path()}"\n\n'
        + model("scripted", [fake], "UP_KEY")
        + model("fail-then-up", [fake, real], "UP_KEY")
        + model("scripted-tls", [https], "UP_KEY")
        + f'ca_file = "{tls.cert}"\n\n'
        + model("scripted-tls-untrusted", [https], "UP_KEY")
    )
    env = {"UP_KEY": gateway.api_key, "UP_LIMITED_KEY": limited_key}
    gp = start_gateway("--config", str(cfg), env=env, dtype=None)
    gp.extra["upstream"] = gateway
    gp.extra["scripted"] = scripted.bodies  # type: ignore[attr-defined]
    gp.extra["request_ids"] = scripted.request_ids  # type: ignore[attr-defined]
    try:
        yield gp
    finally:
        gp.stop()
        scripted.shutdown()
        secure.shutdown()


def _client(gp: GatewayProc, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=gp.base_url + "/v1", api_key=key or gp.api_key, max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, model: str, tokens: int = 6, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": COUNT}], max_tokens=tokens, temperature=0, **kw
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
    r = _chat(_client(front, key), "up", tokens=4)
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
    _chat(_client(front, key), "up", tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        _chat(_client(front, key), "up", tokens=1)
    assert e.value.body["code"] == "rate_limit_exceeded"


def test_upstream_429_keeps_its_retry_after(front):
    client = _client(front)
    statuses, last = [], None
    for _ in range(2):  # the upstream tenant allows one request a minute
        try:
            _chat(client, "up-limited", tokens=1)
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
    chunks = list(_chat(_client(front, key), "up", tokens=40, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "1" in text and "3" not in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "content_filter"
    ]


def test_client_leaving_mid_stream_closes_the_upstream_request(front):
    up = front.extra["upstream"]
    aborts = up.stats()["aborts"]
    tid, key = _tenant(front)
    body = {
        "model": "up",
        "messages": [{"role": "user", "content": COUNT}],
        "max_tokens": 400,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        front.base_url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
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
    rows: list = []  # the front's ledger: the client left (499, "abort"), not an error of the gateway
    while time.monotonic() < deadline and not rows:
        httpx.get(
            front.base_url + f"/admin/v1/tenants/{tid}/usage", headers=front.admin_headers(), timeout=30
        )
        with sqlite3.connect(f"file:{Path(front.tmpdir) / 'tenancy.sqlite'}?mode=ro", uri=True) as db:
            rows = db.execute(
                "SELECT status, finish_reason FROM usage WHERE tenant_id = ?", (tid,)
            ).fetchall()
        time.sleep(0.05)
    assert rows == [(499, "abort")]


def test_unreachable_upstream_fails_fast_and_failover_serves(front):
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        _chat(_client(front), "down", tokens=1)
    assert time.monotonic() - t0 < 3.0
    assert e.value.status_code == 503 and e.value.body["code"] == "upstream_unavailable"
    r = _chat(_client(front), "failover", tokens=2)
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
    shown = c.show("up")  # no model file here: no format or quantization; the upstream's context length
    assert shown.details.format == "" and shown.details.quantization_level == ""
    assert shown.modelinfo["openai.context_length"] == 8192
    assert shown.modelinfo == {"general.architecture": "openai", "openai.context_length": 8192}  # no dtype...


def _ask(client: openai.OpenAI, model: str, said: str, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": said}], **kw)


def test_tool_calls_and_fields_pass_through(front):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = _ask(_client(front), "scripted", "call", tools=tools, tool_choice="auto", seed=7, max_tokens=30)
    sent = front.extra["scripted"][-1]
    assert sent["model"] == front.extra["upstream"].model and sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert (sent["tools"], sent["tool_choice"], sent["seed"], sent["max_tokens"]) == (tools, "auto", 7, 30)
    assert "inspect" not in sent and "n" not in sent  # the gateway's own field; defaults are not sent
    assert front.extra["request_ids"][-1] == r.id  # the upstream's logs name the response's id
    call = r.choices[0].message.tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == (
        "call_1",
        "get_weather",
        '{"city": "Paris"}',
    )
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens == 9


def test_usage_the_upstream_omits_is_estimated(front):
    tid, key = _tenant(front)
    r = _ask(_client(front, key), "scripted", "no usage")
    assert r.choices[0].message.content == "Hello there" and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    httpx.get(front.base_url + f"/admin/v1/tenants/{tid}/usage", headers=front.admin_headers(), timeout=30)
    with sqlite3.connect(f"file:{Path(front.tmpdir) / 'tenancy.sqlite'}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT completion_tokens, timings FROM usage WHERE tenant_id = ?", (tid,)
        ).fetchall()
    assert [(c, json.loads(t).get("usage_estimated")) for c, t in rows] == [(r.usage.completion_tokens, 1.0)]


def test_upstream_breaking_off_mid_stream_is_an_sse_error(front):
    lines = []
    body = {"model": "scripted", "messages": [{"role": "user", "content": "break off"}], "stream": True}
    with httpx.stream(
        "POST", front.base_url + "/v1/chat/completions", json=body, headers=front.headers(), timeout=30
    ) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert (
        "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices"))
        == "Hello there"
    )
    assert events[-1]["error"]["code"] == "upstream_error"


def test_upstream_5xx_fails_over_and_alone_is_a_502(front):
    with pytest.raises(openai.APIStatusError) as e:
        _ask(_client(front), "scripted", "fail")
    assert e.value.status_code == 502 and e.value.body["code"] == "upstream_error"
    r = _chat(
        _client(front), "fail-then-up", tokens=2
    )  # COUNT is not scripted: a 500, then the real upstream
    assert r.choices[0].message.content and r.usage.completion_tokens == 2


def test_legacy_completions_pass_through(front):
    up = front.extra["upstream"]
    direct = up.openai().completions.create(
        model=up.model, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    r = _client(front).completions.create(
        model="up", prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert r.choices[0].text == direct.choices[0].text and r.usage.completion_tokens == 4
    assert r.usage.prompt_tokens == direct.usage.prompt_tokens


def test_send_prompt_renders_here_and_gives_the_same_answer(front):
    up = front.extra["upstream"]
    direct = _chat(up.openai(), up.model, tokens=5)
    r = _chat(_client(front), "up-prompt", tokens=5)
    assert r.choices[0].message.content == direct.choices[0].message.content
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (direct.usage.prompt_tokens, 5)


def test_https_upstream_verified_with_its_ca_file(front):
    r = _ask(_client(front), "scripted-tls", "no usage")
    assert r.choices[0].message.content == "Hello there"
    with pytest.raises(openai.APIStatusError) as e:  # the system's CAs do not know the certificate
        _ask(_client(front), "scripted-tls-untrusted", "no usage")
    assert e.value.status_code == 503 and e.value.body["code"] == "upstream_unavailable"


def test_several_choices(front):
    r = _chat(_client(front), "up", 3, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: the same text twice
    assert [c.finish_reason for c in r.choices] == ["length", "length"] and r.usage.completion_tokens == 6
