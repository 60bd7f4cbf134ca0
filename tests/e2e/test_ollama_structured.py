"""Ollama ``format`` (JSON mode, JSON Schema) and ``tools`` against a real gateway, through the official
``ollama`` client where it can send the body: schema-constrained output parses and validates whenever it
ended on its own; tool calls come back in Ollama's shape (arguments an object) whose arguments validate
against the function's parameters, the same streamed or not; history with calls and results renders; bad
formats, tools and tool choices are a 400 naming the field, never a 5xx. Answers are kept short (the
model is SmolLM2-135M on CPU); requests that do not depend on each other run side by side."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import ollama
import pytest
from plugins.gateway_server import post_json

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(gp) -> ollama.Client:
    return ollama.Client(host=gp.base_url, headers=gp.headers(), timeout=120)


def _calls(message) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, each checked against its function's parameters."""
    out = []
    for c in message.tool_calls or []:
        assert c.function.name in PARAMS, c
        assert isinstance(c.function.arguments, dict)
        jsonschema.validate(dict(c.function.arguments), PARAMS[c.function.name])
        out.append((c.function.name, dict(c.function.arguments)))
    return out


def test_format_schema_validates_at_any_temperature(gateway):
    c = _client(gateway)
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    runs = [{"temperature": 0}] + [{"temperature": 1, "seed": s} for s in (1, 2)]
    with ThreadPoolExecutor(len(runs)) as pool:
        answers = list(
            pool.map(
                lambda o: c.chat(
                    model=gateway.model, messages=msgs, format=PERSON, options={**o, "num_predict": 30}
                ),
                runs,
            )
        )
    assert answers[0].done_reason == "stop", answers[0]  # greedy: a short, complete object
    for a in answers:
        assert a.done_reason in ("stop", "length")
        if a.done_reason == "stop":
            jsonschema.validate(json.loads(a.message.content), PERSON)


def test_format_json_chat_and_generate(gateway):
    c = _client(gateway)
    opts = {"temperature": 0, "num_predict": 20}
    with ThreadPoolExecutor(2) as pool:
        chat = pool.submit(
            c.chat,
            model=gateway.model,
            messages=[
                {"role": "system", "content": "Reply with a JSON object."},
                {"role": "user", "content": 'What is 2+2? Answer as {"answer": number}.'},
            ],
            format="json",
            options=opts,
        )
        gen = pool.submit(
            c.generate,
            model=gateway.model,
            system="Reply with a JSON object.",
            prompt='Give the color of the sky as {"color": string}.',
            format="json",
            options=opts,
        )
        chat, gen = chat.result(), gen.result()
    assert chat.done_reason == "stop" and gen.done_reason == "stop", (chat, gen)
    assert isinstance(json.loads(chat.message.content), dict)
    assert isinstance(json.loads(gen.response), dict)


def test_history_with_a_tool_call_and_its_result_renders(gateway):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_name": "get_weather", "content": "sunny, 21 C"},
    ]
    r = _client(gateway).chat(model=gateway.model, messages=history, tools=TOOLS, options={"num_predict": 4})
    assert r.done and r.done_reason in ("stop", "length")


def test_required_tool_calls_streamed_or_not(gateway):
    c = _client(gateway)
    base = {"model": gateway.model, "messages": ASK, "tools": TOOLS}
    required = {"temperature": 0, "num_predict": 64, "tool_choice": "required"}  # a call is 30-40 tokens

    def streamed() -> tuple[list, list]:
        parts = list(c.chat(**base, options=required, stream=True))
        assert parts[-1].done and not parts[-1].message.tool_calls
        with_calls = [p for p in parts if p.message.tool_calls]
        assert all(len(p.message.tool_calls) == 1 and p.message.content == "" for p in with_calls)
        return [x for p in with_calls for x in _calls(p.message)], parts

    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(c.chat, **base, options=required)
        stream = pool.submit(streamed)
        plain, (stream_calls, parts) = plain.result(), stream.result()
    calls = _calls(plain.message)
    assert calls and calls == stream_calls
    assert plain.done_reason == parts[-1].done_reason
    # text is what is not a call (here at most a call cut off before its name: the parser's verbatim text)
    assert "".join(p.message.content or "" for p in parts) == plain.message.content


