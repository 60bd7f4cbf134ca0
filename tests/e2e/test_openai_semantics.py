"""OpenAI response semantics end to end: stream == non-stream (no lost spaces, no split characters), stop
strings, finish_reason, chunk sequences, message shapes, determinism, requests rejected before scheduling,
and the fixture greedy texts. Real gateway + backend (shared ``gateway`` fixture), official ``openai``
client and httpx.

Requests that can run together are sent concurrently (threads) so the engine batches them: the cost of a
test is then about one request's decode steps.
"""

from __future__ import annotations

import concurrent.futures as cf
import json

import pytest
from plugins.gateway_server import chat_body, post_json, reference_prefix, stream_post

from templating import cached_tokenizer

CHAT = "/v1/chat/completions"


def _parallel(*calls):
    with cf.ThreadPoolExecutor(max(1, len(calls))) as ex:
        futs = [ex.submit(c) for c in calls]
        return [f.result() for f in futs]


def _nonstream(gw, body):
    r = post_json(gw, CHAT, body)
    assert r.status_code == 200, r.text
    return r.json()


def _content(d, i=0):
    return d["choices"][i]["message"]["content"]


# ----------------------------------------------------------------------------- stream == non-stream, fixtures


@pytest.mark.timeout(900)  # generous only for overloaded shared machines
def test_stream_equals_nonstream_and_fixture_greedy(gateway, chat_fixtures, model_path):
    """Joined deltas byte-identical to the non-stream content (no lost spaces; greedy, 64 tokens); CJK/emoji
    never produce U+FFFD in a delta. Fixtures: each fixture prompt reproduces greedy_text (max_tokens 64) in
    the exact mode, its reference greedy ids up to the first near tie through the int4 kernel."""
    cats = chat_body(gateway, "Write two sentences about cats.", max_tokens=64, temperature=0)
    uni = chat_body(gateway, "Repeat exactly: Xin chào 你好 🙂👍🏽", max_tokens=32, temperature=0)
    calls = [
        lambda: stream_post(gateway, CHAT, cats),
        lambda: _nonstream(gateway, cats),
        lambda: stream_post(gateway, CHAT, uni),
        lambda: _nonstream(gateway, uni),
    ]
    for fx in chat_fixtures:
        calls.append(
            lambda fx=fx: _nonstream(
                gateway,
                {"model": gateway.model, "messages": fx["messages"], "max_tokens": 64, "temperature": 0},
            )
        )
    s_cats, n_cats, s_uni, n_uni, *fixtures = _parallel(*calls)
    assert s_cats.done and s_cats.content() == _content(n_cats)
    assert len(_content(n_cats)) > 20
    for e in s_uni.events:
        for c in e["choices"]:
            assert "\ufffd" not in (c["delta"].get("content") or "")
    assert s_uni.content() == _content(n_uni)
    assert any(ord(ch) > 0x2E80 for ch in _content(n_uni))  # the model does echo CJK/emoji
    exact = gateway.openai().models.list().data[0].model_extra["weights"] == "dense"
    tok = cached_tokenizer(model_path)
    for fx, d in zip(chat_fixtures, fixtures):
        if exact:
            assert _content(d) == fx["greedy_text"], fx["messages"][-1]["content"][:40]
            assert d["choices"][0]["finish_reason"] == ("stop" if len(fx["greedy_ids"]) < 64 else "length")
        else:  # the int4 kernel follows the reference up to its first near tie
            assert _content(d).startswith(tok.decode(reference_prefix(fx))), fx["messages"][-1]["content"][
                :40
            ]
        assert d["usage"]["prompt_tokens"] == len(fx["prompt_ids"])


# ----------------------------------------------------------------------------- stop strings


def _check_stream_stop(res, expected_content):
    assert res.done
    assert res.content() == expected_content
    assert res.finish_reasons()[-1] == "stop"


