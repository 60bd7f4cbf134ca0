"""Tool-call formats per model family: the choice from the real chat templates of the llama-cpp-python sdist,
the Llama 3 JSON and Mistral ``[TOOL_CALLS]`` grammars (driven with the real SmolLM2 tokenizer), their
streaming parsers (the same calls and content however the output is split, malformed output as content)
and their history rendering. No model runs here."""

from __future__ import annotations

import json
import re

import jinja2
import llguidance as llg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.model_path import default_model_path
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import InvalidRequest
from gateway.openai.constraints import chat_constraints
from gateway.structured import formats
from gateway.structured.checker import GrammarChecker
from gateway.tools import Llama3Format, MistralFormat, ToolCallDelta, parse_tools, tool_format
from gateway.tools.parser import CallsOnly
from templating.tokenizer import load_tokenizer

L, M, V = Llama3Format(), MistralFormat(), MistralFormat(v11=True)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now-2"}}
TOOLS = [WEATHER, NOW]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def plan(choice="auto", parallel=True, tools=TOOLS):
    return parse_tools(list(tools), choice, parallel)


def lcall(name: str, args: object, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: args}, ensure_ascii=False)


PARIS = {"city": "Paris"}
ODD = {"city": 'Ann } ] ; "x" [TOOL_CALLS] <|python_tag|> 東京 ☀', "unit": "c"}


# ---------------------------------------------------------------------------------------------------
# Choice of format
# ---------------------------------------------------------------------------------------------------

EXPECTED_FORMAT = {
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral-v11",
    "mistralai-Ministral-3-14B-Reasoning-2512": "mistral-v11",
    "unsloth-mistral-Devstral-Small-2507": "mistral-v11",
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "Qwen-Qwen3-0.6B": "hermes",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes",  # a Llama 3 model trained on Hermes calls
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "hermes",  # Llama 3 weights, no tool template
}


def test_format_chosen_from_every_real_template(llama_cpp_models_dir):
    found = {
        p.stem: tool_format(p.read_text()).name for p in (llama_cpp_models_dir / "templates").glob("*.jinja")
    }
    assert len(found) >= 60
    assert {k: found[k] for k in EXPECTED_FORMAT} == EXPECTED_FORMAT
    others = {k for k, v in found.items() if v != "hermes"} - set(EXPECTED_FORMAT)
    assert not others, others  # only the Llama 3 and Mistral templates leave Hermes
    assert tool_format(None).name == "hermes"


@pytest.mark.parametrize(
    ("stem", "fmt"),
    [
        ("meta-llama-Llama-3.2-3B-Instruct", L),
        ("mistralai-Mistral-Nemo-Instruct-2407", M),
        ("Mistral-Small-3.2-24B-Instruct-2506", V),
        ("unsloth-mistral-Devstral-Small-2507", V),
    ],
)
def test_template_history_call_parses_back(llama_cpp_models_dir, stem, fmt):
    """What the family's own template writes for an assistant call is what the parser reads as that call."""
    src = (llama_cpp_models_dir / "templates" / f"{stem}.jinja").read_text()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(ValueError(m))
    env.globals["strftime_now"] = lambda fmt: "2026-01-02"
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    call = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"},
    ]
    text = env.from_string(src).render(messages=msgs, tools=TOOLS, bos_token="<s>", eos_token="</s>")
    marker = "<|start_header_id|>assistant<|end_header_id|>\n\n" if fmt is L else "[/INST]"
    written = text.split(marker, 1)[1].split("<|eot_id|>" if fmt is L else "</s>", 1)[0]
    assert written.startswith("{" if fmt is L else "[TOOL_CALLS]")
    assert run(fmt, [written]) == ("", [("get_weather", '{"city": "Paris"}')], False)


