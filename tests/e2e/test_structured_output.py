"""Structured output on /v1/chat/completions through HTTP with the official ``openai`` SDK, against the real
server and backend (session ``gateway`` fixture, tests/plugins/gateway_server.py).

* ``response_format`` json_schema (``strict``) for each schema of ``tests/data/structured_schemas.json``:
  5 completions sampled at temperature 1.0 (one request, ``n=5``); at least half end with "stop", every
  "stop" one parses and validates against its schema, the others end with "length" (never anything else);
* ``client.chat.completions.parse`` with a pydantic model; ``json_object``; vLLM ``structured_outputs``
  (choice, regex, Lark grammar); a constrained output cut by ``max_tokens`` ends with "length"; a stream
  gives the same text as the non-stream answer (temperature 0, same seed);
* bad input is a 400 naming the parameter (``openai.BadRequestError``), never a 5xx, and before any SSE
  byte on a stream request; the server still answers afterwards.

The CPU is slow and shared: every generating request is submitted at once, at module start, to a thread
pool (the sync client; the SDK's async client needs asyncio, the tests run under trio), so that the
backend batches them; each test then waits for its own answers.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pydantic
import pytest

SCHEMAS_PATH = Path(__file__).resolve().parents[1] / "data" / "structured_schemas.json"
SCHEMAS: list[dict] = json.loads(SCHEMAS_PATH.read_text())
N_SAMPLES = 5
SCHEMA_MAX_TOKENS = 120  # most answers take 20 to 80 tokens (order: about 80)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=100_000_000)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _rf(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


STREAM_SCHEMA = next(s for s in SCHEMAS if s["name"] == "classification")


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return gateway.openai(timeout=300)


@pytest.fixture(scope="module", autouse=True)
def answers(gateway, client):
    """Every generating request of this module, submitted at once; ``answers[key]`` is its Future."""
    model = gateway.model
    chat = client.chat.completions
    jobs = {}
    for s in SCHEMAS:
        jobs["schema:" + s["name"]] = lambda s=s: chat.create(
            model=model,
            messages=_user(f"Give one example of a {s['name'].replace('_', ' ')} as JSON."),
            response_format=_rf(s["name"], s["schema"]),
            n=N_SAMPLES,
            temperature=1.0,
            seed=7,
            max_tokens=SCHEMA_MAX_TOKENS,
        )
    jobs["parse"] = lambda: chat.parse(
        model=model,
        messages=_user("Describe Paris as JSON: name, country, population."),
        response_format=City,
        temperature=0,
        max_tokens=60,
    )
    jobs["json_object"] = lambda: chat.create(
        model=model,
        messages=_user('Reply with the JSON object {"animal": "cat"}.'),
        response_format={"type": "json_object"},
        n=3,
        temperature=1.0,
        seed=3,
        max_tokens=40,
    )
    jobs["choice"] = lambda: chat.create(
        model=model,
        messages=_user("Is the sky blue? Answer yes or no."),
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        n=3,
        temperature=1.0,
        seed=1,
        max_tokens=5,
    )
    jobs["regex"] = lambda: chat.create(
        model=model,
        messages=_user("Pick a number."),
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
        n=3,
        temperature=1.0,
        seed=1,
        max_tokens=8,
    )
    jobs["grammar"] = lambda: chat.create(
        model=model,
        messages=_user("A or B?"),
        extra_body={"structured_outputs": {"grammar": 'start: "A" | "B"'}},
        n=3,
        temperature=1.0,
        seed=1,
        max_tokens=5,
    )
    jobs["cut"] = lambda: chat.create(
        model=model,
        messages=_user("Give an example person as JSON."),
        response_format=_rf("person", SCHEMAS[0]["schema"]),
        temperature=0,
        max_tokens=3,
    )
    stream_kw = dict(
        model=model,
        messages=_user("Classify the sentiment of 'I love it' as JSON."),
        response_format=_rf(STREAM_SCHEMA["name"], STREAM_SCHEMA["schema"]),
        temperature=0,
        seed=11,
        max_tokens=60,
    )
    jobs["nonstream"] = lambda: chat.create(**stream_kw)
    jobs["stream"] = lambda: list(chat.create(**stream_kw, stream=True))
    pool = ThreadPoolExecutor(len(jobs))
    futures: dict[str, Future] = {k: pool.submit(fn) for k, fn in jobs.items()}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def _get(answers, key: str):
    return answers[key].result(timeout=300)


# ----------------------------------------------------------------------------- bad input


def _bad(client, gateway, *, stream: bool = False, **kw) -> dict:
    """Send a chat request that must be refused; return the error object of its 400."""
    kw.setdefault("messages", _user("hi"))
    with pytest.raises(openai.BadRequestError) as ei:
        resp = client.chat.completions.create(model=gateway.model, max_tokens=2, stream=stream, **kw)
        if stream:  # a refused stream must not get this far: the 400 comes before any SSE byte
            list(resp)
    e = ei.value
    assert e.status_code == 400
    assert e.response.headers["content-type"].startswith("application/json")
    err = e.response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"], err
    return err


BIG_SCHEMA = {
    "type": "object",
    "properties": {f"field_{i:06d}": {"type": "string"} for i in range(40_000)},
}

ALLOF_CYCLE = {
    "type": "object",
    "properties": {"x": {"allOf": [{"$ref": "#/$defs/a"}]}},
    "required": ["x"],
    "$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}},
}
WIDE_SCHEMA = {"type": "object", "properties": {f"p{i:03d}": {"type": "string"} for i in range(600)}}
BAD_INPUT = [
    ("invalid schema", {"response_format": _rf("x", {"type": "foo"})}, "response_format*"),
    (
        "ref cycle",
        {"response_format": _rf("x", {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})},
        "response_format*",
    ),
    ("1 MB schema", {"response_format": _rf("big", BIG_SCHEMA)}, "response_format*"),
    ("type xml", {"response_format": {"type": "xml"}}, "response_format.type"),
    (
        "json_schema without name",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
        "response_format.json_schema.name",
    ),
    (
        "unknown member of response_format",
        {"response_format": {"type": "json_object", "foo": 1}},
        "response_format.foo",
    ),
    (
        "unknown structured_outputs member",
        {"extra_body": {"structured_outputs": {"regexp": "a"}}},
        "structured_outputs.regexp",
    ),
    (
        "response_format and structured_outputs",
        {"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
        "structured_outputs",
    ),
    ("bad regex", {"extra_body": {"structured_outputs": {"regex": "("}}}, "structured_outputs*"),
    (
        "json_schema with type text",
        {"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}},
        "response_format.json_schema",
    ),
    # compile fine, fail on their first tokens: caught by the check's walks, before any byte
    (
        "ref cycle through allOf",
        {"response_format": _rf("x", ALLOF_CYCLE)},
        "response_format",
    ),
    ("600 optional properties", {"response_format": _rf("wide", WIDE_SCHEMA)}, "response_format"),
    (
        "choice of 2001 strings",
        {"extra_body": {"structured_outputs": {"choice": [f"c{i}" for i in range(2001)]}}},
        "structured_outputs",
    ),
    (
        "lark rule without a base case",
        {"extra_body": {"structured_outputs": {"grammar": 'start: a\na: "x" a'}}},
        "structured_outputs",
    ),
    (
        "forced tool call with a bad response_format",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "required",
            "response_format": _rf("x", {"type": "foo"}),
        },
        "response_format",
    ),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("what, kw, param", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_structured_input_is_400(client, gateway, what, kw, param, stream):
    err = _bad(client, gateway, stream=stream, **kw)
    if param.endswith("*"):  # the grammar check names the field the grammar came from
        assert err["param"].startswith(param[:-1]), err
    else:
        assert err["param"] == param, err
    if what == "1 MB schema":
        assert len(json.dumps(BIG_SCHEMA)) > 1_000_000


def test_big_schema_stays_under_the_body_limit():
    assert len(json.dumps(BIG_SCHEMA)) < 4 * 1024 * 1024 - 10_000


def _chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 5}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "required": ["x"], "$defs": defs}


def test_ref_chains(client, gateway):
    """A chain of 200 refs is served; one of 2,500 (in a schema or in a tool's parameters) is a 400 at once:
    llguidance's compiler recurses along such chains, and a long one overflowed a worker thread's stack."""
    import time

    r = client.chat.completions.create(
        model=gateway.model, messages=_user("x?"), response_format=_rf("c", _chain(200)), max_tokens=20
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    t0 = time.monotonic()
    err = _bad(client, gateway, response_format=_rf("c", _chain(2500)))
    assert (err["param"], err["code"]) == ("response_format", "invalid_value") and "chain" in err["message"]
    # 300 links: over the limit, and its tools preamble still fits the context (2,500 would not: a 400 too)
    tool = {"type": "function", "function": {"name": "f", "parameters": _chain(300)}}
    err = _bad(client, gateway, tools=[tool], tool_choice="required")
    assert err["param"] == "tools[0].function.parameters", err
    assert time.monotonic() - t0 < 20
    r = client.chat.completions.create(model=gateway.model, messages=_user("hi"), max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")  # the server is still there


def test_unknown_member_of_json_schema_is_400(client, gateway):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "foo": 1}}
    err = _bad(client, gateway, response_format=rf)
    assert (err["param"], err["code"]) == ("response_format.json_schema.foo", "unknown_parameter")


UNSERVED = [
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("prediction", {"prediction": {"type": "content", "content": "hello"}}),
    ("web_search_options", {"web_search_options": {}}),
    ("functions", {"functions": [{"name": "f", "parameters": {"type": "object", "properties": {}}}]}),
    ("modalities", {"modalities": ["audio"]}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("param, kw", UNSERVED, ids=[u[0] for u in UNSERVED])
def test_unserved_known_fields_are_400(client, gateway, param, kw, stream):
    err = _bad(client, gateway, stream=stream, **kw)
    assert (err["param"], err["code"]) == (param, "unsupported_parameter"), err


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_unknown_top_level_field_is_400(client, gateway, stream):
    err = _bad(client, gateway, stream=stream, extra_body={"foo": 1})
    assert (err["param"], err["code"]) == ("foo", "unknown_parameter"), err


def test_unknown_stream_options_member_is_400(client, gateway):
    err = _bad(client, gateway, stream=True, stream_options={"include_usage": True, "foo": 1})
    assert (err["param"], err["code"]) == ("stream_options.foo", "unknown_parameter"), err


# ----------------------------------------------------------------------------- json_schema, per schema


def test_schemas_file_has_twelve():
    assert len(SCHEMAS) == 12 and len({s["name"] for s in SCHEMAS}) == 12
    for s in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(s["schema"])


@pytest.mark.parametrize("entry", SCHEMAS, ids=[s["name"] for s in SCHEMAS])
def test_json_schema_samples_validate(answers, entry):
    resp = _get(answers, "schema:" + entry["name"])
    assert len(resp.choices) == N_SAMPLES
    reasons = [c.finish_reason for c in resp.choices]
    assert set(reasons) <= {"stop", "length"}, reasons
    assert reasons.count("stop") * 2 >= N_SAMPLES, reasons
    for c in resp.choices:
        assert c.message.tool_calls is None
        assert isinstance(c.message.content, str)
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), entry["schema"])


# ----------------------------------------------------------------------------- other constraints


def test_parse_with_pydantic_model(answers):
    resp = _get(answers, "parse")
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    parsed = choice.message.parsed
    assert isinstance(parsed, City)
    assert parsed == City.model_validate_json(choice.message.content)


def test_json_object(answers):
    resp = _get(answers, "json_object")
    reasons = [c.finish_reason for c in resp.choices]
    assert set(reasons) <= {"stop", "length"}, reasons
    for c in resp.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict), c.message.content


def test_structured_outputs_choice(answers):
    for c in _get(answers, "choice").choices:
        assert c.message.content in ("yes", "no") and c.finish_reason == "stop", c


def test_structured_outputs_regex(answers):
    for c in _get(answers, "regex").choices:
        text = c.message.content
        assert len(text) == 3 and text.isascii() and text.isdigit() and c.finish_reason == "stop", c


def test_structured_outputs_lark_grammar(answers):
    for c in _get(answers, "grammar").choices:
        assert c.message.content in ("A", "B") and c.finish_reason == "stop", c


def test_cut_by_max_tokens_is_length(answers):
    resp = _get(answers, "cut")
    c = resp.choices[0]
    assert c.finish_reason == "length"
    assert resp.usage.completion_tokens == 3
    assert c.message.content.startswith("{")


def test_stream_equals_nonstream(answers):
    full = _get(answers, "nonstream").choices[0]
    chunks = _get(answers, "stream")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [full.finish_reason] == ["stop"]
    assert text == full.message.content
    jsonschema.validate(json.loads(text), STREAM_SCHEMA["schema"])


# ----------------------------------------------------------------------------- afterwards


def test_still_healthy_after_bad_input(client, gateway, answers):
    resp = client.chat.completions.create(
        model=gateway.model,
        messages=_user("Say yes."),
        max_tokens=2,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert resp.choices[0].message.content in ("yes", "no")
    assert gateway.proc.poll() is None