@pytest.mark.timeout(900)  # generous only for overloaded shared machines
def test_stop_strings_held_back_and_matched_across_tokens(gateway):
    alpha = "Continue the alphabet after ABC"
    rep = "Repeat exactly: alpha beta gamma delta"
    # Greedy references without stops (same max_tokens as below so that the batch is alike).
    ref_a, ref_r = _parallel(
        lambda: _nonstream(gateway, chat_body(gateway, alpha, max_tokens=24, temperature=0)),
        lambda: _nonstream(gateway, chat_body(gateway, rep, max_tokens=24, temperature=0)),
    )
    text_a, text_r = _content(ref_a), _content(ref_r)
    # A multi-token stop string taken from the middle of the greedy text (the literal "DEFGHIJ" is
    # absent from this model's answer, whose letters are comma-separated: "D, E, F").
    i = text_a.index("D")
    stop_a = text_a[i : i + 7]  # e.g. "D, E, F"
    assert "beta gamma" in text_r
    cases = [
        (alpha, {"stop": ["DEFGHIJ", stop_a]}, text_a[:i]),
        (rep, {"stop": ["beta gamma"]}, text_r[: text_r.index("beta gamma")]),
        (rep, {"stop": "beta gamma"}, text_r[: text_r.index("beta gamma")]),
        (
            rep,
            {"stop": ["beta gamma"], "include_stop_str_in_output": True},
            text_r[: text_r.index("beta gamma") + len("beta gamma")],
        ),
    ]
    calls = []
    for prompt, kw, _ in cases:
        body = chat_body(gateway, prompt, max_tokens=24, temperature=0, **kw)
        calls += [lambda b=body: stream_post(gateway, CHAT, b), lambda b=body: _nonstream(gateway, b)]
    results = _parallel(*calls)
    for k, (_, kw, expected) in enumerate(cases):
        s, n = results[2 * k], results[2 * k + 1]
        assert _content(n) == expected, (kw, _content(n))
        assert n["choices"][0]["finish_reason"] == "stop"
        _check_stream_stop(s, expected)
        # held back: no delta ever carried a piece of the stop string beyond the final content
        acc = ""
        for e in s.events:
            for c in e["choices"]:
                acc += c["delta"].get("content") or ""
                assert expected.startswith(acc)
    assert gateway.wait_idle(timeout=10)["running"] == 0  # the stop match aborted the backend request


# ----------------------------------------------------------------------------- finish_reason


def test_finish_reason_length_and_stop_wins_on_last_token(gateway, chat_fixtures):
    # (a) length, with exactly max_tokens completion tokens; EOS gives "stop" (a fixture chat whose reference
    # answer ends with EOS after 9 tokens, every top-2 gap at least 0.2: the same in the exact and int4 modes)
    france = next(c for c in chat_fixtures if c["name"] == "multiturn")["messages"]
    a, eos, shown = _parallel(
        lambda: _nonstream(
            gateway, chat_body(gateway, "Explain gravity in detail.", max_tokens=3, temperature=0)
        ),
        lambda: _nonstream(gateway, chat_body(gateway, messages=france, max_tokens=32, temperature=0)),
        # past EOS (ignore_eos) with special tokens in the text (vLLM's skip_special_tokens: false)
        lambda: _nonstream(
            gateway,
            chat_body(
                gateway,
                messages=france,
                max_tokens=32,
                temperature=0,
                ignore_eos=True,
                skip_special_tokens=False,
            ),
        ),
    )
    assert a["choices"][0]["finish_reason"] == "length" and a["usage"]["completion_tokens"] == 3
    assert eos["choices"][0]["finish_reason"] == "stop" and eos["usage"]["completion_tokens"] < 32
    assert shown["usage"]["completion_tokens"] == 32
    assert _content(shown).startswith(_content(eos) + "<|im_end|>"), (_content(eos), _content(shown))
    # (b) a stop string that completes on the last allowed token: "stop" wins over "length"
    body = chat_body(gateway, "Explain gravity in detail.", max_tokens=8, temperature=0, logprobs=True)
    ref = _nonstream(gateway, body)
    toks = [bytes(t["bytes"]) for t in ref["choices"][0]["logprobs"]["content"]]
    n = 6
    prefix = b"".join(toks[:n]).decode()
    k = 1
    while prefix[-k:] in prefix[:-1] or len(prefix[-k:].strip()) < 2:
        k += 1
    stop = prefix[-k:]
    assert len(b"".join(toks[: n - 1]).decode(errors="ignore")) < len(prefix) - k + len(
        stop
    )  # completes at token n
    b_stream, b_plain = _parallel(
        lambda: stream_post(
            gateway,
            CHAT,
            chat_body(gateway, "Explain gravity in detail.", max_tokens=n, temperature=0, stop=[stop]),
        ),
        lambda: _nonstream(
            gateway,
            chat_body(gateway, "Explain gravity in detail.", max_tokens=n, temperature=0, stop=[stop]),
        ),
    )
    assert b_plain["choices"][0]["finish_reason"] == "stop", (stop, b_plain)
    assert _content(b_plain) == prefix[:-k]
    assert b_stream.finish_reasons()[-1] == "stop" and b_stream.content() == prefix[:-k]


