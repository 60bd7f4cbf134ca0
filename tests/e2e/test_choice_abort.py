"""n > 1: a choice that the gateway ends (stop string) is stopped in the backend too (``Abort(index=i)``),
so it stops taking decode slots and KV blocks while the other choices go on."""

from __future__ import annotations

import re

from plugins.gateway_server import chat_body, post_json

MAX = 40


def _early_word_only_in_first(texts: list[str]) -> str | None:
    """A word of choice 0 in its first 40% of text that choice 1 never contains (so only choice 0 stops)."""
    a, b = texts
    for m in re.finditer(r"[A-Za-z]{4,}", a):
        if m.start() > 0.4 * len(a):
            break
        if m.group() not in b:
            return m.group()
    return None


def test_stop_string_in_one_choice_stops_it_in_the_backend(gateway):
    msgs = [{"role": "user", "content": "Tell me a long story about a dragon, a knight and a baker."}]
    word = None
    for seed in range(1, 12):
        body = chat_body(
            gateway, messages=msgs, n=2, temperature=1.0, seed=seed, max_tokens=MAX, ignore_eos=True
        )
        r = post_json(gateway, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        texts = [c["message"]["content"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        word = _early_word_only_in_first(texts)
        if word:
            break
    assert word, "no seed gave a word only in choice 0"
    before = gateway.stats()["generation_tokens"]
    r = post_json(gateway, "/v1/chat/completions", {**body, "stop": [word]})
    assert r.status_code == 200, r.text
    ch = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert ch[0]["finish_reason"] == "stop" and word not in ch[0]["message"]["content"]
    assert ch[1]["finish_reason"] == "length" and ch[1]["message"]["content"] == texts[1]
    generated = gateway.stats()["generation_tokens"] - before
    # choice 1: MAX tokens; choice 0: up to its stop (within the first ~40% of its text) plus the one or two
    # steps its Abort takes to arrive. Without the per-choice abort the backend decoded it to MAX as well.
    assert MAX < generated <= MAX + int(0.6 * MAX), generated
