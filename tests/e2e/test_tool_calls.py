"""Tool calling on /v1/chat/completions through HTTP with the official ``openai`` SDK, against the real server
and backend (session ``gateway`` fixture, tests/plugins/gateway_server.py). The model (SmolLM2) has no tool
template: the gateway writes the tools in the Hermes format (docs/tools.md) and constrains the output with a
grammar for ``tool_choice`` "required" or a named function.

* forced calls (``required`` without parallel calls, a named function) at temperature 1.0 and 0: finish
  "tool_calls", ids "call_...", type "function", a name from ``tools`` (the named one), arguments that
  validate against that function's ``parameters``;
* a stream assembled as the SDK assembles it equals the non-stream answer (temperature 0);
* a two-turn agent loop with the SDK's own message objects appended to the history;
* ``auto`` (whatever comes back is valid) and ``none`` (never a call); a call cut by ``max_tokens`` is
  "length"; logprobs with a forced call;
* bad input is a 400 naming the parameter.

Every generating request is submitted at once, at module start, to a thread pool (the sync client; the
SDK's async client needs asyncio, the tests run under trio) so that the backend batches them.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "minLength": 1, "maxLength": 20}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
CALL_TOKENS = 60  # a forced call takes about 20 tokens


def _check_calls(message, finish_reason: str, *, named: str | None = None, most: int | None = None) -> None:
    """A choice that called tools: OpenAI's shape, known names, arguments valid for the function."""
    assert finish_reason == "tool_calls", (finish_reason, message)
    calls = message.tool_calls
    assert calls, message
    if most is not None:
        assert len(calls) <= most, calls
    for call in calls:
        assert call.id.startswith("call_") and len(call.id) > 5, call
        assert call.type == "function", call
        assert call.function.name in PARAMS, call
        if named is not None:
            assert call.function.name == named, call
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return gateway.openai(timeout=300)


@pytest.fixture(scope="module", autouse=True)
def answers(gateway, client):
    """Every generating request of this module, submitted at once (the agent loop's second turn as soon as
    its first is answered); ``answers[key]`` is its Future."""
    chat = client.chat.completions
    base = dict(model=gateway.model, messages=ASK, tools=TOOLS, max_tokens=CALL_TOKENS)
    jobs = {}
    for seed in (1, 2):
        jobs[f"required:t1:{seed}"] = lambda seed=seed: chat.create(
            **base, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed, n=2
        )
        jobs[f"named:t1:{seed}"] = lambda seed=seed: chat.create(
            **base, tool_choice=NAMED, temperature=1.0, seed=seed, n=2
        )
    jobs["required:t0"] = lambda: chat.create(
        **base, tool_choice="required", parallel_tool_calls=False, temperature=0, seed=5
    )
    jobs["named:t0"] = lambda: chat.create(**base, tool_choice=NAMED, temperature=0, seed=5)
    jobs["required:t0:stream"] = lambda: list(
        chat.create(
            **base, tool_choice="required", parallel_tool_calls=False, temperature=0, seed=5, stream=True
        )
    )
    jobs["named:t0:stream"] = lambda: list(
        chat.create(**base, tool_choice=NAMED, temperature=0, seed=5, stream=True)
    )
    for seed in (1, 2):
        jobs[f"auto:{seed}"] = lambda seed=seed: chat.create(
            **{**base, "max_tokens": 30}, tool_choice="auto", temperature=1.0, seed=seed, n=2
        )
    jobs["none"] = lambda: chat.create(
        **{**base, "max_tokens": 12}, tool_choice="none", temperature=1.0, seed=1, n=2
    )
    jobs["cut"] = lambda: chat.create(
        **{**base, "max_tokens": 5}, tool_choice="required", parallel_tool_calls=False, temperature=0
    )
    jobs["logprobs"] = lambda: chat.create(
        **base,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    pool = ThreadPoolExecutor(len(jobs) + 1)
    futures: dict[str, Future] = {k: pool.submit(fn) for k, fn in jobs.items()}
    turn_1 = futures["required:t0"]
    futures["agent"] = pool.submit(lambda: _agent_turn_2(chat, gateway.model, turn_1.result()))
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def _get(answers, key: str):
    return answers[key].result(timeout=300)


# ----------------------------------------------------------------------------- bad input (runs first)


def _bad(client, gateway, **kw) -> dict:
    kw.setdefault("messages", ASK)
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=gateway.model, max_tokens=2, **kw)
    e = ei.value
    assert e.status_code == 400
    err = e.response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"], err
    return err