# ----------------------------------------------------------------------------- chunk sequences


def _check_chunk_sequence(res, n):
    assert res.done
    roles = {i: 0 for i in range(n)}
    finals = {i: 0 for i in range(n)}
    for e in res.events:
        assert e["object"] == "chat.completion.chunk"
        for c in e["choices"]:
            assert "finish_reason" in c and "index" in c and "logprobs" in c
            assert c["index"] in roles
            if c["delta"].get("role"):
                roles[c["index"]] += 1
            if c["finish_reason"] is not None:
                assert c["finish_reason"] in ("stop", "length")
                finals[c["index"]] += 1
            else:
                assert finals[c["index"]] == 0, "chunk after the choice's final chunk"
    assert all(v == 1 for v in roles.values()), roles
    assert all(v == 1 for v in finals.values()), finals


def test_chunk_finish_reason_and_choice_index_n2(gateway):
    body = chat_body(
        gateway,
        "Tell me a short story.",
        n=2,
        temperature=0.8,
        max_tokens=5,
        stream_options={"include_usage": True},
    )
    plain = dict(body)
    plain.pop("stream_options")
    res, d = _parallel(lambda: stream_post(gateway, CHAT, body), lambda: _nonstream(gateway, plain))
    _check_chunk_sequence(res, 2)
    usage = res.events[-1]["usage"]
    assert res.events[-1]["choices"] == []
    assert usage["completion_tokens"] == 10  # 2 choices x 5 tokens (no EOS that early at T=0.8 is likely)
    assert len(d["choices"]) == 2 and [c["index"] for c in d["choices"]] == [0, 1]
    assert (
        d["usage"]["completion_tokens"] == sum(1 for _ in range(2)) * 5
        or d["usage"]["completion_tokens"] <= 10
    )
    # the official client parses the stream
    client = gateway.openai()
    stream = client.chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


# ----------------------------------------------------------------------------- messages