def test_constraints_use_the_templates_format():
    """``chat_constraints`` takes grammar and parser from the format of the served template."""

    class Req:
        tools, tool_choice, parallel_tool_calls = TOOLS, "required", False
        response_format = structured_outputs = None

    class Template:
        source = '<|start_header_id|>{{ tools }} {{ tool_calls }} "parameters"'
        supports_tools = supports_tool_calls = True

    class Gw:
        template = Template()

    out = chat_constraints(Gw(), Req(), [{"role": "user", "content": "x"}])  # type: ignore[arg-type]
    assert (
        out.grammar is not None
        and '"parameters"' in out.grammar.source
        and out.grammar_param == "tool_choice"
    )
    assert out.parser is not None and isinstance(out.parser(), CallsOnly)
    Req.tool_choice = "auto"
    out = chat_constraints(Gw(), Req(), [{"role": "user", "content": "x"}])  # type: ignore[arg-type]
    assert out.grammar is None and out.parser is not None and out.tools == TOOLS


# ---------------------------------------------------------------------------------------------------
# Grammars
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


@pytest.mark.parametrize("fmt", [L, M, V], ids=["llama3", "mistral", "mistral-v11"])
@pytest.mark.parametrize(("choice", "parallel"), [("required", True), ("required", False), (NAMED, True)])
def test_forced_grammars_validate_without_warnings(lt, fmt, choice, parallel):
    g = llg.LLMatcher.grammar_from_lark(fmt.grammar(plan(choice, parallel)))
    assert llg.LLMatcher.validate_grammar_with_warnings(g, lt) == (False, [])


@pytest.mark.parametrize("fmt", [L, M, V], ids=["llama3", "mistral", "mistral-v11"])
def test_auto_and_none_are_unconstrained(fmt):
    assert fmt.grammar(plan("auto")) is None and fmt.grammar(plan("none")) is None


def test_llama3_forced_call(tk, lt):
    g = L.grammar(plan("required"))
    for ok in (lcall("get_weather", PARIS), lcall("get_weather", ODD), lcall("now-2", {})):
        assert accepts(tk, lt, g, ok), ok
    for bad in (
        "Hello",
        lcall("get_weather", PARIS, key="arguments"),  # the family's key is "parameters"
        lcall("get_weather", {}),  # required argument
        lcall("nope", {}),
        f"{lcall('now-2', {})}; {lcall('now-2', {})}",  # one call per message, as the templates say
        '<|python_tag|>{"name": "now-2", "parameters": {}}',  # the control token is not text
    ):
        assert not accepts(tk, lt, g, bad), bad
    named = L.grammar(plan(NAMED))
    assert accepts(tk, lt, named, lcall("get_weather", PARIS)) and not accepts(
        tk, lt, named, lcall("now-2", {})
    )


def test_mistral_forced_calls(tk, lt):
    one, two = lcall("get_weather", PARIS, "arguments"), lcall("now-2", {}, "arguments")
    g = M.grammar(plan("required"))
    for ok in (f"[{one}]", f"[{one}, {two}]", f"[{lcall('get_weather', ODD, 'arguments')}]"):
        assert accepts(tk, lt, g, ok), ok
    for bad in (one, f"[{one},{two}]", "[]", f"[{lcall('get_weather', PARIS)}]", f"[TOOL_CALLS][{one}]"):
        assert not accepts(tk, lt, g, bad), bad
    single = M.grammar(plan("required", parallel=False))
    assert accepts(tk, lt, single, f"[{one}]") and not accepts(tk, lt, single, f"[{one}, {two}]")
    named = M.grammar(plan(NAMED))
    assert accepts(tk, lt, named, f"[{one}]") and not accepts(tk, lt, named, f"[{two}]")


def test_mistral_v11_forced_calls(tk, lt):
    g = V.grammar(plan("required"))
    one, two = f"get_weather{json.dumps(PARIS)}", "now-2{}"
    for ok in (one, one + two, f"get_weather{json.dumps(ODD, ensure_ascii=False)}"):
        assert accepts(tk, lt, g, ok), ok
    for bad in (f"[TOOL_CALLS]{one}", "get_weather[ARGS]{}", "get_weather{}", f"{one} {two}", "Sure"):
        assert not accepts(tk, lt, g, bad), bad
    single = V.grammar(plan("required", parallel=False))
    assert accepts(tk, lt, single, one) and not accepts(tk, lt, single, one + two)
    named = V.grammar(plan(NAMED))
    assert accepts(tk, lt, named, one) and not accepts(tk, lt, named, two)


