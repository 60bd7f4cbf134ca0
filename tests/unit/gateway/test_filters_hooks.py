"""Filters: config validation, blocklist, PII (Luhn), output window/cut, webhook (real local HTTP server)."""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import trio
from plugins.filter_stream import feed_in_chunks

from gateway.errors import ContentFiltered, InvalidRequest
from gateway.filters import (
    Hook,
    OutputChunk,
    OutputCut,
    OutputScanner,
    PromptBlocked,
    build_pipeline,
    find_pii,
    luhn_ok,
    parse_config,
    pipeline_for,
    register_hook_type,
)
from gateway.filters.blocklist import MAX_PROGRAM_SIZE
from gateway.filters.matching import INLINE_CHARS, run_matching

# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "bad",
    [
        [],
        "not json",
        {"hooks": {}},
        {"hooks": [{"type": "nope"}]},
        {"hooks": [{"type": "blocklist"}]},
        {"hooks": [{"type": "blocklist", "keywords": ["a"], "extra": 1}]},
        {"hooks": [{"type": "blocklist", "patterns": ["("]}]},
        {"hooks": [{"type": "blocklist", "keywords": ["a"], "stages": ["middle"]}]},
        {"hooks": [{"type": "blocklist", "keywords": ["a"], "name": "x"}, {"type": "pii", "name": "x"}]},
        {"hooks": [{"type": "pii", "kinds": ["ssn"]}]},
        {"hooks": [{"type": "pii", "action": "shout"}]},
        {"hooks": [{"type": "pii", "replacement": "{oops}"}]},
        {"hooks": [{"type": "webhook"}]},
        {"hooks": [{"type": "webhook", "url": "ftp://x/y"}]},
        {"hooks": [{"type": "webhook", "url": "http://x/y", "timeout_s": 0}]},
        {"hooks": [{"type": "webhook", "url": "http://x/y", "fail": "maybe"}]},
        {"output_window": -1},
        {"output_window": 10**6},
        {"output_window": True},
        {"unknown": 1},
    ],
)
def test_parse_config_rejects(bad):
    with pytest.raises(ValueError):
        parse_config(bad)


def test_parse_config_roundtrip_and_defaults():
    assert not parse_config(None).enabled and not parse_config({}).enabled
    c = parse_config(
        {
            "hooks": [
                {"type": "pii"},
                {"type": "pii", "action": "block"},
                {"type": "blocklist", "keywords": ["x"]},
            ]
        }
    )
    assert c.output_window == 64
    assert [h.name for h in c.hooks] == ["pii", "pii-2", "blocklist"]
    assert parse_config(c.to_json()) == c
    assert parse_config(json.dumps(c.to_json())) == c
    assert pipeline_for(c.to_json()) is pipeline_for(json.loads(json.dumps(c.to_json())))  # cached


# ------------------------------------------------------------------ prompt side


async def test_blocklist_prompt_blocks_with_azure_shape():
    p = pipeline_for(
        {
            "hooks": [
                {
                    "type": "blocklist",
                    "name": "words",
                    "keywords": ["secret plan"],
                    "patterns": [r"b[o0]mb"],
                    "category": "violence",
                }
            ]
        }
    )
    msgs = [{"role": "user", "content": "what is the Secret  plan"}]
    assert await p.check_prompt("t1", msgs) is msgs  # whitespace differs: keyword is literal
    for content in ("the SECRET PLAN!", [{"type": "text", "text": "ok"}, {"type": "text", "text": "a b0mb"}]):
        with pytest.raises(ContentFiltered) as ei:
            await p.check_prompt(
                "t1", [{"role": "system", "content": "hi"}, {"role": "user", "content": content}]
            )
        e = ei.value
        assert e.status == 400
        body = e.body()["error"]
        assert (
            body["code"] == "content_filter"
            and body["param"] == "messages"
            and body["type"] == "invalid_request_error"
        )
        assert body["innererror"]["content_filter_result"] == {
            "violence": {"filtered": True, "detected": True, "hook": "words"}
        }
        assert "b0mb" not in body["message"] and "SECRET" not in body["message"]
    # whole words only
    assert await p.check_prompt("t1", [{"role": "user", "content": "secret planet"}])


