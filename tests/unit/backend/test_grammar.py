"""Grammar-constrained decoding on the real model (CPU, fp32) and real llguidance (``backend.grammar``).

Constrained choices stay inside their grammar (JSON Schema validated with ``jsonschema``; regex and Lark
give one of their options) and end with "stop" when the grammar is complete (last token in
``new_token_ids``, no ``stop_token_id``) or "length" at ``max_tokens``; unconstrained requests in the
same batch are untouched; a grammar that fails (compile or first mask) ends its request alone with
``grammar_error``; aborts (running or still compiling) release the matchers and every KV block; logprobs
are those of the masked distribution; the protocol carries ``Submit.grammar`` and the capability flags;
the compile cache compiles a grammar once and hands out independent matchers.
"""

from __future__ import annotations

import json
import math
import struct

import jsonschema
import msgspec
import pytest

from backend import cpu_kernels
from backend import grammar as G
from backend.engine import Engine, collect_tokens, final_output
from backend.model_runner import ModelRunner
from backend.protocol import (
    FEATURE_GRAMMAR,
    PROTOCOL_VERSION,
    Grammar,
    Hello,
    Ready,
    RequestError,
    RequestOutput,
    SamplingParams,
    Submit,
    encode_frame,
    from_backend_decoder,
    grammar_key,
    to_backend_decoder,
)
from templating.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
COLORS = 'start: "red" | "green" | "blue"'


def gram(kind: str, source: str | dict) -> Grammar:
    src = source if isinstance(source, str) else json.dumps(source)
    return Grammar(kind=kind, source=src, key=grammar_key(kind, src))


@pytest.fixture(scope="module")
def runner(model_path):
    """float32, every row through the row-invariant int4 kernel where it is built (else the exact mode)."""
    int4 = cpu_kernels.q4_ready()
    return ModelRunner(model_path, num_kv_blocks=128, generated_int4=int4, prompt_int4=int4)


@pytest.fixture(scope="module")
def tk(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="module")
def compiler(runner, tk):
    """One compiler (vocabulary built once) shared by the engines of this module, as the engine builds it."""
    c = G.GrammarCompiler(lambda: tk.tokenizer.to_str(), runner.vocab_size, list(runner.card.eos_token_ids))
    yield c
    c.close()


