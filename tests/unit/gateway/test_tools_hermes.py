"""Hermes tool format: preamble, history rendering, llguidance grammars (driven with the real tokenizer),
and the streaming parser (the same calls and content however the output is split)."""

from __future__ import annotations

import json
import re

import llguidance as llg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.model_path import default_model_path
from backend.protocol import SamplingParams
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import InvalidRequest
from gateway.generation.events import TextDelta
from gateway.generation.request import GenerationRequest
from gateway.openai.stream import ChatStream
from gateway.streaming import ResponseWriter
from gateway.tools import HermesFormat, HermesParser, ToolCallDelta, parse_tools, tool_format
from gateway.tools.parser import json_members
from gateway.tools.spec import relocate_refs
from templating.tokenizer import load_tokenizer

H = HermesFormat()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now. Units: {c|f} # not a comment // nor this %json",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now-2"}}
BOOK = {  # pydantic-style $defs/$ref, nested objects
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {"who": {"$ref": "#/$defs/Person"}, "n": {"type": "integer"}},
            "required": ["who", "n"],
            "$defs": {
                "Person": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "tags": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["name"],
                }
            },
        },
    },
}


def plan(choice="auto", parallel=True, tools=(WEATHER, NOW, BOOK)):
    return parse_tools(list(tools), choice, parallel)


def call(name: str, args: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"


PARIS = call("get_weather", {"city": "Paris"})
BOOKED = call("book", {"who": {"name": 'Ann } </tool_call> "x"', "tags": ["a}", "東京 ☀"]}, "n": 2})


# ---------------------------------------------------------------------------------------------------
# Grammar
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tk():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def lt(tk):
    return llg.LLTokenizer(tk.tokenizer.to_str(), n_vocab=tk.vocab_size, eos_token=sorted(tk.stop_token_ids))


def accepts(tk, lt, grammar: str, text: str) -> bool:
    m = llg.LLMatcher(lt, llg.LLMatcher.grammar_from_lark(grammar), log_level=0)
    return m.consume_tokens(tk.encode_plain(text)) and m.is_accepting()


CASES = [
    ("auto", True),
    ("auto", False),
    ("required", True),
    ("required", False),
    ({"type": "function", "function": {"name": "book"}}, True),
]


@pytest.mark.parametrize(("choice", "parallel"), CASES)
def test_grammars_validate_without_warnings(lt, choice, parallel):
    g = llg.LLMatcher.grammar_from_lark(H.grammar(plan(choice, parallel)))
    assert llg.LLMatcher.validate_grammar_with_warnings(g, lt) == (False, [])


def test_none_is_unconstrained():
    assert H.grammar(plan("none")) is None


def test_required_calls(tk, lt):
    g = H.grammar(plan("required"))
    for ok in (
        PARIS,
        BOOKED,
        f"{PARIS}\n{BOOKED}",
        call("now-2", {}),
        call("get_weather", {"city": "x", "unit": "f"}),
    ):
        assert accepts(tk, lt, g, ok), ok
    bad = [
        "Hello",  # text instead of a call
        call("get_weathr", {"city": "Paris"}),  # unknown function
        call("get_weather", {}),  # missing required argument
        call("get_weather", {"city": "Paris", "unit": "k"}),  # enum
        call("book", {"who": {"tags": []}, "n": 1}),  # $ref'd schema enforced
        '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',  # order
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>',  # spacing
        PARIS + "\nbye",  # text after the calls
        PARIS + PARIS,  # no separator
    ]
    for text in bad:
        assert not accepts(tk, lt, g, text), text
    one = H.grammar(plan("required", parallel=False))
    assert accepts(tk, lt, one, PARIS) and not accepts(tk, lt, one, f"{PARIS}\n{PARIS}")


def test_named_is_one_call_of_that_function(tk, lt):
    g = H.grammar(plan({"type": "function", "function": {"name": "get_weather"}}))
    assert accepts(tk, lt, g, PARIS)
    assert not accepts(tk, lt, g, BOOKED) and not accepts(tk, lt, g, f"{PARIS}\n{PARIS}")
    assert not accepts(tk, lt, g, "Sure!")


def test_auto_text_or_calls(tk, lt):
    g = H.grammar(plan("auto"))
    for ok in ("", "Hello there.", "a < b and <tool", PARIS, f"{PARIS}\n{BOOKED}", "Let me check.\n" + PARIS):
        assert accepts(tk, lt, g, ok), ok
    for bad in ("I will <tool_call> it", "<tool_call>\nnope", PARIS + "\ndone", call("nope", {})):
        assert not accepts(tk, lt, g, bad), bad
    one = H.grammar(plan("auto", parallel=False))
    assert accepts(tk, lt, one, "x\n" + PARIS) and not accepts(tk, lt, one, f"{PARIS}\n{PARIS}")


def test_strict_tool_is_not_lenient(lt):
    odd = {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}
    lenient = plan(tools=[{"type": "function", "function": {"name": "f", "parameters": odd}}])
    strict = plan(tools=[{"type": "function", "function": {"name": "f", "parameters": odd, "strict": True}}])
    is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(
        llg.LLMatcher.grammar_from_lark(H.grammar(lenient)), lt
    )
    assert not is_error and msgs  # a warning: "not" is ignored
    assert llg.LLMatcher.validate_grammar_with_warnings(
        llg.LLMatcher.grammar_from_lark(H.grammar(strict)), lt
    )[0]


def test_many_tools_compile_fast(lt):
    import time

    tools = [{**BOOK, "function": {**BOOK["function"], "name": f"book_{i}"}} for i in range(30)]
    t = time.perf_counter()
    g = llg.LLMatcher.grammar_from_lark(H.grammar(plan("required", tools=tools)))
    assert llg.LLMatcher.validate_grammar_with_warnings(g, lt) == (False, [])
    llg.LLMatcher(lt, g, log_level=0).compute_bitmask()
    assert time.perf_counter() - t < 1.0


# ---------------------------------------------------------------------------------------------------
# Preamble and history
# ---------------------------------------------------------------------------------------------------


def test_preamble():
    text = H.preamble(plan())
    assert text.startswith("# Tools\n\nYou may call one or more functions")
    inside = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].split("\n")
    assert [json.loads(line) for line in inside] == [
        WEATHER,
        {
            "type": "function",
            "function": {
                "name": "now-2",
                "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
            },
        },
        BOOK,
    ]
    assert text.endswith(
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    assert H.preamble(plan("required")).endswith("You must call at least one function now.")
    assert H.preamble(plan("required", False)).endswith("You must call exactly one function now.")
    assert H.preamble(plan({"type": "function", "function": {"name": "book"}})).endswith(
        'You must call the function "book" now.'
    )
    assert H.preamble(plan("auto", False)).endswith("Call at most one function.")
    assert H.preamble(plan("none")) == ""


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "bad"}]},
    {"role": "assistant", "content": "Paris: 18C."},
]