async def test_blocklist_roles():
    p = pipeline_for({"hooks": [{"type": "blocklist", "keywords": ["zap"], "roles": ["user"]}]})
    await p.check_prompt(None, [{"role": "system", "content": "zap"}])
    with pytest.raises(ContentFiltered):
        await p.check_prompt(None, [{"role": "user", "content": "zap"}])


def test_luhn():
    assert luhn_ok("4111111111111111") and luhn_ok("79927398713") and luhn_ok("378282246310005")
    assert (
        not luhn_ok("4111111111111112")
        and not luhn_ok("79927398710")
        and not luhn_ok("")
        and not luhn_ok("12a4")
    )


async def test_pii_redaction_prompt():
    p = pipeline_for({"hooks": [{"type": "pii"}]})
    orig = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": "Mail bob.smith+x@mail.example.co.uk, call (555) 123-4567 or +44 20 7946 0958. "
            "Card 4111 1111 1111 1111 and 4111-1111-1111-1111 and 378282246310005; "
            "order 4111 1111 1111 1112 is not a card; date 2024-01-15; version 1.2.3.",
        },
    ]
    snapshot = json.loads(json.dumps(orig))
    out = await p.check_prompt("t", orig)
    assert orig == snapshot  # input not mutated
    assert out[0] is orig[0]
    assert out[1]["content"] == (
        "Mail [EMAIL], call [PHONE] or [PHONE]. Card [CARD] and [CARD] and [CARD]; "
        "order 4111 1111 1111 1112 is not a card; date 2024-01-15; version 1.2.3."
    )
    # list-of-parts content and the block action
    out = await p.check_prompt("t", [{"role": "user", "content": [{"type": "text", "text": "me: a@b.io"}]}])
    assert out[0]["content"][0]["text"] == "me: [EMAIL]"
    pb = pipeline_for({"hooks": [{"type": "pii", "name": "nopii", "kinds": ["card"], "action": "block"}]})
    await pb.check_prompt(
        "t", [{"role": "user", "content": "a@b.io 4111 1111 1111 1112"}]
    )  # Luhn-invalid: allowed
    with pytest.raises(ContentFiltered) as ei:
        await pb.check_prompt("t", [{"role": "user", "content": "pay with 5555555555554444"}])
    assert ei.value.body()["error"]["innererror"]["content_filter_result"] == {
        "pii": {"filtered": True, "detected": True, "hook": "nopii"}
    }


def test_find_pii_kinds():
    text = "x@y.org 555-123-4567 6011111111111117"
    assert [k for _, _, k in find_pii(text, frozenset({"email", "phone", "card"}))] == [
        "email",
        "phone",
        "card",
    ]
    assert [k for _, _, k in find_pii(text, frozenset({"card"}))] == ["card"]


# ------------------------------------------------------------------ output side


@pytest.mark.parametrize("window", [0, 8, 64, 200])
async def test_output_cut_never_leaks_and_window_bounded(window):
    rng = random.Random(window)
    p = build_pipeline(
        parse_config({"output_window": window, "hooks": [{"type": "blocklist", "keywords": ["forbidden"]}]})
    )
    for _ in range(30):
        words = [
            rng.choice(["alpha", "beta", "gamma", "forbid", "den", "x"]) for _ in range(rng.randint(5, 60))
        ]
        cut_expected = rng.random() < 0.6
        if cut_expected:
            words.insert(rng.randint(0, len(words)), "forbidden")
        text = " ".join(words)
        of = p.output_filter("t")
        sizes = [rng.randint(1, 7) for _ in range(5)]
        pieces, max_held = await feed_in_chunks(of, text, sizes)
        sent = "".join(pieces)
        assert max_held <= window
        if "forbidden" in text.split(" "):
            assert of.cut and of.result == {
                "blocklist": {"filtered": True, "detected": True, "hook": "blocklist"}
            }
            pos = text.split(" ").index("forbidden")
            cut_at = len(" ".join(text.split(" ")[:pos])) + (1 if pos else 0)
            assert text.startswith(sent)
            if window >= len("forbidden"):
                assert sent == text[:cut_at]  # exactly the safe prefix: nothing of the match or after it
            else:  # a window shorter than the match: the cut comes when the match completes
                assert len(sent) < cut_at + len("forbidden")
            assert await of.feed("more text") == "" and await of.flush() == ""
        else:
            assert not of.cut and sent == text


