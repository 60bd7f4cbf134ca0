"""Fields asking for what the server does not serve are a 400 naming the field, never answered as if absent:
tool calls and structured output on /v1/chat/completions, best_of on /v1/completions, Ollama's think and
context. Values that ask for nothing (tool_choice "none", response_format text, best_of 1) still pass."""

from __future__ import annotations

import pytest
from plugins.gateway_server import chat_body, post_json

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [TOOL]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [TOOL["function"]]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
            "response_format",
        ),
    ],
)
def test_chat_refuses_tools_and_structured_output(gateway, extra, param):
    r = post_json(gateway, "/v1/chat/completions", {**chat_body(gateway, "hi", max_tokens=2), **extra})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["error"]["param"] == param
    assert body["error"]["code"] == "unsupported_parameter"


def test_chat_accepts_values_that_ask_for_nothing(gateway):
    extra = {"tool_choice": "none", "response_format": {"type": "text"}}
    r = post_json(gateway, "/v1/chat/completions", {**chat_body(gateway, "hi", max_tokens=2), **extra})
    assert r.status_code == 200, r.text


def test_completion_best_of(gateway):
    base = {"model": gateway.model, "prompt": "Hello", "max_tokens": 2}
    r = post_json(gateway, "/v1/completions", {**base, "best_of": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    r = post_json(gateway, "/v1/completions", {**base, "best_of": 1})
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