@pytest.mark.parametrize("fmt", [L, M, V], ids=["llama3", "mistral", "mistral-v11"])
def test_forced_grammar_output_parses(tk, lt, fmt):
    """Text a forced grammar accepts, tokenized and detokenized, comes out of the parser as its call."""
    text = {
        "llama3": lcall("get_weather", ODD),
        "mistral": f"[{lcall('get_weather', ODD, 'arguments')}]",
        "mistral-v11": f"get_weather{json.dumps(ODD, ensure_ascii=False)}",
    }[fmt.name]
    assert accepts(tk, lt, fmt.grammar(plan("required", parallel=False)), text)
    detok = IncrementalDetokenizer.for_tokenizer(tk)
    chunks = [detok.feed(i) for i in tk.encode_plain(text)] + [detok.flush()]
    assert run(fmt, chunks) == ("", [("get_weather", json.dumps(ODD, ensure_ascii=False))], False)


async def test_vocabulary_load_does_not_count_against_the_check_limit(tk):
    """Loading a big vocabulary into llguidance takes seconds (Qwen2's 152k tokens on a busy CPU); the
    first forced call must not be refused for it: only the compile and walk are timed."""
    import time

    def slow_vocabulary() -> str:
        time.sleep(1.5)
        return tk.tokenizer.to_str()

    checker = GrammarChecker(slow_vocabulary, tk.vocab_size, sorted(tk.stop_token_ids), timeout=1.0)
    grammar = formats.make_grammar("lark", L.grammar(plan("required")))
    await checker.check(grammar, "tool_choice")  # raised InvalidRequest "did not compile within 1 s" before


# ---------------------------------------------------------------------------------------------------
# Streaming parsers
# ---------------------------------------------------------------------------------------------------

IDS = {"llama3": re.compile(r"call_[A-Za-z0-9]{24}"), "mistral": re.compile(r"[A-Za-z0-9]{9}")}
IDS["mistral-v11"] = IDS["mistral"]


def run(fmt, chunks: list[str], p=None) -> tuple[str, list[tuple[str, str]], bool]:
    """Feed ``chunks``; check the delta shapes; return (content, [(name, arguments)], incomplete)."""
    p = p or fmt.parser(plan())
    content: list[str] = []
    built: list[list[str]] = []  # [id, name, arguments] per index
    for step in [*(lambda c=c: p.feed(c) for c in chunks), p.finish]:
        text, deltas = step()
        content.append(text)
        for d in deltas:
            assert isinstance(d, ToolCallDelta)
            if d.id is not None:
                assert d.index == len(built) and d.name and d.arguments == ""
                assert IDS[fmt.name].fullmatch(d.id), d.id
                built.append([d.id, d.name, ""])
            else:
                assert d.name is None and d.arguments and d.index == len(built) - 1
                built[d.index][2] += d.arguments
    assert [tuple(b) for b in built] == [(c.id, c.name, c.arguments) for c in p.calls]
    assert len({c.id for c in p.calls}) == len(p.calls)
    return "".join(content), [(c.name, c.arguments) for c in p.calls], p.incomplete