async def test_output_no_output_hooks_passes_through():
    p = pipeline_for({"hooks": [{"type": "blocklist", "keywords": ["x"], "stages": ["prompt"]}]})
    of = p.output_filter()
    assert of.window == 0 and await of.feed("x marks") == "x marks" and not of.cut


async def test_output_pii_redacted_within_window():
    p = build_pipeline(parse_config({"output_window": 32, "hooks": [{"type": "pii"}]}))
    text = (
        "Contact jane.doe@example.com today. Card: 4111 1111 1111 1111, fake 4111 1111 1111 1112. "
        "Phone 555-123-4567. End with mail z@q.io"
    )
    for sizes in ([1], [3], [5, 2, 9], [len(text)]):
        of = p.output_filter()
        pieces, max_held = await feed_in_chunks(of, text, sizes)
        assert max_held <= 32
        assert "".join(pieces) == (
            "Contact [EMAIL] today. Card: [CARD], fake 4111 1111 1111 1112. Phone [PHONE]. End with mail [EMAIL]"
        )
        for piece in pieces:
            assert "@" not in piece and "4111 1111 1111 1111" not in piece


async def test_output_cut_rechecks_prefix_with_all_hooks():
    # PII defers an e-mail in the held-back tail; the blocklist cuts right after it: the e-mail
    # released with the safe prefix must still be redacted.
    p = build_pipeline(
        parse_config(
            {"output_window": 64, "hooks": [{"type": "pii"}, {"type": "blocklist", "keywords": ["boom"]}]}
        )
    )
    of = p.output_filter()
    pieces, _ = await feed_in_chunks(of, "write to x@example.org boom and more", [40])
    assert of.cut and "".join(pieces) == "write to [EMAIL] "


class _Shout(Hook):
    """A custom hook: rewrites prompts to upper case, cuts output at '!'."""

    type = "test-shout"

    async def check_prompt(self, tenant_id, messages):
        if tenant_id == "blocked-tenant":
            raise PromptBlocked("tenant")
        return [{**m, "content": m["content"].upper()} for m in messages]

    def output_scanner(self, tenant_id=None):
        class S(OutputScanner):
            async def scan(self, chunk: OutputChunk):
                i = chunk.pending.find("!")
                return OutputCut(i, "excited") if i >= 0 else chunk

        return S()


async def test_custom_hook_registration():
    register_hook_type(_Shout)
    p = pipeline_for({"output_window": 4, "hooks": [{"type": "test-shout", "name": "shout"}]})
    assert await p.check_prompt("t", [{"role": "user", "content": "hi"}]) == [
        {"role": "user", "content": "HI"}
    ]
    with pytest.raises(ContentFiltered):
        await p.check_prompt("blocked-tenant", [{"role": "user", "content": "hi"}])
    of = p.output_filter()
    out = [await of.feed(c) for c in "hello world! more"]
    assert "".join(out) == "hello world" and of.result == {
        "excited": {"filtered": True, "detected": True, "hook": "shout"}
    }


