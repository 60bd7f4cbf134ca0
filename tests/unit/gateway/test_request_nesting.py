"""Request bodies nested deeper than ``MAX_DEPTH`` are a 400 at the door (the template, prompt hooks and tool
code walk values recursively: a member nested ~500 deep was a RecursionError there, a 500); the measure
ignores brackets inside strings; the prompt-size helpers count every rendered field without recursion."""

from __future__ import annotations

import json
import time

import pytest

from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.openai.prompt_size import check_fits, prompt_floor, rendered_chars
from gateway.openai.schemas import decode_chat
from gateway.request_body import MAX_DEPTH, decode_json, nesting_depth


def nested(depth: int) -> object:
    v: object = "x"
    for i in range(depth):
        v = {"k": v} if i % 2 else [v]
    return v


def chat(member: object) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi", "extra": member}]}
    ).encode()


@pytest.mark.parametrize("depth", [1, 5, MAX_DEPTH - 3, MAX_DEPTH + 1, 500, 900])
def test_nesting_depth_is_exact(depth):
    body = json.dumps(nested(depth)).encode()
    assert (
        nesting_depth(body) == max(depth, MAX_DEPTH) if depth <= MAX_DEPTH else nesting_depth(body) == depth
    )


def test_brackets_in_strings_and_escapes_do_not_count():
    s = "[[[{{{" * 100 + '\\"[[[' + "\\\\"
    body = json.dumps({"a": [s] * 50, "b": [[["ok"]]]}).encode()
    assert nesting_depth(body) == 4
    body = json.dumps([s, nested(MAX_DEPTH + 2), '"\\"]]]]']).encode()
    assert nesting_depth(body) == MAX_DEPTH + 3


@pytest.mark.parametrize("decode", [decode_chat, decode_json])
def test_a_member_nested_500_deep_is_a_400(decode):
    with pytest.raises(InvalidRequest) as e:
        decode(chat(nested(500)))
    assert e.value.status == 400 and e.value.code == "invalid_json"
    assert "nested 503 levels deep" in e.value.message
    assert decode(chat(nested(MAX_DEPTH - 3))) is not None  # at the bound: accepted


def test_depth_check_of_a_4_mib_body_is_fast():
    body = json.dumps({"messages": [{"role": "user", "content": '"[{'}] * 200_000}).encode()
    t = time.process_time()
    assert nesting_depth(body) == 3
    assert time.process_time() - t < 0.5  # tens of ms; generous for a loaded 2-core machine


def test_rendered_chars_counts_every_field_and_stops_early():
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 100_000}}]
    calls = [{"role": "assistant", "tool_calls": [{"function": {"name": "g", "arguments": "a" * 50_000}}]}]
    assert rendered_chars([{"role": "user", "content": "hi"}], tools) > 100_000
    assert rendered_chars(calls) > 50_000
    assert rendered_chars(nested(100_000), stop_after=1000) < 1100  # the walk ends once past the bound
    assert prompt_floor([{"role": "user", "content": [{"type": "text", "text": "abc"}]}], tools) == 100_004


def test_check_fits_refuses_what_cannot_fit():
    check_fits(2 * 81 * 100 - 1, 81, 100)
    with pytest.raises(ContextLengthExceeded) as e:
        check_fits(2 * 81 * 100, 81, 100, param="prompt")
    assert e.value.status == 400 and e.value.param == "prompt"