def test_render_history():
    out = H.render_history(HISTORY, plan())
    assert out[0] == {"role": "system", "content": "Be brief.\n\n" + H.preamble(plan())}
    assert out[1] == HISTORY[1]
    assert out[2] == {
        "role": "assistant",
        "content": PARIS + '\n<tool_call>\n{"name": "get_weather", "arguments": "{oops"}\n</tool_call>',
    }
    assert out[3] == {
        "role": "user",
        "content": "<tool_response>\n18C\n</tool_response>\n<tool_response>\nbad\n</tool_response>",
    }
    assert out[4] == HISTORY[5] and len(out) == 5
    assert HISTORY[2]["tool_calls"] and HISTORY[0]["content"] == "Be brief."  # input untouched


def test_render_history_without_system_or_plan():
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Checking.", "function_call": {"name": "now-2", "arguments": "{}"}},
        {"role": "function", "name": "now-2", "content": "noon"},
    ]
    out = H.render_history(msgs, plan("required"))
    assert out[0] == {"role": "system", "content": H.preamble(plan("required"))}
    assert out[2]["content"] == 'Checking.\n<tool_call>\n{"name": "now-2", "arguments": {}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\nnoon\n</tool_response>"}
    assert H.render_history(msgs, None) == out[1:] == H.render_history(msgs, plan("none"))