def chat(tk, user: str) -> list[int]:
    return tk.encode_with_specials(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def person_prompt(tk):
    return chat(tk, "Describe a club member as JSON with name, age and member.")


@pytest.fixture(scope="module")
def color_prompt(tk):
    return chat(tk, "Is the sky blue? What colour is grass?")


def assert_clean(eng: Engine) -> None:
    """Nothing left behind: no request, no compile, no running or waiting sequence, every KV block free."""
    assert eng.requests == {}
    assert eng.compiling == {}
    assert not eng.has_work()
    assert eng.block_manager.num_used_blocks == 0
    st = eng.stats()
    assert st.kv_blocks_used == 0 and st.running == 0 and st.waiting == 0
    eng.block_manager.check_invariants([])


def replay(compiler: G.GrammarCompiler, grammar: Grammar, tokens: list[int]) -> object:
    """A fresh matcher that has consumed ``tokens`` (asserting the grammar accepts each)."""
    m = compiler.compile(grammar)
    for t in tokens:
        assert m.consume_token(t), (t, G.error_message(m))
    return m


# ----------------------------------------------------------------------------- JSON Schema


def test_json_schema_sampled_choices_validate(runner, compiler, tk, person_prompt):
    """Sampled (temperature 1, several seeds, and n=3 forks): every "stop" choice is JSON valid under the
    schema, ends at its closing brace (the brace token in new_token_ids, no stop_token_id); every other
    choice is a prefix the grammar accepts."""
    eng = Engine(runner, grammar=compiler)
    g = gram("json_schema", PERSON)
    subs = [
        Submit(
            request_id=f"s{seed}",
            prompt_ids=person_prompt,
            sampling=SamplingParams(temperature=1.0, max_tokens=40, seed=seed),
            grammar=g,
        )
        for seed in (1, 2, 3)
    ]
    subs.append(
        Submit(
            request_id="n3",
            prompt_ids=person_prompt,
            sampling=SamplingParams(temperature=1.0, max_tokens=40, seed=11, n=3),
            grammar=g,
        )
    )
    res = eng.generate(subs)
    stops = 0
    choices = [(f"s{seed}", 0) for seed in (1, 2, 3)] + [("n3", i) for i in range(3)]
    seen = set()
    for rid, i in choices:
        outs = res[rid]
        assert all(isinstance(o, RequestOutput) for o in outs), outs
        fin = final_output(outs, i)
        assert fin is not None and fin.finish_reason in ("stop", "length"), fin
        toks = collect_tokens(outs, i)
        seen.add(tuple(toks))
        m = replay(compiler, g, toks)  # the whole output stays inside the grammar
        text = tk.decode(toks)
        if fin.finish_reason == "stop":
            stops += 1
            # stopped by the grammar, not by EOS: the last token is reported, no stop id
            assert fin.stop_token_id is None
            assert fin.new_token_ids and fin.new_token_ids[-1] == toks[-1]
            assert G.finished(m)
            assert text.endswith("}"), repr(text)  # nothing after the closing brace
            jsonschema.validate(json.loads(text), PERSON)
            assert fin.usage.completion_tokens == len(toks)
        else:
            assert len(toks) == 40 and not G.finished(m)
    assert stops >= 1
    assert len(seen) >= 3, "different seeds / forks gave the same output"
    assert_clean(eng)
    assert compiler.compiled >= 1


def test_max_tokens_gives_length(runner, compiler, tk, person_prompt):
    eng = Engine(runner, grammar=compiler)
    g = gram("json_schema", PERSON)
    (outs,) = eng.generate(
        [
            Submit(
                request_id="x",
                prompt_ids=person_prompt,
                sampling=SamplingParams(temperature=0.0, max_tokens=3),
                grammar=g,
            )
        ]
    ).values()
    fin = final_output(outs)
    assert fin.finish_reason == "length" and fin.stop_token_id is None
    toks = collect_tokens(outs)
    assert len(toks) == 3 and fin.usage.completion_tokens == 3
    assert tk.decode(toks).lstrip().startswith("{")
    m = replay(compiler, g, toks)
    assert not G.finished(m)
    assert_clean(eng)


# ----------------------------------------------------------------------------- regex, Lark


def test_regex_and_lark_greedy_pick_an_option(runner, compiler, tk, color_prompt):
    eng = Engine(runner, grammar=compiler)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    res = eng.generate(
        [
            Submit(
                request_id="re", prompt_ids=color_prompt, sampling=greedy, grammar=gram("regex", "(yes|no)")
            ),
            Submit(request_id="lark", prompt_ids=color_prompt, sampling=greedy, grammar=gram("lark", COLORS)),
            Submit(
                request_id="re3",
                prompt_ids=color_prompt,
                sampling=SamplingParams(temperature=1.0, max_tokens=10, seed=5, n=3),
                grammar=gram("regex", "(yes|no)"),
            ),
        ]
    )
    for rid, options, n in (
        ("re", {"yes", "no"}, 1),
        ("lark", {"red", "green", "blue"}, 1),
        ("re3", {"yes", "no"}, 3),
    ):
        for i in range(n):
            fin = final_output(res[rid], i)
            assert fin.finish_reason == "stop" and fin.stop_token_id is None, fin
            assert tk.decode(collect_tokens(res[rid], i)) in options
    assert_clean(eng)


# ----------------------------------------------------------------------------- no interference


def test_unconstrained_rows_untouched_by_constrained_neighbours(
    runner, compiler, person_prompt, color_prompt
):
    """Greedy tokens of unconstrained requests are the same alone and batched with constrained ones; the
    constrained greedy ones are batch-invariant too."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    free = [
        Submit(request_id="f0", prompt_ids=person_prompt, sampling=greedy),
        Submit(request_id="f1", prompt_ids=color_prompt, sampling=greedy),
    ]
    cons = [
        Submit(
            request_id="c0", prompt_ids=person_prompt, sampling=greedy, grammar=gram("json_schema", PERSON)
        ),
        Submit(request_id="c1", prompt_ids=color_prompt, sampling=greedy, grammar=gram("lark", COLORS)),
    ]
    eng = Engine(runner, grammar=compiler, enable_prefix_caching=False)
    alone = eng.generate(free)
    cons_alone = eng.generate(cons)
    assert eng.masks is not None
    mixed = eng.generate([cons[0], free[0], cons[1], free[1]])
    for rid in ("f0", "f1"):
        assert collect_tokens(mixed[rid]) == collect_tokens(alone[rid])
        assert final_output(mixed[rid]).finish_reason == final_output(alone[rid]).finish_reason
        assert final_output(mixed[rid]).stop_token_id == final_output(alone[rid]).stop_token_id
    for rid in ("c0", "c1"):
        assert collect_tokens(mixed[rid]) == collect_tokens(cons_alone[rid])
    # the unconstrained person answer is not the constrained one (the mask did something)
    assert collect_tokens(alone["f0"]) != collect_tokens(mixed["c0"])
    assert_clean(eng)


def test_preemption_and_chunked_prefill_keep_constrained_outputs_exact(runner, compiler, person_prompt):
    """A tiny KV pool (preemption by recompute) and 8-token prefill chunks: the seeded constrained
    choices (n=4, one request so admission does not depend on compile timing) are token for token those
    of a roomy engine, so each matcher stays in step with its sequence across recomputes."""
    g = gram("json_schema", PERSON)
    n = 4
    sub = Submit(
        request_id="p",
        prompt_ids=person_prompt,
        sampling=SamplingParams(temperature=1.0, seed=20, max_tokens=12, n=n),
        grammar=g,
    )
    (ref,) = Engine(runner, grammar=compiler, enable_prefix_caching=False).generate([sub]).values()
    eng = Engine(
        runner,
        grammar=compiler,
        enable_prefix_caching=False,
        num_kv_blocks=6,
        long_prefill_token_threshold=8,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    (got,) = eng.generate([sub]).values()
    assert eng.scheduler.num_preemptions > 0
    assert len({tuple(collect_tokens(ref, i)) for i in range(n)}) > 1
    for i in range(n):
        assert collect_tokens(got, i) == collect_tokens(ref, i), i
        assert final_output(got, i).finish_reason == final_output(ref, i).finish_reason
        replay(compiler, g, collect_tokens(got, i))
    assert_clean(eng)


# ----------------------------------------------------------------------------- failing grammars


BAD = {
    "lark-unknown-rule": gram("lark", "start: foo"),
    "ref-cycle": gram("json_schema", CYCLE),  # compiles; its first mask fails
    "regex-syntax": gram("regex", "(unclosed"),
}


def test_failing_grammars_end_only_their_request(runner, compiler, color_prompt):
    """Each bad grammar ends its own request (n=2) with grammar_error; the unconstrained and the valid
    constrained requests of the same generate call complete normally; nothing is left behind."""
    eng = Engine(runner, grammar=compiler)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    bad = [
        Submit(
            request_id=name, prompt_ids=color_prompt, sampling=SamplingParams(n=2, max_tokens=6), grammar=g
        )
        for name, g in BAD.items()
    ]
    ok = [
        Submit(request_id="ok", prompt_ids=color_prompt, sampling=greedy),
        Submit(request_id="ok2", prompt_ids=color_prompt, sampling=greedy, grammar=gram("lark", COLORS)),
    ]
    res = eng.generate([ok[0], *bad, ok[1]])
    for name in BAD:
        (err,) = res[name]
        assert isinstance(err, RequestError), (name, res[name])
        assert err.code == "grammar_error" and err.param == "grammar" and err.request_id == name
        assert err.message.startswith("grammar:")
    fin = final_output(res["ok"])
    assert fin.finish_reason == "length" and len(collect_tokens(res["ok"])) == 6
    assert final_output(res["ok2"]).finish_reason == "stop"
    assert all(isinstance(o, RequestOutput) for o in res["ok"] + res["ok2"])
    assert_clean(eng)


def test_check_grammar(compiler):
    tok = compiler.tokenizer()
    G.check_grammar(gram("json_schema", PERSON), tok)
    G.check_grammar(gram("lark", COLORS), tok)
    G.check_grammar(gram("regex", "(yes|no)"))
    for bad in (gram("lark", "start: foo"), gram("json_schema", CYCLE), gram("json_schema", "[1, 2]")):
        with pytest.raises(G.GrammarError):
            G.check_grammar(bad, tok)
    with pytest.raises(G.GrammarError, match="larger than"):
        G.to_llguidance(gram("regex", "a" * (G.MAX_GRAMMAR_BYTES + 1)))


# ----------------------------------------------------------------------------- aborts


def test_abort_running_constrained_request(runner, compiler, person_prompt):
    eng = Engine(runner, grammar=compiler)
    sub = Submit(
        request_id="a",
        prompt_ids=person_prompt,
        sampling=SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=40),
        grammar=gram("json_schema", PERSON),
    )
    assert eng.add_request(sub) is None
    req = eng.requests["a"]
    got = []
    for _ in range(200):
        got += [m for _, m in eng.step()]
        if sum(len(m.new_token_ids) for m in got) >= 4:
            break
    assert sum(len(m.new_token_ids) for m in got) >= 4
    assert all(m.finish_reason is None for m in got)
    assert all(s.matcher is not None for s in req.states)
    outs = eng.abort_request("a")
    assert sorted(o.index for o in outs) == [0, 1]
    assert all(o.finish_reason == "abort" for o in outs)
    assert all(s.matcher is None for s in req.states)
    assert eng.step() == []
    assert_clean(eng)


def test_abort_while_compiling(runner, compiler, color_prompt):
    eng = Engine(runner, grammar=compiler)
    # a grammar not yet in the cache, so its compile is pending right after add_request
    g = gram("lark", 'start: "alpha" | "beta" | "gamma" | "delta" | "epsilon"')
    sub = Submit(
        request_id="c", prompt_ids=color_prompt, sampling=SamplingParams(n=2, max_tokens=5), grammar=g
    )
    assert eng.add_request(sub) is None
    assert "c" in eng.compiling and eng.has_work()
    req = eng.requests["c"]
    outs = eng.abort_request("c")
    assert sorted(o.index for o in outs) == [0, 1] and all(o.finish_reason == "abort" for o in outs)
    assert all(s.matcher is None for s in req.states)
    assert_clean(eng)
    # a later request runs normally; nothing arrives for the aborted one
    res = eng.generate(
        [Submit(request_id="d", prompt_ids=color_prompt, sampling=SamplingParams(max_tokens=3), grammar=g)]
    )
    assert set(res) == {"d"} and final_output(res["d"]).finish_reason in ("stop", "length")
    assert all(s.matcher is None for s in req.states)
    assert_clean(eng)


# ----------------------------------------------------------------------------- logprobs


LP = SamplingParams(temperature=0.0, max_tokens=16, logprobs=True, top_logprobs=5)


def lps_of(outs) -> list:
    return [lp for o in outs for lp in (o.logprobs or [])]


def test_logprobs_are_those_of_the_masked_distribution(runner, compiler, person_prompt, color_prompt):
    """Greedy constrained (JSON Schema, Lark): the chosen token is the best allowed one; every finite top
    alternative is a token the grammar allowed at that step; the reported mass sums to <= 1; renormalised
    over fewer tokens the chosen token's logprob is >= the unconstrained one (same batch) where the
    prefixes agree."""
    eng = Engine(runner, grammar=compiler)
    cases = {
        "json": (person_prompt, gram("json_schema", PERSON)),
        "lark": (color_prompt, gram("lark", COLORS)),
    }
    free_sp = SamplingParams(temperature=0.0, max_tokens=3, logprobs=True, top_logprobs=5)
    subs = [Submit(request_id=k, prompt_ids=p, sampling=LP, grammar=g) for k, (p, g) in cases.items()]
    subs += [Submit(request_id=f"free-{k}", prompt_ids=p, sampling=free_sp) for k, (p, _) in cases.items()]
    res = eng.generate(subs)
    assert_clean(eng)
    for k, (_, g) in cases.items():
        toks, lps = collect_tokens(res[k]), lps_of(res[k])
        free_toks, free_lps = collect_tokens(res[f"free-{k}"]), lps_of(res[f"free-{k}"])
        assert len(lps) == len(toks) and lps
        m = compiler.compile(g)
        for pos, lp in enumerate(lps):
            assert lp.token_id == toks[pos]
            assert lp.logprob <= 1e-6
            assert lp.top and lp.top[0][0] == lp.token_id
            assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-6)
            finite = [(t, v) for t, v in lp.top if math.isfinite(v)]
            for t, _ in finite:
                assert m.validate_tokens([t]) == 1, (k, pos, t)
            assert sum(math.exp(v) for _, v in finite) <= 1 + 1e-5
            if pos < len(free_lps) and toks[:pos] == free_toks[:pos]:
                free_lp = dict(free_lps[pos].top).get(lp.token_id)
                if free_lp is not None:
                    assert lp.logprob >= free_lp - 1e-5, (k, pos)
            assert m.consume_token(toks[pos])
        assert G.finished(m) or len(toks) == LP.max_tokens


def test_top_logprobs_never_report_forbidden_tokens(runner, compiler, tk, color_prompt):
    """regex ``blue`` allows fewer than 5 tokens at every step ("b", "bl", "blu", "blue", ...): with
    top_logprobs=5 the alternatives should be allowed tokens only (all finite), not forbidden ones
    padded in with logprob -inf (the gateway renders those as ``"logprob": null``)."""
    g = gram("regex", "blue")
    eng = Engine(runner, grammar=compiler)
    outs = eng.generate([Submit(request_id="b", prompt_ids=color_prompt, sampling=LP, grammar=g)])["b"]
    toks, lps = collect_tokens(outs), lps_of(outs)
    assert tk.decode(toks) == "blue"
    m = compiler.compile(g)
    for pos, lp in enumerate(lps):
        for t, v in lp.top:
            assert math.isfinite(v), (pos, lp.top)
            assert m.validate_tokens([t]) == 1, (pos, t)
        assert m.consume_token(toks[pos])


# ----------------------------------------------------------------------------- features, protocol


def test_features_and_protocol_round_trip(runner, monkeypatch, color_prompt):
    eng = Engine(runner)  # default compiler, built from the model file on first use
    assert FEATURE_GRAMMAR == "grammar" and FEATURE_GRAMMAR in eng.features

    g = gram("json_schema", PERSON)
    assert len(g.key) == 64 and g.key == grammar_key("json_schema", g.source)
    assert grammar_key("regex", "a") != grammar_key("lark", "a")
    sub = Submit(request_id="r", prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4), grammar=g)
    (back,) = to_backend_decoder().feed(encode_frame(sub))
    assert isinstance(back, Submit) and back == sub and back.grammar == g

    # an old-style peer (no grammar / features fields at all) still decodes
    (old,) = to_backend_decoder().feed(without(Submit(request_id="o", prompt_ids=[5]), "grammar"))
    assert isinstance(old, Submit) and old.grammar is None and old.prompt_ids == [5]
    (hello,) = to_backend_decoder().feed(without(Hello(), "features"))
    assert isinstance(hello, Hello) and hello.features == []
    (hello2,) = to_backend_decoder().feed(encode_frame(Hello(features=[FEATURE_GRAMMAR])))
    assert hello2.features == [FEATURE_GRAMMAR]
    ready = Ready(
        version=PROTOCOL_VERSION,
        model_card=runner.card,
        kv_blocks_total=eng.block_manager.num_blocks,
        block_size=eng.block_manager.block_size,
        max_num_seqs=eng.max_num_seqs,
        max_num_batched_tokens=eng.max_num_batched_tokens,
        features=eng.features,
    )
    (rb,) = from_backend_decoder().feed(encode_frame(ready))
    assert rb.features == [FEATURE_GRAMMAR]
    (rb_old,) = from_backend_decoder().feed(without(ready, "features"))
    assert isinstance(rb_old, Ready) and rb_old.features == []

    # the default compiler works end to end
    res = eng.generate(
        [
            Submit(
                request_id="x",
                prompt_ids=color_prompt,
                sampling=SamplingParams(max_tokens=8),
                grammar=gram("lark", COLORS),
            )
        ]
    )
    assert final_output(res["x"]).finish_reason == "stop" and eng.grammar is not None

    # without llguidance: no flag, and a grammar request is refused (unconstrained ones still accepted)
    monkeypatch.setattr(G, "llg", None)
    assert eng.features == [] and not G.available()
    err = eng.add_request(Submit(request_id="y", prompt_ids=[1, 2], grammar=g))
    assert isinstance(err, RequestError) and err.code == "unsupported_feature" and err.param == "grammar"
    assert eng.requests == {}


# ----------------------------------------------------------------------------- compiler, masks


def test_compiler_cache_and_independent_matchers(runner, tk):
    c = G.GrammarCompiler(lambda: tk.tokenizer.to_str(), runner.vocab_size, list(runner.card.eos_token_ids))
    try:
        g = gram("lark", COLORS)
        a = c.submit(g).result(timeout=30)
        assert c.compiled == 1
        b = c.compile(g)
        assert c.compiled == 1  # cache hit
        c.compile(Grammar(kind=g.kind, source=g.source, key=g.key))  # equal grammar, same key
        assert c.compiled == 1
        c.compile(gram("regex", "(yes|no)"))
        assert c.compiled == 2
        tok = c.tokenizer()
        red = tok.tokenize_str("red")
        before = bytes(b.compute_bitmask())
        for t in red:
            assert a.consume_token(t)
        assert G.finished(a) or a.is_accepting()
        assert bytes(b.compute_bitmask()) == before  # b did not move
        for t in red:
            G.advance(b, t)
        with pytest.raises(G.GrammarError):
            G.advance(c.compile(g), tok.tokenize_str("purple")[0])
        with pytest.raises(G.GrammarError):
            c.compile(gram("lark", "start: foo"))
        assert c.compiled == 2
    finally:
        c.close()


def test_mask_job_matches_matcher_bitmask(compiler):
    V = compiler.vocab_size
    job = G.MaskJob(V)
    try:
        a = compiler.compile(gram("lark", COLORS))
        b = compiler.compile(gram("json_schema", PERSON))
        assert job.result(job.start([], [])) is None
        rows, allowed, some, _ = job.result(job.start([3, 1], [a, b]))
        assert some == [True, True]
        assert rows == [3, 1] and tuple(allowed.shape) == (2, V)
        for j, m in enumerate((a, b)):
            want = llg_bits(m.compute_bitmask(), V)
            assert allowed[j].nonzero().flatten().tolist() == want
            assert 0 < len(want) < V
    finally:
        job.close()


def without(msg: msgspec.Struct, field: str) -> bytes:
    """The frame of ``msg`` as a peer that predates ``field`` sends it (the key absent)."""
    raw = msgspec.msgpack.decode(encode_frame(msg)[4:])
    assert field in raw
    del raw[field]
    body = msgspec.msgpack.encode(raw)
    return struct.pack(">I", len(body)) + body


def llg_bits(mask: bytes, V: int) -> list[int]:
    out = []
    for i, byte in enumerate(mask):
        for bit in range(8):
            if byte >> bit & 1 and i * 8 + bit < V:
                out.append(i * 8 + bit)
    return out


def test_apply_masks_kernel_equals_torch_path():
    """The C++ kernel (straight from the bitmask, all-allowed words skipped) and the torch fallback mask the
    same logits: random words, an all-allowed word, an all-forbidden word and a vocabulary that ends
    inside a word."""
    import numpy as np
    import torch

    from backend import cpu_kernels

    rng = np.random.default_rng(0)
    V = 1000  # 31.25 words: the last word is cut
    bm = rng.integers(-(2**31), 2**31 - 1, size=(3, 32), dtype=np.int32)
    bm[0, 4], bm[1, 9] = -1, 0
    bits = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little")[:, :V]
    allowed = torch.from_numpy(bits.view(np.bool_))
    logits = torch.randn(5, V)
    a, b = logits.clone(), logits.clone()
    G.apply_masks(a, G.Masks([4, 0, 2], allowed, [True] * 3, bm))
    G.apply_masks(b, G.Masks([4, 0, 2], allowed, [True] * 3, None))
    assert torch.equal(a, b)
    assert torch.equal(a[1], logits[1]) and torch.equal(a[3], logits[3])  # unconstrained rows untouched
    assert int(torch.isinf(a[4]).sum()) == int((~allowed[0]).sum())
    assert cpu_kernels.load() is None or cpu_kernels.enabled()  # the kernel path ran when it is built


def test_abort_choice_while_compiling(runner, compiler, color_prompt):
    """Aborting the only choice (index 0) of a request whose grammar is still compiling ends the request:
    it must leave ``compiling`` too, so the finished compile never queues a sequence for it."""
    eng = Engine(runner, grammar=compiler)
    g = gram("lark", 'start: "one" | "two" | "three" | "four" | "five" | "six"')
    sub = Submit(request_id="k", prompt_ids=color_prompt, sampling=SamplingParams(max_tokens=5), grammar=g)
    assert eng.add_request(sub) is None
    assert "k" in eng.compiling
    outs = eng.abort_choice("k", 0)
    assert [o.finish_reason for o in outs] == ["abort"]
    assert "k" not in eng.compiling and "k" not in eng.requests
    res = eng.generate([])  # let the compile finish: nothing may run for "k"
    assert res == {} and not eng.scheduler.waiting and not eng.scheduler.running
    assert_clean(eng)
