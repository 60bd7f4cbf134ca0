"""Grammars that crashed llguidance cannot take the gateway down, nor slow the other tenants.

While 8 other tenants stream, one tenant sends the inputs that overflowed llguidance's compiler stack
(SIGSEGV: the gateway died with -11, its backend with it): an object ``$ref`` chain of 1,000 links through
``properties`` (75 KB) as OpenAI ``response_format`` and as Ollama ``format``, and Lark chains of 3,000 and
5,000 rules as vLLM ``structured_outputs.grammar``; then a grammar that makes its check worker abort (the
test-only fault of the shared gateway, ``SHARED_GRAMMAR_ABORT``). Each is a 400 naming its parameter; the
gateway and backend pids do not change; every stream completes; ``/health`` answers within 200 ms
throughout; and a good grammar is served afterwards (the aborted worker was replaced).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

# conftest.SHARED_GRAMMAR_ABORT: a grammar holding it aborts the shared fault gateway's check worker
SHARED_GRAMMAR_ABORT = "grammar-worker-abort-fault-test"

STREAMS = 8
MAX_TOKENS = 32
HEALTH_EVERY_S = 0.05
HEALTH_LIMIT_S = 0.2

pytestmark = pytest.mark.timeout(120)


def props_chain(n: int) -> dict:
    defs: dict = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def _stream(gp, out: dict, started: threading.Event) -> None:
    body = {
        "model": gp.model,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", gp.base_url + "/v1/chat/completions", json=body, headers=gp.headers(), timeout=60
    ) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                started.set()
                for c in json.loads(line[6:]).get("choices", []):
                    out["finish"] = c.get("finish_reason") or out.get("finish")
    out["end"] = time.monotonic()


def _poll_health(gp, stop: threading.Event, lat: list[float]) -> None:
    with httpx.Client(base_url=gp.base_url, timeout=10) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            assert c.get("/health").status_code == 200
            lat.append(time.monotonic() - t0)
            stop.wait(HEALTH_EVERY_S)


def test_crashing_grammars_are_400s_and_harm_nobody(borrow_gateway):
    views = [borrow_gateway() for _ in range(STREAMS + 1)]  # one tenant each
    gp, others = views[0], views[1:]
    gateway_pid, backend_pid = gp.proc.pid, gp.backend_pid()
    schema = props_chain(1000)
    assert 70_000 < len(json.dumps(schema)) < 128 * 1024
    chat = "/v1/chat/completions"
    base = {"model": gp.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    ollama = {"model": gp.model, "messages": base["messages"], "stream": False, "options": {"num_predict": 4}}
    rf = {"type": "json_schema", "json_schema": {"name": "chain", "schema": schema}}
    attacks = [
        ("response_format", chat, {**base, "response_format": rf}),
        ("format", "/api/chat", {**ollama, "format": schema}),
        ("structured_outputs", chat, {**base, "structured_outputs": {"grammar": lark_chain(3000)}}),
        ("structured_outputs", chat, {**base, "structured_outputs": {"grammar": lark_chain(5000)}}),
        (
            "structured_outputs",
            chat,
            {**base, "structured_outputs": {"grammar": f'start: "{SHARED_GRAMMAR_ABORT}"'}},
        ),
    ]
    results = [{} for _ in others]
    started = [threading.Event() for _ in others]
    threads = [threading.Thread(target=_stream, args=a) for a in zip(others, results, started)]
    stop, health = threading.Event(), []
    poller = threading.Thread(target=_poll_health, args=(gp, stop, health))
    poller.start()
    for t in threads:
        t.start()
    try:
        for e in started:
            assert e.wait(60), "a stream did not start"
        answers = []
        with httpx.Client(base_url=gp.base_url, headers=gp.headers(), timeout=60) as c:
            attacks_start = time.monotonic()
            for param, path, body in attacks:
                r = c.post(path, json=body)
                answers.append((param, r.status_code, r.json()))
            attacks_done = time.monotonic()
            good = c.post(chat, json={**base, "structured_outputs": {"grammar": 'start: "ok"'}})
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        poller.join(30)
    for param, status, err in answers:
        assert status == 400, (param, err)
        if param == "format":  # Ollama's shape: the message names the field
            assert "format" in err["error"] and "deep" in err["error"], err
        else:
            assert err["error"]["param"] == param, err
    assert "deep; at most 512" in answers[0][2]["error"]["message"]
    assert "crashed" in answers[-1][2]["error"]["message"], answers[-1]
    assert good.status_code == 200, good.text
    assert gp.proc.poll() is None and gp.proc.pid == gateway_pid
    assert gp.backend_pid() == backend_pid
    for res in results:
        assert res.get("status") == 200 and res.get("done") and res.get("finish") == "length", res
    assert min(res["end"] for res in results) > attacks_start  # every stream ran while the attacks came
    assert health and max(health) < HEALTH_LIMIT_S, (
        f"/health worst {max(health) * 1e3:.0f} ms of {len(health)}"
    )
    print(
        f"{len(answers)} crash inputs refused; {STREAMS} streams done; /health worst {max(health) * 1e3:.0f} ms "
        f"over {len(health)} polls; last stream ended {max(r['end'] for r in results) - attacks_done:+.2f} s "
        "after the attacks"
        f" ({attacks_done - attacks_start:.2f} s)"
    )