@pytest.mark.parametrize("bad", [["x"], [{"function": {"arguments": "{}"}}], [{"function": "f"}]])
def test_render_history_rejects_malformed_calls(bad):
    with pytest.raises(InvalidRequest) as e:
        H.render_history([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": bad}], None)
    assert e.value.param == "messages[1].tool_calls[0]"


def test_history_calls_parse_back():
    rendered = H.render_history(HISTORY, None)[2]["content"]
    p = HermesParser()
    content, _ = p.feed(rendered)
    assert content + p.finish()[0] == ""
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", "{oops"),
    ]


@pytest.mark.parametrize("args", ["[" * 1000, "[" * 100_000, "[" * 3000 + "]" * 3000, '{"a": ' * 2000])
def test_render_history_keeps_too_deep_arguments_as_a_string(args):
    msgs = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": args}}]}]
    body = H.render_history(msgs, None)[0]["content"].split("\n")[1]
    assert json.loads(body) == {"name": "f", "arguments": args}


def test_omitted_parameters_grammar_takes_no_arguments(tk, lt):
    g = H.grammar(plan("required", tools=[NOW]))
    assert accepts(tk, lt, g, call("now-2", {}))
    assert not accepts(tk, lt, g, call("now-2", {"x": 1}))


def test_relocate_refs_is_iterative():
    """No recursion: a 5000-level schema is copied (parse_tools refuses it, but nothing may raise here)."""
    deep: dict = {"$ref": "#/$defs/A", "enum": [{"$ref": "#/kept"}]}
    for _ in range(5000):
        deep = {"items": [deep], "const": {"$ref": "#/kept"}}
    out = relocate_refs(deep, "#/properties/arguments")
    node = out
    for _ in range(5000):
        assert node is not deep and node["const"] == {"$ref": "#/kept"}
        node, deep = node["items"][0], deep["items"][0]
    assert node == {"$ref": "#/properties/arguments/$defs/A", "enum": [{"$ref": "#/kept"}]}
    assert deep["$ref"] == "#/$defs/A"  # input untouched
    assert relocate_refs(BOOK["function"]["parameters"], "#/p")["properties"]["who"] == {
        "$ref": "#/p/$defs/Person"
    }
    assert relocate_refs("x", "#/p") == "x"


def test_tool_format_is_hermes():
    assert tool_format(None).name == "hermes" and tool_format("{{ messages }}") is tool_format(None)
    assert isinstance(H.parser(plan()), HermesParser)


# ---------------------------------------------------------------------------------------------------
# Streaming parser
# ---------------------------------------------------------------------------------------------------

ID = re.compile(r"call_[A-Za-z0-9]{24}")


def run(chunks: list[str]) -> tuple[str, list[tuple[str, str]], bool]:
    """Feed ``chunks``; check the delta shapes; return (content, [(name, arguments)], incomplete)."""
    p = HermesParser()
    content: list[str] = []
    built: list[list[str]] = []  # [id, name, arguments] per index
    for step in [*(lambda c=c: p.feed(c) for c in chunks), p.finish]:
        text, deltas = step()
        content.append(text)
        for d in deltas:
            assert isinstance(d, ToolCallDelta)
            if d.id is not None:
                assert d.index == len(built) and d.name and d.arguments == "" and ID.fullmatch(d.id)
                built.append([d.id, d.name, ""])
            else:
                assert d.name is None and d.arguments and d.index == len(built) - 1
                built[d.index][2] += d.arguments
    assert [tuple(b) for b in built] == [(c.id, c.name, c.arguments) for c in p.calls]
    assert len({c.id for c in p.calls}) == len(p.calls)
    return "".join(content), [(c.name, c.arguments) for c in p.calls], p.incomplete


OUTPUTS = {
    "text": ("Hello <tool is not a call; a < b. ", "Hello <tool is not a call; a < b. ", [], False),
    "one": (PARIS, "", [("get_weather", '{"city": "Paris"}')], False),
    "two": (
        f"{PARIS}\n{BOOKED}\n",
        "",
        [("get_weather", '{"city": "Paris"}'), ("book", BOOKED.split('"arguments": ', 1)[1][:-14])],
        False,
    ),
    "text around": (
        "Let me check. \n" + PARIS + "\n\nDone  ",
        "Let me check.Done  ",
        [("get_weather", '{"city": "Paris"}')],
        False,
    ),
    "escapes": (
        '<tool_call>\n{"name": "f", "arguments": {"s": "a\\"}\\\\", "t": ["<tool_call>", "}"]} }\n</tool_call>',
        "",
        [("f", '{"s": "a\\"}\\\\", "t": ["<tool_call>", "}"]}')],
        False,
    ),
    "other order": (
        '<tool_call>{"arguments":{"x":1},"name":"f"}</tool_call>',
        "",
        [("f", '{"x":1}')],
        False,
    ),
    "not an object": ('<tool_call>\n{"name": "f", "arguments": 5}\n</tool_call>', "", [("f", "5")], False),
    "cut in args": (
        '<tool_call>\n{"name": "f", "arguments": {"a": "x</tool_c',
        "",
        [("f", '{"a": "x</tool_c')],
        True,
    ),
    "cut in marker": (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_c',
        "",
        [("f", '{"a": 1}')],
        False,
    ),
    "cut in head": ('ok <tool_call>\n{"name": "f", "argu', 'ok<tool_call>\n{"name": "f", "argu', [], True),
    "cut in start": ("ok <tool_ca", "ok <tool_ca", [], False),
    "unparsable": ("<tool_call>\n[1, 2]\n</tool_call>\nx", "<tool_call>\n[1, 2]\n</tool_call>x", [], True),
    "broken after head": (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1},}\n</tool_call>',
        "",
        [("f", '{"a": 1}')],
        True,
    ),
}