ODD_JSON = json.dumps(ODD, ensure_ascii=False)
W = ("get_weather", '{"city": "Paris"}')
LLAMA_OUTPUTS = {
    "text": ("Hello { not a call; a < b.", "Hello { not a call; a < b.", [], False),
    "call": (lcall("get_weather", PARIS), "", [W], False),
    "python tag": ("<|python_tag|>" + lcall("get_weather", PARIS), "", [W], False),
    "whitespace": ("\n " + lcall("get_weather", PARIS) + " \n", "", [W], False),
    "arguments key": (lcall("get_weather", PARIS, "arguments"), "", [W], False),
    "type member": ('{"type": "function", "name": "now-2", "parameters": {}}', "", [("now-2", "{}")], False),
    "two calls": (
        f"{lcall('get_weather', ODD)}; {lcall('now-2', {})}",
        "",
        [("get_weather", ODD_JSON), ("now-2", "{}")],
        False,
    ),
    "other order": ('{"parameters": {"x": 1}, "name": "now-2"}', "", [("now-2", '{"x": 1}')], False),
    "json answer": ('{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', [], False),
    "json with a name": ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', [], False),
    "unknown function": (lcall("rm_rf", {}), lcall("rm_rf", {}), [], False),
    "unknown function, tagged": ("<|python_tag|>" + lcall("rm_rf", {}), "", [("rm_rf", "{}")], False),
    "text then tag": (
        "Let me see. <|python_tag|>" + lcall("now-2", {}),
        "Let me see.",
        [("now-2", "{}")],
        False,
    ),
    "cut in args": (
        '{"name": "get_weather", "parameters": {"city": "Pa',
        "",
        [("get_weather", '{"city": "Pa')],
        True,
    ),
    "cut in head": ('{"name": "get_wea', '{"name": "get_wea', [], True),
    "tag, not json": ("<|python_tag|>print(1)", "<|python_tag|>print(1)", [], True),
    "tag alone": ("<|python_tag|>", "<|python_tag|>", [], True),
    "partial tag": ("ok <|python_ta", "ok <|python_ta", [], False),
    "broken object": ('{"name": "now-2", "parameters": {}, }', "", [("now-2", "{}")], True),
    "text after": (lcall("now-2", {}) + "\nDone.", "Done.", [("now-2", "{}")], False),
}
MISTRAL_OUTPUTS = {
    "text": ("Hello [1] {x}", "Hello [1] {x}", [], False),
    "calls": (
        f"[TOOL_CALLS][{lcall('get_weather', ODD, 'arguments')}, {lcall('now-2', {}, 'arguments')}]",
        "",
        [("get_weather", ODD_JSON), ("now-2", "{}")],
        False,
    ),
    "no marker": (f"[{lcall('get_weather', PARIS, 'arguments')}]", "", [W], False),
    "bare object": (f"[TOOL_CALLS] {lcall('get_weather', PARIS, 'arguments')}", "", [W], False),
    "with id": (
        '[TOOL_CALLS][{"name": "now-2", "arguments": {}, "id": "abcDEF123"}]',
        "",
        [("now-2", "{}")],
        False,
    ),
    "text first": (
        f"Sure. [TOOL_CALLS][{lcall('now-2', {}, 'arguments')}] ok",
        "Sure.ok",
        [("now-2", "{}")],
        False,
    ),
    "json answer": ("[1, 2]", "[1, 2]", [], False),
    "list of objects": ('[{"a": 1}]', '[{"a": 1}]', [], False),
    "no closing bracket": (f"[TOOL_CALLS][{lcall('now-2', {}, 'arguments')}", "", [("now-2", "{}")], False),
    "cut in args": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci',
        "",
        [("get_weather", '{"ci')],
        True,
    ),
    "cut after comma": (f"[TOOL_CALLS][{lcall('now-2', {}, 'arguments')}, ", "", [("now-2", "{}")], True),
    "marker, not json": ("[TOOL_CALLS] sorry", "[TOOL_CALLS] sorry", [], True),
    "marker alone": ("[TOOL_CALLS]", "[TOOL_CALLS]", [], True),
    "unparsable": ('[TOOL_CALLS][{"name" 1}] x', '[TOOL_CALLS][{"name" 1}x', [], True),
}
V11_OUTPUTS = {
    "text": ("Hello world, get_weather is sunny", "Hello world, get_weather is sunny", [], False),
    "call": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [W], False),
    "two calls": (
        f"[TOOL_CALLS]get_weather[ARGS]{ODD_JSON}[TOOL_CALLS]now-2[ARGS]{{}}",
        "",
        [("get_weather", ODD_JSON), ("now-2", "{}")],
        False,
    ),
    "call id": ('[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Paris"}', "", [W], False),
    "markers dropped": ('get_weather{"city": "Paris"}now-2{}', "", [W, ("now-2", "{}")], False),
    "id marker dropped": ('get_weatherabcDEF123{"city": "Paris"}', "", [W], False),
    "text first": ("Sure. [TOOL_CALLS]now-2[ARGS]{} Done", "Sure.Done", [("now-2", "{}")], False),
    "a word like a name": ("now-2x is late", "now-2x is late", [], False),
    "name alone": ("now-2", "now-2", [], False),
    "unknown name": ('rm_rf{"a": 1}', 'rm_rf{"a": 1}', [], False),
    "unknown name, marked": ("[TOOL_CALLS]rm_rf[ARGS]{}", "", [("rm_rf", "{}")], False),
    "marker, no name": ("[TOOL_CALLS] sorry", "[TOOL_CALLS] sorry", [], True),
    "marker alone": ("[TOOL_CALLS]", "[TOOL_CALLS]", [], True),
    "cut in args": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', "", [("get_weather", '{"city": "Pa')], True),
    "bad json": ('[TOOL_CALLS]get_weather[ARGS]{"city": }', "", [("get_weather", '{"city": }')], True),
    "cut in name": ("[TOOL_CALLS]get_wea", "[TOOL_CALLS]get_wea", [], True),
}
CASES = (
    [(L, k, *v) for k, v in LLAMA_OUTPUTS.items()]
    + [(M, k, *v) for k, v in MISTRAL_OUTPUTS.items()]
    + [(V, k, *v) for k, v in V11_OUTPUTS.items()]
)


