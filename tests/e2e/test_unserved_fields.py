"""Fields the server does not serve are a 400 naming the field, never answered as if absent.

* /v1/chat/completions: the known OpenAI fields not served (``audio``, ``modalities`` other than
  ``["text"]``, ``prediction``, ``web_search_options``, ``reasoning_effort``, ``verbosity``, the legacy
  ``functions``/``function_call``) are a 400 ``unsupported_parameter``; a field OpenAI does not know is a 400
  ``unknown_parameter`` (also inside ``stream_options``). Values that ask for nothing (``function_call``
  "none", ``modalities`` ["text"], ``response_format`` text, ``tool_choice`` "none", nulls) pass. Tools and
  structured output are served: tests/e2e/test_tool_calls.py, tests/e2e/test_structured_output.py.
* /v1/completions: an unknown field is ``unknown_parameter``; ``best_of`` other than 1 is refused.
* Ollama: ``think`` and ``context`` are refused (``format`` and ``tools``: tests of the Ollama API).

Every refusal comes before generation and before any SSE byte of a stream request.
"""

from __future__ import annotations

import json

import pytest
from plugins.gateway_server import chat_body, post_json, stream_post

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _error(status: int, headers, body: bytes, param: str, code: str | None) -> dict:
    assert status == 400, body
    assert headers["content-type"].startswith("application/json"), headers
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _post_error(gateway, path: str, body: dict, param: str, code: str | None) -> dict:
    r = post_json(gateway, path, body)
    return _error(r.status_code, r.headers, r.content, param, code)


UNSUPPORTED = [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"modalities": ["audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "Hello there"}}, "prediction"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"verbosity": "low"}, "verbosity"),
    ({"functions": [{"name": "f", "parameters": {"type": "object", "properties": {}}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"function_call": {"name": "f"}}, "function_call"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    "extra, param", UNSUPPORTED, ids=[f"{p}-{i}" for i, (_, p) in enumerate(UNSUPPORTED)]
)
def test_chat_unsupported_known_fields(gateway, extra, param, stream):
    body = {**chat_body(gateway, "hi", max_tokens=2), **extra}
    if stream:  # the 400 comes before any SSE byte
        res = stream_post(gateway, CHAT, body)
        assert not res.events and not res.pings
        _error(res.status, res.headers, res.body, param, "unsupported_parameter")
    else:
        _post_error(gateway, CHAT, body, param, "unsupported_parameter")


UNKNOWN = [
    (CHAT, {"foo": 1}, "foo"),
    (CHAT, {"best_of": 2}, "best_of"),  # a /v1/completions field
    (CHAT, {"guided_json": {"type": "object"}}, "guided_json"),  # vLLM's old name: not served
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "foo": 1}}, "stream_options.foo"),
    (COMPLETIONS, {"foo": 1}, "foo"),
    (COMPLETIONS, {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    (COMPLETIONS, {"response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize("path, extra, param", UNKNOWN, ids=[f"{p}:{q}" for p, _, q in UNKNOWN])
def test_unknown_fields(gateway, path, extra, param):
    if path == CHAT:
        body = chat_body(gateway, "hi", max_tokens=2)
    else:
        body = {"model": gateway.model, "prompt": "Hello", "max_tokens": 2}
    err = _post_error(gateway, path, {**body, **extra}, param, "unknown_parameter")
    assert param in err["message"]


def test_chat_accepts_values_that_ask_for_nothing(gateway):
    extra = {
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "function_call": "none",
        "modalities": ["text"],
        "audio": None,
        "prediction": None,
        "web_search_options": None,
        "reasoning_effort": None,
        "verbosity": None,
        "functions": None,
    }
    r = post_json(gateway, CHAT, {**chat_body(gateway, "hi", max_tokens=2), **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_completion_best_of(gateway):
    base = {"model": gateway.model, "prompt": "Hello", "max_tokens": 2}
    for best_of in (3, 2):
        _post_error(gateway, COMPLETIONS, {**base, "best_of": best_of}, "best_of", "unsupported_parameter")
    r = post_json(gateway, COMPLETIONS, {**base, "best_of": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "think": True}, "think"),
        ("/api/generate", {"prompt": "hi", "context": [1, 2, 3]}, "context"),
        ("/api/generate", {"prompt": "hi", "think": True}, "think"),
    ],
)
def test_ollama_refuses_think_and_context(gateway, path, extra, param):
    r = post_json(gateway, path, {"model": gateway.model, "stream": False, **extra})
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]
