"""OpenAI tools / tool_choice / parallel_tool_calls validation -> ToolPlan."""

from __future__ import annotations

import msgspec
import pytest

from gateway.errors import InvalidRequest
from gateway.tools.spec import MAX_SCHEMA_DEPTH, FunctionTool, ToolPlan, parse_tools


def fn(name: str = "get_weather", **extra: object) -> dict:
    return {"type": "function", "function": {"name": name, **extra}}


WEATHER = fn(
    "get_weather",
    description="Weather for a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


@pytest.mark.parametrize(
    ("tools", "choice"), [(None, None), ([], None), (None, "none"), (None, "auto"), ([], "none")]
)
def test_nothing_to_do(tools, choice):
    assert parse_tools(tools, choice, None) is None


def test_defaults_auto_and_parallel():
    plan = parse_tools([WEATHER, fn("now")], None, None)
    assert plan == ToolPlan(
        tools=(
            FunctionTool(
                name="get_weather",
                description="Weather for a city",
                parameters=WEATHER["function"]["parameters"],
            ),
            FunctionTool(
                name="now",
                parameters={"type": "object", "properties": {}, "additionalProperties": False},
            ),
        ),
        mode="auto",
        parallel=True,
    )
    assert plan.tool("now") is plan.tools[1] and plan.tool("nope") is None
    with pytest.raises(AttributeError):
        plan.mode = "none"  # frozen


@pytest.mark.parametrize(
    ("choice", "mode", "named"),
    [
        ("none", "none", None),
        ("auto", "auto", None),
        ("required", "required", None),
        ({"type": "function", "function": {"name": "now"}}, "named", "now"),
    ],
)
def test_tool_choice(choice, mode, named):
    plan = parse_tools([WEATHER, fn("now")], choice, False)
    assert (plan.mode, plan.named, plan.parallel) == (mode, named, False)


def test_strict_and_names():
    plan = parse_tools([fn("a-B_9", strict=True), fn("x" * 64, strict=None)], "auto", True)
    assert [t.strict for t in plan.tools] == [True, False]
    assert msgspec.json.decode(msgspec.json.encode(plan), type=ToolPlan) == plan


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "param", "code"),
    [
        ({"type": "function"}, None, None, "tools", "invalid_type"),
        ("x", None, None, "tools", "invalid_type"),
        ([WEATHER, 3], None, None, "tools[1]", "invalid_type"),
        ([{"type": "code_interpreter"}], None, None, "tools[0].type", "invalid_value"),
        ([{"function": {"name": "a"}}], None, None, "tools[0].type", "invalid_value"),
        ([{"type": "function"}], None, None, "tools[0].function", "missing_required_parameter"),
        ([{"type": "function", "function": "a"}], None, None, "tools[0].function", "invalid_type"),
        ([{"type": "function", "function": {}}], None, None, "tools[0].function.name", None),
        ([fn("")], None, None, "tools[0].function.name", "invalid_value"),
        ([fn(7)], None, None, "tools[0].function.name", "invalid_type"),
        ([fn("has space")], None, None, "tools[0].function.name", "invalid_value"),
        ([fn("x" * 65)], None, None, "tools[0].function.name", "invalid_value"),
        ([fn("dé")], None, None, "tools[0].function.name", "invalid_value"),
        ([fn("a"), fn("b"), fn("a")], None, None, "tools[2].function.name", "invalid_value"),
        ([fn("a", parameters=[])], None, None, "tools[0].function.parameters", "invalid_type"),
        ([fn("a", parameters="{}")], None, None, "tools[0].function.parameters", "invalid_type"),
        ([fn("a", description=1)], None, None, "tools[0].function.description", "invalid_type"),
        ([fn("a", strict="yes")], None, None, "tools[0].function.strict", "invalid_type"),
        ([WEATHER], "always", None, "tool_choice", "invalid_value"),
        ([WEATHER], 1, None, "tool_choice", "invalid_value"),
        ([WEATHER], {"type": "function"}, None, "tool_choice", "invalid_value"),
        ([WEATHER], {"type": "tool", "function": {"name": "a"}}, None, "tool_choice", "invalid_value"),
        ([WEATHER], {"type": "function", "function": {"name": ""}}, None, "tool_choice", "invalid_value"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice", "invalid_value"),
        (None, "required", None, "tool_choice", "invalid_value"),
        ([], {"type": "function", "function": {"name": "a"}}, None, "tool_choice", "invalid_value"),
        (None, "bogus", None, "tool_choice", "invalid_value"),
        (
            [fn("a", parameters={"type": "array"})],
            None,
            None,
            "tools[0].function.parameters",
            "invalid_value",
        ),
        (
            [fn("a", parameters={"type": "string"})],
            None,
            None,
            "tools[0].function.parameters",
            "invalid_value",
        ),
        ([fn("a", parameters={"type": ["array", "null"]})], None, None, "tools[0].function.parameters", None),
        ([fn("a", parameters={"type": 3})], None, None, "tools[0].function.parameters", "invalid_value"),
        ([WEATHER, fn("a", parameters={"type": None})], None, None, "tools[1].function.parameters", None),
        ([{**WEATHER, "foo": 1}], None, None, "tools[0].foo", "unknown_parameter"),
        ([fn("a", foo=None)], None, None, "tools[0].function.foo", "unknown_parameter"),
        ([fn("a", arguments={})], None, None, "tools[0].function.arguments", "unknown_parameter"),
        (
            [WEATHER],
            {"type": "function", "function": {"name": "get_weather"}, "x": 1},
            None,
            "tool_choice.x",
            "unknown_parameter",
        ),
        (
            [WEATHER],
            {"type": "function", "function": {"name": "get_weather", "strict": True}},
            None,
            "tool_choice.function.strict",
            "unknown_parameter",
        ),
        ([WEATHER], "auto", "true", "parallel_tool_calls", "invalid_type"),
        (None, None, 1, "parallel_tool_calls", "invalid_type"),
    ],
)
def test_errors_name_the_param(tools, choice, parallel, param, code):
    with pytest.raises(InvalidRequest) as e:
        parse_tools(tools, choice, parallel)
    assert e.value.param == param and e.value.status == 400
    if code is not None:
        assert e.value.code == code
    assert f"'{param}'" in e.value.message