@pytest.mark.parametrize(
    ("fmt", "name", "text", "content", "calls", "incomplete"),
    CASES,
    ids=[f"{c[0].name}-{c[1]}" for c in CASES],
)
def test_every_split_gives_the_same_result(fmt, name, text, content, calls, incomplete):
    del name
    assert run(fmt, [text]) == (content, calls, incomplete)
    assert run(fmt, list(text)) == (content, calls, incomplete)
    for i in range(len(text) + 1):
        assert run(fmt, [text[:i], text[i:]]) == (content, calls, incomplete), i


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_random_splits(data):
    fmt, _, text, *_ = data.draw(st.sampled_from(CASES))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert run(fmt, chunks) == run(fmt, [text])


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(st.sampled_from('ab }{][;,"\\/<>|_TOOL\n☀'), max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.dictionaries(st.text(max_size=5), JSON, max_size=3), min_size=1, max_size=3), st.data())
def test_generated_calls_round_trip(args_list, data):
    fmt = data.draw(st.sampled_from([L, M, V]))
    if fmt is L:
        text = "; ".join(lcall("now-2", a) for a in args_list)
    elif fmt is M:
        text = "[TOOL_CALLS][" + ", ".join(lcall("now-2", a, "arguments") for a in args_list) + "]"
    else:
        text = "".join("[TOOL_CALLS]now-2[ARGS]" + json.dumps(a, ensure_ascii=False) for a in args_list)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert run(fmt, chunks) == ("", [("now-2", json.dumps(a, ensure_ascii=False)) for a in args_list], False)


def test_arguments_stream_before_the_call_ends():
    p = L.parser(plan())
    assert p.feed('{"name": "get_weather", "parameters": ') == ("", [])
    content, deltas = p.feed('{"city": "Pa')
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [
        (0, "get_weather", ""),
        (0, None, '{"city": "Pa'),
    ]
    assert p.feed('ris"}') == ("", [ToolCallDelta(index=0, arguments='ris"}')])
    assert p.feed("}") == ("", []) and p.finish() == ("", []) and not p.incomplete


def test_json_answer_streams_once_it_is_not_a_call():
    """Without a marker, JSON is held only until its first member shows it is not a call."""
    p = M.parser(plan())
    assert p.feed('[{"na') == ("", [])
    assert p.feed('me": "Bob", "age": 3') == ("", [])  # "Bob" is not an offered function, but no head yet
    p = L.parser(plan())
    assert p.feed('{"answer"') == ('{"answer"', [])
    assert p.feed(": 42}") == (": 42}", [])