NAMELESS = {"type": "function", "function": {"parameters": {"type": "object", "properties": {}}}}
CYCLE_TOOL = {
    "type": "function",
    "function": {
        "name": "loop",
        "parameters": {
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/a"}},
            "required": ["x"],
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        },
    },
}
BAD_PROPERTY = {
    "type": "function",
    "function": {"name": "g", "parameters": {"type": "object", "properties": {"a": {"type": "foo"}}}},
}
BAD_SCHEMA = {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
BAD_TOOLS = [
    ("tool without name", {"tools": [NAMELESS]}, "tools[0].function.name"),
    ("second tool without name", {"tools": [WEATHER, NAMELESS]}, "tools[1].function.name"),
    (
        "named function not in tools",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("tools not a list", {"extra_body": {"tools": WEATHER}}, "tools"),
    ("bad tool_choice string", {"tools": TOOLS, "extra_body": {"tool_choice": "always"}}, "tool_choice"),
    (
        "parallel_tool_calls not a bool",
        {"tools": TOOLS, "extra_body": {"parallel_tool_calls": "yes"}},
        "parallel_tool_calls",
    ),
    ("invalid parameters schema, auto", {"tools": [BAD_SCHEMA]}, "tool*"),
    ("invalid parameters schema, required", {"tools": [BAD_SCHEMA], "tool_choice": "required"}, "tool*"),
    (
        "invalid property schema, required",
        {"tools": [WEATHER, BAD_PROPERTY], "tool_choice": "required"},
        "tools[1].function.parameters",
    ),
    ("duplicate names", {"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ("tool type not function", {"tools": [{**WEATHER, "type": "retrieval"}]}, "tools[0].type"),
    (
        "$ref cycle in parameters",
        {"tools": [WEATHER, CYCLE_TOOL], "tool_choice": "required"},
        "tools[1].function.parameters",
    ),
]


@pytest.mark.parametrize("what, kw, param", BAD_TOOLS, ids=[b[0] for b in BAD_TOOLS])
def test_bad_tool_input_is_400(client, gateway, what, kw, param):
    err = _bad(client, gateway, **kw)
    if param.endswith("*"):
        assert err["param"].startswith(param[:-1]), err
    else:
        assert err["param"] == param, err


# ----------------------------------------------------------------------------- forced calls


@pytest.mark.parametrize("seed", [1, 2])
def test_required_sampled(answers, seed):
    resp = _get(answers, f"required:t1:{seed}")
    assert len(resp.choices) == 2
    for c in resp.choices:
        _check_calls(c.message, c.finish_reason, most=1)


@pytest.mark.parametrize("seed", [1, 2])
def test_named_sampled(answers, seed):
    resp = _get(answers, f"named:t1:{seed}")
    assert len(resp.choices) == 2
    for c in resp.choices:
        _check_calls(c.message, c.finish_reason, named="get_time", most=1)


@pytest.mark.parametrize("mode", ["required", "named"])
def test_forced_greedy(answers, mode):
    c = _get(answers, f"{mode}:t0").choices[0]
    _check_calls(c.message, c.finish_reason, named="get_time" if mode == "named" else None, most=1)


def _assemble(chunks) -> tuple[list[dict], list[str], list]:
    """Stream chunks -> the calls as the SDK assembles them (per index: id, type and name from the first
    delta, ``arguments`` concatenated), the finish reasons seen, and the first delta of each call."""
    calls: dict[int, dict] = {}
    firsts: dict[int, object] = {}
    reasons: list[str] = []
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.index == 0
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    firsts[d.index] = d
                    calls[d.index] = {"id": d.id, "type": d.type, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], reasons, [firsts[i] for i in sorted(firsts)]


@pytest.mark.parametrize("mode", ["required", "named"])
def test_stream_assembles_to_the_nonstream_calls(answers, mode):
    full = _get(answers, f"{mode}:t0").choices[0]
    calls, reasons, firsts = _assemble(_get(answers, f"{mode}:t0:stream"))
    assert reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (t.function.name, t.function.arguments) for t in full.message.tool_calls
    ]
    for i, d in enumerate(firsts):
        assert d.index == i and d.id and d.id.startswith("call_") and d.type == "function", d
        assert d.function is not None and d.function.name in PARAMS, d
    for c in calls:
        assert c["id"].startswith("call_") and c["type"] == "function"
        jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])


def test_cut_call_is_length(answers):
    resp = _get(answers, "cut")
    c = resp.choices[0]
    assert c.finish_reason == "length", c
    assert resp.usage.completion_tokens == 5
    # a forced call's grammar allows calls only: the cut start of one is not content
    assert not c.message.content and not c.message.tool_calls, c.message


def test_logprobs_with_forced_call(answers):
    """``logprobs`` of a forced call are those after the mask (docs/structured-output.md): every token of
    the output has one, a number <= 0, and 1 to 3 alternatives, all of them tokens the grammar allows (a
    number, never the -inf of a masked token, which JSON would carry as null)."""
    c = _get(answers, "logprobs").choices[0]
    _check_calls(c.message, c.finish_reason, most=1)
    lp = c.logprobs.content
    assert lp, c.logprobs
    assert "".join(t.token for t in lp).startswith("<tool_call>")
    for tok in lp:
        assert isinstance(tok.token, str) and isinstance(tok.logprob, float) and tok.logprob <= 0, tok
        assert 1 <= len(tok.top_logprobs) <= 3, tok
        for top in tok.top_logprobs:
            assert isinstance(top.logprob, float) and top.logprob <= 0, tok
        assert tok.top_logprobs[0].logprob >= tok.logprob - 1e-6, tok  # greedy: the chosen one is the top
        assert tok.token in {t.token for t in tok.top_logprobs}, tok


# ----------------------------------------------------------------------------- auto and none


@pytest.mark.parametrize("seed", [1, 2])
def test_auto_is_always_valid(answers, seed):
    for c in _get(answers, f"auto:{seed}").choices:
        assert c.finish_reason in ("stop", "length", "tool_calls"), c
        if c.finish_reason == "tool_calls":
            _check_calls(c.message, c.finish_reason)
        else:
            assert isinstance(c.message.content, str), c
            if c.message.tool_calls:  # a call the model ended early or was cut in: still well formed
                for call in c.message.tool_calls:
                    assert call.id.startswith("call_") and call.function.name in PARAMS


def test_none_never_calls(answers):
    for c in _get(answers, "none").choices:
        assert c.finish_reason in ("stop", "length"), c
        assert not c.message.tool_calls and isinstance(c.message.content, str), c


# ----------------------------------------------------------------------------- agent loop


def _agent_turn_2(chat, model: str, first):
    """The second turn of an agent loop: the SDK message object of turn 1 goes back into the history as is,
    then the tool's result."""
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    messages: list = [*ASK, msg]
    messages.append(
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"city": "Paris", "temperature": 18, "unit": "celsius", "sky": "clear"}),
        }
    )
    return chat.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=24, temperature=0
    )


def test_two_turn_agent_loop(answers):
    """Turn 1 is the greedy forced call (``required:t0``); turn 2 (``tool_choice`` auto) is a 200 with text
    or valid calls."""
    resp = _get(answers, "agent")
    c = resp.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls"), c
    if c.finish_reason == "tool_calls":
        _check_calls(c.message, c.finish_reason)
    else:
        assert isinstance(c.message.content, str) and c.message.content, c