# ------------------------------------------------------------------ RE2 patterns and the matching budget


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        (r"(a)\1", "invalid escape sequence"),  # backreference
        (r"a(?=b)", "invalid perl operator"),  # lookahead
        (r"(?<!x)a", "invalid perl operator"),  # lookbehind
        (r"(?>a)", "invalid perl operator"),  # atomic group
        (r"a++", "bad repetition operator"),  # possessive
        (r"ab\Z", "invalid escape sequence"),  # RE2 spells it \z
        (r"\Qab", r"ends inside \Q...\E"),  # ends inside \Q...\E: would swallow the next patterns
    ],
)
def test_blocklist_pattern_re2_cannot_compile_is_value_error_naming_it(pattern, reason):
    cfg = {"hooks": [{"type": "blocklist", "keywords": ["ok"], "patterns": ["fine", pattern]}]}
    with pytest.raises(ValueError) as ei:
        parse_config(cfg)
    msg = str(ei.value)
    assert msg.startswith("filters: hooks[0]: blocklist: pattern ") and repr(pattern) in msg, msg
    assert "RE2" in msg and reason in msg, msg


def test_blocklist_pattern_size_limits():
    """One pattern over RE2's max_mem, and patterns whose programs add up past MAX_PROGRAM_SIZE."""
    with pytest.raises(ValueError, match=r"pattern '\\\\pL\{1000\}' is not supported by RE2.*too large"):
        parse_config({"hooks": [{"type": "blocklist", "patterns": [r"\pL{1000}"]}]})
    parse_config({"hooks": [{"type": "blocklist", "patterns": [r"\pL{200}"]}]})  # ~240k instructions
    with pytest.raises(ValueError, match=rf"more than {MAX_PROGRAM_SIZE}"):
        parse_config({"hooks": [{"type": "blocklist", "patterns": [r"\pL{200}", r"\pN\pL{200}"]}]})
    # today's limits: 256 entries of 256 characters
    words = ["".join(random.Random(i).choices("abcdefghij", k=256)) for i in range(256)]
    parse_config({"hooks": [{"type": "blocklist", "keywords": words[:128], "patterns": words[128:]}]})
    with pytest.raises(ValueError, match="at most 256"):
        parse_config({"hooks": [{"type": "blocklist", "keywords": words, "patterns": ["x"]}]})
    with pytest.raises(ValueError, match="at most 256 characters"):
        parse_config({"hooks": [{"type": "blocklist", "patterns": ["x" * 257]}]})


async def test_blocklist_exponential_pattern_is_linear():
    """``(a+)+$`` backtracks exponentially in Python ``re`` (2**n steps on n a's: ~1.5 s for 24, ~50 s for
    30, on the event loop); RE2 is linear. The shortest text comes first, so a backtracking engine fails fast."""
    p = pipeline_for({"hooks": [{"type": "blocklist", "patterns": ["(a+)+$"], "stages": ["prompt"]}]})
    for n in (24, 30, 100_000, 1_000_000):
        msgs = [{"role": "user", "content": "a" * n + "!"}]
        t0 = time.monotonic()
        assert await p.check_prompt("t", msgs) is msgs
        assert time.monotonic() - t0 < 0.5, n
    with pytest.raises(ContentFiltered):
        await p.check_prompt("t", [{"role": "user", "content": "!" + "a" * 100_000}])


async def test_blocklist_keywords_whole_words_as_before():
    kw = ["cat", "c++", "secret plan", "#tag", "né"]
    p = pipeline_for({"hooks": [{"type": "blocklist", "keywords": kw}]})
    blocked = ["cat", "a cat.", "(cat)", "x\ncat\n", "use c++ now", "c++", "SECRET PLAN", "#tag!", "Né, bon"]
    allowed = [
        "concat",
        "cats",
        "cat_",
        "_cat",
        "cat9",
        "caté",
        "écat",
        "c++x",
        "a#tagb",
        "Néo",
        "secret planet",
    ]
    for text in blocked:
        with pytest.raises(ContentFiltered):
            await p.check_prompt("t", [{"role": "user", "content": text}])
    for text in allowed:
        assert await p.check_prompt("t", [{"role": "user", "content": text}]), text
    cs = pipeline_for({"hooks": [{"type": "blocklist", "keywords": ["Cat"], "case_sensitive": True}]})
    assert await cs.check_prompt("t", [{"role": "user", "content": "cat CAT"}])
    with pytest.raises(ContentFiltered):
        await cs.check_prompt("t", [{"role": "user", "content": "a Cat"}])