@pytest.mark.parametrize("name", OUTPUTS)
def test_every_split_gives_the_same_result(name):
    text, content, calls, incomplete = OUTPUTS[name]
    assert run([text]) == (content, calls, incomplete)
    assert run(list(text)) == (content, calls, incomplete)
    for i in range(len(text) + 1):
        assert run([text[:i], text[i:]]) == (content, calls, incomplete), i


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_splits(data):
    text = data.draw(st.sampled_from([v[0] for v in OUTPUTS.values()]))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert run(chunks) == run([text])


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(st.sampled_from('ab }{"\\/<>_tool_call\n☀'), max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.dictionaries(st.text(max_size=5), JSON, max_size=3), min_size=1, max_size=3), st.data())
def test_generated_calls_round_trip(args_list, data):
    text = "\n".join(call("f", a) for a in args_list)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    expected = [("f", json.dumps(a, ensure_ascii=False)) for a in args_list]
    assert run(chunks) == ("", expected, False)


DEEP = "[" * 3000 + "]" * 3000  # valid JSON the decoder cannot nest into (RecursionError)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (  # announced, then unparsable: stays a call with the argument text streamed
            f'<tool_call>\n{{"name": "f", "arguments": {{"a": {DEEP}}}}}\n</tool_call>',
            "",
            [("f", f'{{"a": {DEEP}}}')],
        ),
        (  # never announced: given back as content
            f'<tool_call>\n{{"arguments": {DEEP}, "name": "f"}}\n</tool_call>',
            f'<tool_call>\n{{"arguments": {DEEP}, "name": "f"}}\n</tool_call>',
            [],
        ),
        (  # cut inside: finish() parses what it has
            '<tool_call>\n{"name": "f", "arguments": ' + "[" * 3000,
            "",
            [("f", "[" * 3000)],
        ),
    ],
    ids=["announced", "other order", "cut"],
)
def test_too_deep_output_is_unparsable_not_an_error(text, content, calls):
    assert json_members(f'{{"a": {DEEP}}}') is None
    assert run([text]) == (content, calls, True)
    assert run(list(text)) == (content, calls, True)


def test_arguments_stream_before_the_block_ends():
    p = HermesParser()
    assert p.feed('Hi <tool_call>\n{"name": "get_weather", "arguments": ') == ("Hi", [])
    content, deltas = p.feed('{"city": "Pa')
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [
        (0, "get_weather", ""),
        (0, None, '{"city": "Pa'),
    ]
    assert p.feed('ris"}') == ("", [ToolCallDelta(index=0, arguments='ris"}')])
    assert p.feed("}\n</tool_call>") == ("", [])
    assert p.finish() == ("", []) and not p.incomplete
    assert p.calls[0].arguments == '{"city": "Paris"}'


def test_grammar_output_parses(tk, lt):
    """A text the auto grammar accepts comes out of the parser as its calls."""
    text = "Checking both.\n" + f"{PARIS}\n{BOOKED}"
    assert accepts(tk, lt, H.grammar(plan()), text)
    detok = IncrementalDetokenizer.for_tokenizer(tk)
    content, calls, incomplete = run([detok.feed(i) for i in tk.encode_plain(text)] + [detok.flush()])
    assert content == "Checking both." and not incomplete
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("book", json.loads(BOOKED.split("\n")[1])["arguments"]),
    ]


def test_chat_stream_sends_each_call_once_per_chunk():
    """The parser's header and first fragment of a call (same index, one event) are one ``tool_calls``
    entry: a client reading ``tool_calls[0]`` sees the fragment too."""

    async def send(msg: dict) -> None:
        del msg

    req = GenerationRequest(
        request_id="chatcmpl-x", api="openai", model="m", prompt_ids=[1], sampling=SamplingParams(n=1)
    )
    stream = ChatStream(None, req, ResponseWriter(send))  # type: ignore[arg-type]
    p = HermesParser()
    text, deltas = p.feed(f'Hi {PARIS}\n<tool_call>\n{{"name": "now-2", "arguments": {{"a')
    assert [d.index for d in deltas] == [0, 0, 1, 1]
    sent = json.loads(stream.delta(TextDelta(index=0, text=text, tool_calls=deltas)))
    first = p.calls[0]
    assert sent["choices"][0]["delta"] == {
        "content": "Hi",
        "tool_calls": [
            {
                "index": 0,
                "id": first.id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "index": 1,
                "id": deltas[2].id,
                "type": "function",
                "function": {"name": "now-2", "arguments": '{"a'},
            },
        ],
    }
    more = [ToolCallDelta(index=1, arguments='": '), ToolCallDelta(index=1, arguments="1}")]
    sent = json.loads(stream.delta(TextDelta(index=0, text="", tool_calls=more)))
    assert sent["choices"][0]["delta"] == {"tool_calls": [{"index": 1, "function": {"arguments": '": 1}'}}]}


def test_history_tool_calls_must_be_an_array():
    """``tool_calls`` given as one object (not an array) is a 400 naming it, not rendered as if listed."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": call}]
    with pytest.raises(InvalidRequest) as ei:
        HermesFormat().render_history(msgs, None)
    assert ei.value.param == "messages[1].tool_calls"
