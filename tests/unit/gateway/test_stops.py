"""Stop strings: multi-token stop held back, stop across tokens, include flag, stop on the last token."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import InvalidRequest
from gateway.stops import StopMatcher, normalize_stop
from templating import cached_tokenizer


@pytest.fixture(scope="module")
def tok(model_path):
    return cached_tokenizer(model_path)


def reference(text: str, stops: list[str], include: bool = False) -> tuple[str, bool]:
    """Text up to the stop occurrence that completes first (ties: the one starting first)."""
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), i)
            if best is None or key < best:
                best = key
    if best is None:
        return text, False
    end, start = best
    return (text[:end] if include else text[:start]), True


def run(pieces, stops, include=False):
    m = StopMatcher(stops, include_stop_str_in_output=include)
    out = []
    matched = False
    for p in pieces:
        o, matched = m.feed(p)
        out.append(o)
        if matched:
            break
    if not matched:
        out.append(m.flush())
    return out, matched


def stream_tokens(tok, text, stops, include=False):
    """Token-by-token detokenizer -> stop matcher, as the gateway does it."""
    ids = tok.encode_plain(text)
    d = IncrementalDetokenizer.for_tokenizer(tok)
    m = StopMatcher(stops, include_stop_str_in_output=include)
    emitted = []
    for i in ids:
        out, matched = m.feed(d.feed(i))
        emitted.append(out)
        if matched:
            return emitted, True
    out, matched = m.feed(d.flush())
    emitted.append(out)
    if not matched:
        emitted.append(m.flush())
    return emitted, matched


def test_multi_token_stop_never_leaks(tok):
    text = "ABCDEFGHIJKLMNOP"
    assert len(tok.encode_plain("DEFGHIJ")) > 1  # really a multi-token stop
    emitted, matched = stream_tokens(tok, text, ["DEFGHIJ"])
    assert matched
    assert "".join(emitted) == "ABC"
    for e in emitted:  # no piece of the stop string was ever sent
        assert not set(e) & set("DEFGHIJ")


def test_partial_stop_released_when_it_cannot_match(tok):
    emitted, matched = stream_tokens(tok, "ABCDEFG then more", ["DEFGHIJ"])
    assert not matched
    assert "".join(emitted) == "ABCDEFG then more"
    # "DEFG" was held while it could still become the stop, then released in one go
    m = StopMatcher(["DEFGHIJ"])
    assert m.feed("ABC") == ("ABC", False)
    assert m.feed("DEF") == ("", False) and m.held == "DEF"
    assert m.feed("G") == ("", False)
    assert m.feed("X") == ("DEFGX", False) and m.held == ""


def test_stop_across_tokens(tok):
    text = "alpha beta gamma delta"
    emitted, matched = stream_tokens(tok, text, ["beta gamma"])
    assert matched and "".join(emitted) == "alpha "
    emitted, matched = stream_tokens(tok, text, ["beta gamma"], include=True)
    assert matched and "".join(emitted) == "alpha beta gamma"
    # bare string accepted by the normalizer
    assert normalize_stop("beta gamma") == ["beta gamma"]
    emitted, matched = stream_tokens(tok, text, normalize_stop("beta gamma"))
    assert "".join(emitted) == "alpha "


def test_stop_inside_one_delta_with_text_after():
    m = StopMatcher(["beta gamma"])
    assert m.feed("alpha beta gamma delta") == ("alpha ", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""
    assert m.matched_stop == "beta gamma"


def test_stop_on_last_token_is_reported():
    m = StopMatcher(["END"])
    assert m.feed("xx E") == ("xx ", False)
    assert m.feed("ND") == ("", True)  # matched on this feed: finish_reason "stop" wins over "length"


def test_earliest_completing_stop_wins():
    assert run(["abcd"], ["abcd", "bc"])[0] == ["a"]
    assert run(["a", "b", "c", "d"], ["abcd", "bc"])[0] == ["", "", "a"]  # "a" held: it may start "abcd"
    assert run(["xab"], ["ab", "b"])[0] == ["x"]  # same end: the longer (earlier start) wins


def test_no_stops_passthrough():
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_flush_releases_held():
    m = StopMatcher(["<END>"])
    assert m.feed("done <EN") == ("done ", False)
    assert m.flush() == "<EN"


def test_normalize_stop():
    assert normalize_stop(None) == []
    assert normalize_stop("x") == ["x"]
    assert normalize_stop(["a", "", "b", "a"]) == ["a", "b"]
    assert normalize_stop("") == []
    with pytest.raises(InvalidRequest) as ei:
        normalize_stop(5)
    assert ei.value.param == "stop"
    with pytest.raises(InvalidRequest) as ei:
        normalize_stop(["a", 1])
    assert ei.value.param == "stop[1]"
    with pytest.raises(InvalidRequest):
        normalize_stop([str(i) for i in range(17)])
    assert len(normalize_stop([str(i) for i in range(16)])) == 16
    with pytest.raises(InvalidRequest):
        normalize_stop("x" * 513)
    with pytest.raises(InvalidRequest):
        normalize_stop(["a"] * 5, max_count=4)


def test_held_back_is_bounded():
    m = StopMatcher(["xyz"])
    for _ in range(1000):
        m.feed("ab")
        assert len(m.held) < 3


alphabet = st.sampled_from("abcx ")
stop_lists = st.lists(st.text(alphabet, min_size=1, max_size=5), min_size=1, max_size=4)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet, max_size=40), stop_lists, st.data(), st.booleans())
def test_random_splits_match_reference(text, stops, data, include):
    cuts = sorted(data.draw(st.lists(st.integers(min_value=0, max_value=len(text)), max_size=10)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    out, matched = run(pieces, stops, include)
    assert ("".join(out), matched) == reference(text, stops, include)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30), st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3), st.data())
def test_random_unicode_splits_match_reference(text, stops, data):
    # plant a stop sometimes, so matches are frequent
    if data.draw(st.booleans()):
        k = data.draw(st.integers(min_value=0, max_value=len(text)))
        text = text[:k] + stops[0] + text[k:]
    cuts = sorted(data.draw(st.lists(st.integers(min_value=0, max_value=len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    out, matched = run(pieces, stops)
    assert ("".join(out), matched) == reference(text, stops)


def test_text_stream_pipeline(tok):
    from gateway.stops import TextStream

    ids = tok.encode_plain("alpha beta gamma delta") + [2]
    ts = TextStream(tok, ["beta gamma"])
    out = []
    for i in ids:
        text, matched = ts.feed(i)
        out.append(text)
        if matched:
            break
    assert "".join(out) == "alpha " and ts.matched
    assert ts.feed([5, 6]) == ("", True) and ts.finish() == ""

    ts = TextStream(tok, ["<END>"])
    text, matched = ts.feed(tok.encode_plain("done <EN"))
    assert (text, matched) == ("done ", False)
    assert ts.finish() == "<EN" and ts.finish() == ""

    mixed = "Xin chào 你好 🙂👍🏽"
    ts = TextStream(tok)
    parts = [ts.feed(i)[0] for i in tok.encode_plain(mixed)]
    assert "".join(parts) + ts.finish() == mixed