async def test_filters_read_lone_surrogates():
    """The stdlib ``json`` (the Ollama routes) lets lone surrogates through; RE2 reads UTF-8."""
    p = pipeline_for(
        {"hooks": [{"type": "pii"}, {"type": "blocklist", "keywords": ["cat"], "patterns": ["x+y"]}]}
    )
    out = await p.check_prompt("t", [{"role": "user", "content": "\ud800 mail a@b.io \udfff"}])
    assert out[0]["content"] == "\ud800 mail [EMAIL] \udfff"
    with pytest.raises(ContentFiltered):
        await p.check_prompt("t", [{"role": "user", "content": "\ud800cat\udfff"}])  # no word chars
    of = p.output_filter()
    pieces, _ = await feed_in_chunks(of, "\ud83d ok \ude00 then cat", [3])
    assert of.cut and "".join(pieces) == "\ud83d ok \ude00 then "


class _Slow(Hook):
    """A hook whose matching takes ``seconds`` (of ``size`` characters: inline or in a worker thread)."""

    type = "test-slow"

    def __init__(self, name, stages, roles, *, seconds, size) -> None:
        super().__init__(name, stages, roles)
        self.seconds, self.size = seconds, size

    @classmethod
    def validate(cls, params):
        return {"seconds": float(params.pop("seconds")), "size": int(params.pop("size"))}

    async def check_prompt(self, tenant_id, messages):
        await run_matching(lambda _deadline: time.sleep(self.seconds), self.size)
        return None

    def output_scanner(self, tenant_id=None):
        hook = self

        class S(OutputScanner):
            async def scan(self, chunk):
                await run_matching(lambda _deadline: time.sleep(hook.seconds), hook.size)
                return chunk

        return S()


@pytest.mark.parametrize("size", [10, INLINE_CHARS + 1])  # on the loop; in a worker thread
async def test_matching_over_budget_fails_request_with_400(size):
    register_hook_type(_Slow)
    p = build_pipeline(
        parse_config({"hooks": [{"type": "test-slow", "name": "slow", "seconds": 0.3, "size": size}]})
    )
    msgs = [{"role": "user", "content": "hi"}]
    assert await p.check_prompt("t", msgs, budget=2.0) is msgs
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest) as ei:
        await p.check_prompt("t", msgs, budget=0.1)
    elapsed = time.monotonic() - t0
    err = ei.value.body()["error"]
    assert ei.value.status == 400 and err["type"] == "invalid_request_error"
    assert err["code"] == "content_filter_timeout" and err["param"] == "messages"
    assert "'slow'" in err["message"] and "0.1 s" in err["message"]
    if size > INLINE_CHARS:
        assert elapsed < 0.25  # the worker thread is abandoned at the budget, not waited for
    # the output stage: each step has the budget
    of = p.output_filter("t", budget=0.1)
    with pytest.raises(InvalidRequest) as ei:
        await of.feed("some generated text " * 10)
    err = ei.value.body()["error"]
    assert err["code"] == "content_filter_timeout" and err["param"] is None
    of = p.output_filter("t", budget=2.0)
    assert await of.feed("ok " * 30) and not of.cut


async def test_abandoned_match_holds_its_tenants_thread_slot_only():
    """A match that overran its budget keeps running (RE2 cannot be stopped) in its tenant's one thread
    slot: that tenant's next large match waits (and runs out of budget), another tenant's does not."""
    register_hook_type(_Slow)
    big = INLINE_CHARS + 1
    slow = build_pipeline(parse_config({"hooks": [{"type": "test-slow", "seconds": 1.0, "size": big}]}))
    quick = build_pipeline(parse_config({"hooks": [{"type": "test-slow", "seconds": 0.05, "size": big}]}))
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequest):
        await slow.check_prompt("tenant-a", msgs, budget=0.1)  # its thread sleeps on for ~0.9 s
    assert await quick.check_prompt("tenant-b", msgs, budget=0.5) is msgs
    with pytest.raises(InvalidRequest) as ei:
        await quick.check_prompt("tenant-a", msgs, budget=0.3)  # waits for tenant-a's slot
    assert ei.value.code == "content_filter_timeout"
    await trio.sleep(0.8)  # tenant-a's abandoned thread has ended: its slot is free again
    assert await quick.check_prompt("tenant-a", msgs, budget=0.5) is msgs


