"""The Ollama API against a real gateway (float32, greedy): the same answer as /v1 whichever way it is asked
(chat or generate, stream or not), NDJSON framing, client errors in Ollama's shape before any line, and a
client that leaves mid-stream freeing its request."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
from plugins.gateway_server import chat_body, post_json

QUESTION = "Name a color."
N = 8  # tokens per answer (keeps the file fast on 2 cores)


def _post(gp, path: str, body: dict) -> httpx.Response:
    return post_json(gp, path, {"model": gp.model, **body}, timeout=120)


def _lines(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-ndjson"
    assert r.text.endswith("\n")
    return [json.loads(x) for x in r.text.splitlines()]


def test_same_answer_as_v1_whichever_way_asked(gateway):
    v1 = post_json(gateway, "/v1/chat/completions", chat_body(gateway, QUESTION, temperature=0, max_tokens=N))
    assert v1.status_code == 200, v1.text
    text = v1.json()["choices"][0]["message"]["content"]
    usage = v1.json()["usage"]
    reason = v1.json()["choices"][0]["finish_reason"]
    opts = {"temperature": 0, "num_predict": N}
    msgs = [{"role": "user", "content": QUESTION}]

    chat = _post(gateway, "/api/chat", {"messages": msgs, "options": opts, "stream": False})
    assert chat.status_code == 200 and chat.headers["content-type"] == "application/json", chat.text
    gen = _post(gateway, "/api/generate", {"prompt": QUESTION, "options": opts, "stream": False}).json()
    chat_lines = _lines(_post(gateway, "/api/chat", {"messages": msgs, "options": opts}))
    gen_lines = _lines(_post(gateway, "/api/generate", {"prompt": QUESTION, "options": opts}))

    assert chat.json()["message"] == {"role": "assistant", "content": text}
    assert gen["response"] == text
    assert "".join(x["message"]["content"] for x in chat_lines) == text
    assert "".join(x["response"] for x in gen_lines) == text
    for final in (chat.json(), gen, chat_lines[-1], gen_lines[-1]):
        assert final["done"] is True and final["done_reason"] == reason
        assert final["prompt_eval_count"] == usage["prompt_tokens"]
        assert final["eval_count"] == usage["completion_tokens"]
        assert final["load_duration"] == 0 and final["prompt_eval_duration"] > 0
        assert final["prompt_eval_duration"] + final["eval_duration"] <= final["total_duration"]
    for lines in (chat_lines, gen_lines):
        assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
        assert all(x["model"] == gateway.model and x["created_at"].endswith("Z") for x in lines)
        assert lines[-1].get("message", {}).get("content", "") == "" and lines[-1].get("response", "") == ""


def test_official_client_stream(gateway):
    c = ollama.Client(host=gateway.base_url, headers=gateway.headers(), timeout=120)
    parts = list(
        c.chat(
            model=gateway.model,
            messages=[{"role": "user", "content": QUESTION}],
            options={"temperature": 0, "num_predict": 3},
            stream=True,
        )
    )
    assert parts[-1].done and parts[-1].eval_count == 3 and parts[-1].done_reason == "length"
    assert not any(p.done for p in parts[:-1])


@pytest.mark.parametrize(
    "path, body, status, code",
    [
        (
            "/api/chat",
            {"messages": [{"role": "user", "content": "hi"}], "options": {"temperature": 5}},
            400,
            None,
        ),
        (
            "/api/chat",
            {"messages": [{"role": "user", "content": "hi"}], "options": {"top_k": "x"}},
            400,
            None,
        ),
        (
            "/api/chat",
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            400,
            None,
        ),
        ("/api/chat", {"messages": "hi"}, 400, None),
        ("/api/generate", {"prompt": "hi", "stream": "yes"}, 400, None),
        ("/api/generate", {"prompt": ["hi"]}, 400, None),
        ("/api/generate", {"prompt": "hi", "model": "no-such-model"}, 404, "model_not_found"),
        ("/api/generate", {"prompt": "hi", "options": {"num_predict": 10**6}}, 400, "invalid_value"),
    ],
)
def test_client_errors_before_any_line(gateway, path, body, status, code):
    r = _post(gateway, path, body)  # streaming by default: the error still comes before any NDJSON line
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()
    assert isinstance(err["error"], str) and err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code, err


def test_client_leaving_mid_stream_frees_its_request(gateway):
    body = {
        "model": gateway.model,
        "prompt": "Count from one to one thousand.",
        "options": {"temperature": 0, "num_predict": 400},
    }
    with httpx.stream(
        "POST", gateway.base_url + "/api/generate", json=body, headers=gateway.headers(), timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line and json.loads(line).get("response"):
                break  # leave after the first text
    st = gateway.wait_idle(30)
    assert st["running"] == 0 and st["waiting"] == 0