DEEP = "[" * 3000 + "]" * 3000  # valid JSON the decoder cannot nest into (RecursionError)
TAGS = {"llama3": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}


@pytest.mark.parametrize("fmt", [L, M], ids=["llama3", "mistral"])
def test_too_deep_output_is_not_an_error(fmt):
    key = "parameters" if fmt is L else "arguments"
    announced = f'{{"name": "now-2", "{key}": {{"a": {DEEP}}}}}'
    assert run(fmt, [announced]) == ("", [("now-2", f'{{"a": {DEEP}}}')], True)
    other = f'{{"{key}": {DEEP}, "name": "now-2"}}'  # never announced, no marker: an answer, as content
    assert run(fmt, [other]) == (other, [], False)
    assert run(fmt, [TAGS[fmt.name] + other]) == (TAGS[fmt.name] + other, [], True)


@pytest.mark.parametrize("fmt", [L, M, V], ids=["llama3", "mistral", "mistral-v11"])
def test_without_parallel_calls_only_the_first_is_kept(fmt):
    text = {
        "llama3": f"{lcall('get_weather', PARIS)}; {lcall('now-2', {})}",
        "mistral": f"[TOOL_CALLS][{lcall('get_weather', PARIS, 'arguments')}, {lcall('now-2', {}, 'arguments')}]",
        "mistral-v11": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now-2[ARGS]{}',
    }[fmt.name]
    one = fmt.parser(plan(parallel=False))
    assert run(fmt, list(text), one) == ("", [W], False)
    assert run(fmt, [text]) == ("", [W, ("now-2", "{}")], False)


def test_calls_only_keeps_no_content():
    assert run(M, ["[TOOL_CALLS] sorry"], CallsOnly(M.parser(plan("required")))) == ("", [], True)


# ---------------------------------------------------------------------------------------------------
# Preamble and history (templates that do not render tools)
# ---------------------------------------------------------------------------------------------------

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "abcDEF123",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"},
    {"role": "tool", "tool_call_id": "x", "content": 'rain "later"'},
]


def test_llama3_history_and_preamble():
    out = L.render_history(HISTORY, plan())
    assert out[0]["content"].startswith("Be brief.\n\nGiven the following functions")
    assert json.dumps(WEATHER, indent=4) in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    }
    assert out[3] == {"role": "user", "content": 'sunny\nrain "later"'}
    assert run(L, [out[2]["content"]]) == ("", [W], False)
    assert L.preamble(plan("none")) == "" and L.preamble(plan(NAMED)).endswith('"get_weather" now.')


def test_mistral_history_and_preamble():
    out = M.render_history(HISTORY, plan("required", parallel=False))
    assert out[0]["content"].startswith('Be brief.\n\n[AVAILABLE_TOOLS][{"type": "function"')
    assert out[0]["content"].endswith("You must call exactly one function now.")
    assert out[2]["content"] == '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert (
        out[3]["content"]
        == '[TOOL_RESULTS]{"content": "sunny"}[/TOOL_RESULTS][TOOL_RESULTS]{"content": "rain \\"later\\""}[/TOOL_RESULTS]'
    )
    assert run(M, [out[2]["content"]]) == ("", [W], False)


def test_mistral_v11_history():
    out = V.render_history(HISTORY, None)
    assert out[2]["content"] == '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    assert out[3]["content"] == '[TOOL_RESULTS]sunny[/TOOL_RESULTS][TOOL_RESULTS]rain "later"[/TOOL_RESULTS]'
    assert run(V, [out[2]["content"]]) == ("", [W], False)
    assert "[TOOL_CALLS]<function-name>[ARGS]" in V.preamble(plan())


@pytest.mark.parametrize("fmt", [L, M, V], ids=["llama3", "mistral", "mistral-v11"])
def test_history_rejects_malformed_calls(fmt):
    bad = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}]
    with pytest.raises(InvalidRequest) as e:
        fmt.render_history(bad, None)
    assert e.value.param == "messages[0].tool_calls[0]"