async def test_abandoned_matches_of_many_tenants_leave_a_thread_for_the_others():
    """As many tenants as there are shared match threads each abandon a slow match: their threads run on,
    but the shared slots went back when they gave up, so another tenant's large match still runs in time."""
    from gateway.filters.matching import MATCH_THREADS

    register_hook_type(_Slow)
    big = INLINE_CHARS + 1
    slow = build_pipeline(parse_config({"hooks": [{"type": "test-slow", "seconds": 1.0, "size": big}]}))
    quick = build_pipeline(parse_config({"hooks": [{"type": "test-slow", "seconds": 0.05, "size": big}]}))
    msgs = [{"role": "user", "content": "hi"}]
    for i in range(MATCH_THREADS):
        with pytest.raises(InvalidRequest):
            await slow.check_prompt(f"attacker-{i}", msgs, budget=0.1)
    assert await quick.check_prompt("victim", msgs, budget=0.5) is msgs
    await trio.sleep(1.0)  # the abandoned threads end


async def test_large_text_matched_off_the_event_loop():
    """A prompt over INLINE_CHARS is matched in a worker thread: a task on the loop keeps running."""
    p = pipeline_for(
        {"hooks": [{"type": "pii"}, {"type": "blocklist", "keywords": ["zz"], "patterns": ["q+r"]}]}
    )
    text = "1 " * 5_000  # every other character starts a (Luhn-failing) card candidate
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await trio.sleep(0.005)
            ticks += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        t0 = time.monotonic()
        out = await p.check_prompt("t", [{"role": "user", "content": text}])
        elapsed = time.monotonic() - t0
        nursery.cancel_scope.cancel()
    assert out[0]["content"] == text
    assert ticks >= elapsed / 0.005 / 4, (ticks, elapsed)  # the loop was not blocked


# ------------------------------------------------------------------ webhook (real HTTP server)


class _Moderation(BaseHTTPRequestHandler):
    calls: list = []

    def log_message(self, *a):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).calls.append((self.path, body, self.headers.get("x-token")))
        if self.path == "/slow":
            time.sleep(3.0)
        if self.path == "/error":
            self.send_response(500)
            self.end_headers()
            return
        flagged = "forbidden" in body["input"].lower()
        if self.path == "/openai":
            resp = {
                "id": "modr-1",
                "results": [{"flagged": flagged, "categories": {"hate": False, "violence": flagged}}],
            }
        else:
            resp = (
                {"flagged": flagged, "categories": {"self-harm": flagged}} if flagged else {"flagged": False}
            )
        data = json.dumps(resp).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def moderation_url():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Moderation)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _hook(url, **kw):
    return pipeline_for(
        {"hooks": [{"type": "webhook", "name": "mod", "url": url, "headers": {"x-token": "s3"}, **kw}]}
    )


async def test_webhook_prompt_allow_and_block(moderation_url):
    _Moderation.calls.clear()
    p = _hook(moderation_url + "/check", stages=["prompt"])
    msgs = [{"role": "user", "content": "hello"}]
    assert await p.check_prompt("t9", msgs) is msgs
    path, body, tok = _Moderation.calls[-1]
    assert path == "/check" and tok == "s3" and body["stage"] == "prompt" and body["tenant_id"] == "t9"
    assert body["messages"] == msgs and "user: hello" in body["input"]
    with pytest.raises(ContentFiltered) as ei:
        await p.check_prompt("t9", [{"role": "user", "content": "something FORBIDDEN"}])
    assert ei.value.body()["error"]["innererror"]["content_filter_result"] == {
        "self-harm": {"filtered": True, "detected": True, "hook": "mod"}
    }
    p2 = _hook(moderation_url + "/openai", stages=["prompt"])
    with pytest.raises(ContentFiltered) as ei:
        await p2.check_prompt("t9", [{"role": "user", "content": "forbidden"}])
    assert "violence" in ei.value.body()["error"]["innererror"]["content_filter_result"]