def test_messages_are_openai_style():
    with pytest.raises(InvalidRequest) as e:
        parse_tools([WEATHER], {"type": "function", "function": {"name": "get_time"}}, None)
    assert e.value.message.startswith("Invalid value for 'tool_choice':") and "'get_time'" in e.value.message
    with pytest.raises(InvalidRequest) as e:
        parse_tools([WEATHER], "always", None)
    assert e.value.message.startswith("Invalid value for 'tool_choice': 'always'.")
    with pytest.raises(InvalidRequest) as e:
        parse_tools("x", None, None)
    assert e.value.message == "Invalid type for 'tools': expected an array, but got a string instead."


def nested(levels: int) -> dict:
    """A ``parameters`` object nesting exactly ``levels`` objects/arrays (itself included)."""
    junk: list = []
    for _ in range(levels - 2):
        junk = [junk]
    return {"type": "object", "x-junk": junk}


def test_parameters_depth_limit():
    assert _depth(nested(MAX_SCHEMA_DEPTH)) == MAX_SCHEMA_DEPTH
    ok = parse_tools([fn("a", parameters=nested(MAX_SCHEMA_DEPTH))], None, None)
    assert ok.tools[0].parameters == nested(MAX_SCHEMA_DEPTH)
    for levels in (MAX_SCHEMA_DEPTH + 1, 500, 100_000):  # measured without recursion: any depth is a 400
        with pytest.raises(InvalidRequest) as e:
            parse_tools([WEATHER, fn("a", parameters=nested(levels))], None, None)
        assert (e.value.param, e.value.code) == ("tools[1].function.parameters", "invalid_value")
        assert f"more than {MAX_SCHEMA_DEPTH} levels" in e.value.message
    deep_props: dict = {"type": "string"}  # nesting through properties counts too
    for _ in range(MAX_SCHEMA_DEPTH):
        deep_props = {"type": "object", "properties": {"p": deep_props}}
    with pytest.raises(InvalidRequest):
        parse_tools([fn("a", parameters=deep_props)], None, None)


def _depth(v: object) -> int:
    if not isinstance(v, (dict, list)):
        return 0
    return 1 + max(map(_depth, v.values() if isinstance(v, dict) else v), default=0)


@pytest.mark.parametrize(
    "parameters",
    [{}, {"type": "object"}, {"type": ["object", "null"]}, {"properties": {"a": {"type": "array"}}}],
)
def test_object_parameters_accepted(parameters):
    assert parse_tools([fn("a", parameters=parameters)], None, None).tools[0].parameters == parameters


def test_omitted_parameters_allow_no_arguments():
    plan = parse_tools([fn("a"), fn("b", parameters=None)], None, None)
    assert [t.parameters for t in plan.tools] == [
        {"type": "object", "properties": {}, "additionalProperties": False}
    ] * 2
    a, b = (t.parameters for t in plan.tools)
    assert a is not b and a["properties"] is not b["properties"]  # no shared, mutable default


def test_unknown_members_are_openai_style():
    with pytest.raises(InvalidRequest) as e:
        parse_tools([fn("a", foo=1, bar=2)], None, None)
    assert e.value.message == "Unrecognized request argument supplied: 'tools[0].function.bar'."
    assert (e.value.param, e.value.code, e.value.status) == (
        "tools[0].function.bar",
        "unknown_parameter",
        400,
    )
    # a tool_choice object of another type is an invalid value, not an unknown member
    with pytest.raises(InvalidRequest) as e:
        parse_tools([WEATHER], {"type": "allowed_tools", "allowed_tools": {}}, None)
    assert (e.value.param, e.value.code) == ("tool_choice", "invalid_value")