def test_same_role_twice_text_parts_and_assistant_prefill(gateway):
    sys_uu = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Capital of Ontario?"},
        {"role": "user", "content": "And its history?"},
    ]
    aa = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "assistant", "content": "How can I help?"},
        {"role": "user", "content": "Say ok."},
    ]
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "My name is Zed."},
                {"type": "text", "text": "What is my name?"},
            ],
        }
    ]
    joined = [{"role": "user", "content": "My name is Zed.\nWhat is my name?"}]
    fruit = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "The fruit is"}]
    r = _parallel(
        *[
            lambda m=m, kw=kw: post_json(
                gateway, CHAT, chat_body(gateway, messages=m, max_tokens=4, temperature=0, **kw)
            )
            for m, kw in [
                (sys_uu, {}),
                (aa, {}),
                (parts, {}),
                (joined, {}),
                (fruit, {"continue_final_message": True, "add_generation_prompt": False}),
            ]
        ]
    )
    for x in r:
        assert x.status_code == 200, x.text
    # text parts: all parts reach the prompt, joined by "\n" (same prompt and output as the joined string)
    assert r[2].json()["usage"]["prompt_tokens"] == r[3].json()["usage"]["prompt_tokens"]
    assert _content(r[2].json()) == _content(r[3].json())
    bad = post_json(
        gateway,
        CHAT,
        chat_body(
            gateway,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    ],
                }
            ],
        ),
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content[1].type"
    assert bad.json()["error"]["type"] == "invalid_request_error"
    # assistant prefill: the prompt ends with "The fruit is" (no end marker, no new header): same as a raw completion of that text
    from backend.model_path import default_model_path
    from templating import ChatTemplate, cached_tokenizer

    tok = cached_tokenizer(default_model_path())
    prompt = ChatTemplate(tok).render(fruit, add_generation_prompt=False, continue_final_message=True)
    assert prompt.text.endswith("The fruit is")
    raw = post_json(
        gateway,
        "/v1/completions",
        {"model": gateway.model, "prompt": prompt.ids, "max_tokens": 4, "temperature": 0},
    ).json()
    assert raw["choices"][0]["text"] == _content(r[4].json())
    assert r[4].json()["usage"]["prompt_tokens"] == len(prompt.ids)
    both = post_json(
        gateway,
        CHAT,
        chat_body(gateway, messages=fruit, continue_final_message=True, add_generation_prompt=True),
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


# ----------------------------------------------------------------------------- determinism


@pytest.mark.timeout(900)  # generous only for overloaded shared machines
def test_greedy_output_independent_of_batch(gateway):
    body = chat_body(gateway, "List three colors.", max_tokens=16, temperature=0, logprobs=True)

    def ids(d):
        return [tuple(t["bytes"]) for t in d["choices"][0]["logprobs"]["content"]]

    alone = ids(_nonstream(gateway, body))
    others = [
        "Hi.",
        "Write a haiku about the sea and the wind and the sky.",
        "What is 2+2?",
        "Name a city in France.",
        "Explain photosynthesis to a child in a few words, please.",
        "Count to five.",
        "Describe a cat " * 10,
    ]
    for _ in range(3):
        res = _parallel(
            lambda: _nonstream(gateway, body),
            *[
                lambda p=p: _nonstream(gateway, chat_body(gateway, p, max_tokens=16, temperature=0))
                for p in others
            ],
        )
        assert ids(res[0]) == alone


def test_seeds_unseeded_differ_seeded_repeat_choices_differ(gateway):
    base = dict(max_tokens=12, temperature=0.8)
    p = "Write a creative name for a pet."
    res = _parallel(
        *[lambda: _nonstream(gateway, chat_body(gateway, p, **base)) for _ in range(3)],
        lambda: _nonstream(gateway, chat_body(gateway, p, seed=7, n=3, **base)),
        lambda: _nonstream(gateway, chat_body(gateway, p, seed=7, n=3, **base)),
        lambda: _nonstream(gateway, chat_body(gateway, p, seed=-2, **base)),
        lambda: _nonstream(gateway, chat_body(gateway, p, seed=-2, **base)),
    )
    unseeded = [_content(d) for d in res[:3]]
    assert len(set(unseeded)) > 1, unseeded
    s1 = [c["message"]["content"] for c in res[3]["choices"]]
    s2 = [c["message"]["content"] for c in res[4]["choices"]]
    assert s1 == s2
    assert len(set(s1)) > 1, s1  # the n=3 choices differ from each other
    assert _content(res[5]) == _content(
        res[6]
    )  # negative seeds are valid and deterministic (docs/gateway.md)


# ----------------------------------------------------------------------------- rejected before scheduling


def test_bad_logit_bias_rejected_then_next_request_ok(gateway):
    for bias in ({"999999": 5}, {"-1": 1}, {"49152": 1}, {"abc": 1}, {"50": 150}, {"50": -100.5}):
        r = post_json(gateway, CHAT, chat_body(gateway, "hi", logit_bias=bias, max_tokens=2))
        assert r.status_code == 400, (bias, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "logit_bias"
    ok = post_json(gateway, CHAT, chat_body(gateway, "hi", logit_bias={"50": 100, "51": -100}, max_tokens=2))
    assert ok.status_code == 200, ok.text
    assert gateway.stats()["running"] == 0


def test_context_length_exceeded_is_400_before_any_stream(gateway):
    long = "hello " * 9000  # > 8192 tokens
    for stream in (False, True):
        body = chat_body(gateway, long, max_tokens=8)
        if stream:
            res = stream_post(gateway, CHAT, body)
            status, raw, ctype = res.status, res.body, res.headers["content-type"]
        else:
            r = post_json(gateway, CHAT, body)
            status, raw, ctype = r.status_code, r.content, r.headers["content-type"]
        assert status == 400 and ctype.startswith("application/json")
        err = json.loads(raw)["error"]
        assert (
            err["code"] == "context_length_exceeded"
            and err["param"] == "messages"
            and err["type"] == "invalid_request_error"
        )
    # a max_tokens that does not fit: 400 naming max_tokens (never clamped; docs/gateway.md)
    for stream in (False, True):
        body = chat_body(gateway, "hi", max_tokens=100000)
        if stream:
            res = stream_post(gateway, CHAT, body)
            assert res.status == 400
            err = json.loads(res.body)["error"]
        else:
            r = post_json(gateway, CHAT, body)
            assert r.status_code == 400
            err = r.json()["error"]
        assert (err["param"], err["code"]) == ("max_tokens", "invalid_value"), err