@pytest.mark.parametrize("path", ["/slow", "/error"])
async def test_webhook_failure_open_and_closed(moderation_url, path):
    msgs = [{"role": "user", "content": "hello"}]
    p_open = _hook(moderation_url + path, timeout_s=0.3, fail="open", stages=["prompt"])
    t0 = trio.current_time()
    assert await p_open.check_prompt("t", msgs) is msgs
    assert trio.current_time() - t0 < 2.5  # the timeout (0.3 s) bounds the wait, not the slow server (3 s)
    p_closed = _hook(moderation_url + path, timeout_s=0.3, fail="closed", stages=["prompt"])
    t0 = trio.current_time()
    with pytest.raises(ContentFiltered) as ei:
        await p_closed.check_prompt("t", msgs)
    assert trio.current_time() - t0 < 2.5
    assert ei.value.body()["error"]["innererror"]["content_filter_result"] == {
        "moderation_unavailable": {"filtered": True, "detected": True, "hook": "mod"}
    }


async def test_webhook_unreachable_fails_per_policy():
    with trio.socket.socket() as s:  # a port nobody listens on
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    msgs = [{"role": "user", "content": "x"}]
    assert (
        await _hook(f"http://127.0.0.1:{port}/m", fail="open", stages=["prompt"]).check_prompt("t", msgs)
        is msgs
    )
    with pytest.raises(ContentFiltered):
        await _hook(f"http://127.0.0.1:{port}/m", fail="closed", stages=["prompt"]).check_prompt("t", msgs)


async def test_webhook_output_windows(moderation_url):
    _Moderation.calls.clear()
    p = pipeline_for(
        {
            "output_window": 16,
            "hooks": [{"type": "webhook", "name": "mod", "url": moderation_url + "/m", "stages": ["output"]}],
        }
    )
    of = p.output_filter("t3")
    text = "The quick brown fox jumps over the lazy dog. " * 4
    pieces, max_held = await feed_in_chunks(of, text, [1])
    assert "".join(pieces) == text and not of.cut and max_held <= 16
    n = len(_Moderation.calls)
    assert 2 <= n <= len(text) // 16 + 2  # called per window, not per character
    assert all(b["stage"] == "output" and b["tenant_id"] == "t3" for _, b, _ in _Moderation.calls)
    # flagged output: cut, nothing from the flagged window is sent
    of = p.output_filter("t3")
    text = "a" * 40 + " forbidden " + "b" * 40
    pieces, _ = await feed_in_chunks(of, text, [1])
    sent = "".join(pieces)
    assert of.cut and "forbidden" not in sent and text.startswith(sent)
    assert of.result == {"self-harm": {"filtered": True, "detected": True, "hook": "mod"}}


def _slow_output_webhook(moderation_url: str, fail: str):
    """A pipeline whose one hook is an output webhook that answers after its 0.2 s timeout."""
    hook = {"type": "webhook", "url": moderation_url + "/slow", "timeout_s": 0.2, "fail": fail}
    return pipeline_for({"output_window": 8, "hooks": [{**hook, "stages": ["output"]}]})


async def test_webhook_output_timeout_fail_closed_cuts(moderation_url):
    of = _slow_output_webhook(moderation_url, "closed").output_filter()
    pieces, _ = await feed_in_chunks(of, "hello world, this is fine", [4])
    assert of.cut and "".join(pieces) == "" and "moderation_unavailable" in of.result
    of = _slow_output_webhook(moderation_url, "open").output_filter()
    pieces, _ = await feed_in_chunks(of, "hello world", [11])
    assert not of.cut and "".join(pieces) == "hello world"