def test_named_tool_choice_as_an_option_or_at_the_top_level(gateway):
    # Raw bodies: the client's Tool model would drop additionalProperties (the arguments would run on).
    tools = [
        {
            **t,
            "function": {
                **t["function"],
                "parameters": {**PARAMS[t["function"]["name"]], "additionalProperties": False},
            },
        }
        for t in TOOLS
    ]
    body = {"model": gateway.model, "messages": ASK, "tools": tools, "stream": False}
    opts = {"temperature": 0, "num_predict": 34}  # one call: 30 tokens
    bodies = [
        {**body, "options": {**opts, "tool_choice": "get_time"}},
        {**body, "tool_choice": "get_weather", "options": opts},
        {**body, "options": {"tool_choice": "none", "num_predict": 2}},
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: post_json(gateway, "/api/chat", b, timeout=120), bodies))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    *named, none = [r.json() for r in answers]
    for want, a in zip(["get_time", "get_weather"], named, strict=True):
        assert a["done_reason"] == "stop", a  # one complete call: Ollama's "stop", not "tool_calls"
        (call,) = a["message"]["tool_calls"]
        assert call["function"]["name"] == want and call["id"].startswith("call_")
        jsonschema.validate(call["function"]["arguments"], PARAMS[want])
    assert "tool_calls" not in none["message"], none


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.mark.parametrize(
    "path, extra, named",
    [
        ("/api/chat", {"format": "xml"}, "format"),
        ("/api/chat", {"format": 5}, "format"),
        ("/api/chat", {"format": ["json"]}, "format"),
        ("/api/chat", {"format": CYCLE}, "format"),
        ("/api/generate", {"format": "yaml"}, "format"),
        ("/api/generate", {"format": CYCLE}, "format"),
        ("/api/chat", {"tools": [{"type": "function", "function": {"parameters": WEATHER}}]}, "name"),
        ("/api/chat", {"tools": "get_weather"}, "tools"),
        ("/api/chat", {"tools": TOOLS, "options": {"tool_choice": "get_news"}}, "tool_choice"),
        ("/api/chat", {"tools": TOOLS, "tool_choice": "get_news"}, "tool_choice"),
        ("/api/chat", {"tools": TOOLS, "options": {"tool_choice": 3}}, "tool_choice"),
        ("/api/chat", {"options": {"tool_choice": "required"}}, "tool_choice"),
        (
            "/api/chat",
            {"tools": TOOLS, "tool_choice": "none", "options": {"tool_choice": "required"}},
            "tool_choice",
        ),
    ],
)
def test_bad_format_tools_and_tool_choice_are_400(gateway, path, extra, named):
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path == "/api/chat" else {"prompt": "hi"}
    r = post_json(gateway, path, {"model": gateway.model, **prompt, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert named in err["error"] and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
        {"role": "assistant", "content": "", "tool_calls": {"function": {"name": "f"}}},
        {"role": "tool", "content": "x", "tool_name": 7},
    ],
)
def test_malformed_history_is_400(gateway, message):
    body = {"model": gateway.model, "messages": [*ASK, message], "stream": False}
    r = post_json(gateway, "/api/chat", body, timeout=60)
    assert r.status_code == 400, r.text
    assert "messages[1]" in r.json()["error"]


def test_official_client_reports_the_400(gateway):
    with pytest.raises(ollama.ResponseError) as e:
        _client(gateway).chat(model=gateway.model, messages=ASK, tools=TOOLS, options={"tool_choice": "nope"})
    assert e.value.status_code == 400 and "tool_choice" in e.value.error


def test_a_streamed_bad_format_errors_before_any_line(gateway):
    body = {"model": gateway.model, "prompt": "hi", "format": CYCLE}
    with httpx.stream(
        "POST", gateway.base_url + "/api/generate", json=body, headers=gateway.headers(), timeout=60
    ) as r:
        assert r.status_code == 400
        assert r.headers["content-type"].startswith("application/json")
        assert "format" in json.loads(r.read())["error"]
