"""The inspection record store (tenant isolation, expiry, bounds) and the record built from a run's events
(prompt tokens joined back to the text across split characters, the backend's timeline on the gateway's
clock)."""

from __future__ import annotations

import msgspec
import pytest
import trio

from backend.protocol import SamplingParams, Timeline
from gateway.generation.events import ChoiceFinished, Completed
from gateway.generation.request import GenerationRequest
from gateway.inspector.record import THREAD_TOKENS, InspectObserver, InspectRecord, prompt_view
from gateway.inspector.store import InspectStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_store_is_per_tenant():
    s = InspectStore()
    s.put("t1", "r", b"one")
    assert s.get("t1", "r") == b"one"
    assert s.get("t2", "r") is None  # another tenant never reads it
    s.put("t2", "r", b"two")  # nor overwrites it
    assert (s.get("t1", "r"), s.get("t2", "r")) == (b"one", b"two")


def test_store_reads_by_alias():
    s = InspectStore(per_tenant=2)
    s.put("t", "chatcmpl-1", b"one", alias="req-1")
    assert s.get("t", "req-1") == s.get("t", "chatcmpl-1") == b"one" and s.get("u", "req-1") is None
    s.put("t", "chatcmpl-2", b"two", alias="req-2")
    s.put("t", "chatcmpl-3", b"three", alias="req-3")  # pushes the first out, its alias with it
    assert s.get("t", "req-1") is None and s.get("t", "req-3") == b"three" and len(s) == 2


def test_store_expires_records():
    clock = Clock()
    s = InspectStore(ttl_s=10, clock=clock)
    s.put("t", "a", b"a")
    clock.now += 6
    s.put("t", "b", b"b")
    clock.now += 4.5  # a is 10.5 s old, b 4.5 s
    assert s.get("t", "a") is None and s.get("t", "b") == b"b" and len(s) == 1
    clock.now += 6
    assert s.get("t", "b") is None and len(s) == 0


def test_store_bounds_per_tenant_and_in_all():
    s = InspectStore(per_tenant=3, total=5)
    for i in range(4):
        s.put("t1", f"r{i}", b"x")
    assert s.get("t1", "r0") is None and all(s.get("t1", f"r{i}") for i in (1, 2, 3))
    for i in range(3):
        s.put("t2", f"r{i}", b"y")
    assert len(s) == 5  # the store's oldest (t1's r1) went
    assert s.get("t1", "r1") is None and s.get("t1", "r2") == b"x" and s.get("t2", "r2") == b"y"
    s.put("t2", "r2", b"z")  # the same id again replaces, takes no second slot
    assert len(s) == 5 and s.get("t2", "r2") == b"z"
    with pytest.raises(ValueError):
        InspectStore(per_tenant=0)


class Vocab:
    id_to_bytes = [b"<s>", b"caf", b"\xc3", b"\xa9", b" ok", b"\xff"]
    special_ids = frozenset({0})


def test_prompt_view_joins_to_the_text():
    v = prompt_view(Vocab(), [0, 1, 2, 3, 4, 5], cached_tokens=9)
    assert v.tokens == ["<s>", "caf", "", "\u00e9", " ok", "\ufffd"]  # é completed by its second byte
    assert v.text == "<s>café ok\ufffd" and "".join(v.tokens) == v.text
    assert v.special == [0] and v.cached_tokens == 6  # never more than the prompt


def test_observer_keeps_the_record_of_a_completed_run():
    store = InspectStore()
    req = GenerationRequest(
        request_id="chatcmpl-x", api="openai", model="m", prompt_ids=[0, 1, 4], sampling=SamplingParams()
    )
    tl = Timeline(chunks=[(0.001, 0.002, 3)], first_token=0.002, decode=[0.003], finish=0.003)
    timings = {"gateway_prep_duration": 5_000_000, "ttft_duration": 7_500_000, "queue_duration": 1_000_000}
    events = [
        ChoiceFinished(index=0, reason="length", completion_tokens=2, timings=timings, timeline=tl),
        Completed(prompt_tokens=3, completion_tokens=2, cached_tokens=2, timings=timings),
    ]
    obs = InspectObserver(store, Vocab(), req)

    async def main() -> None:
        for e in events:
            await obs.emit(e)

    trio.run(main)
    assert store.get("other", "chatcmpl-x") is None and len(store) == 1
    rec = msgspec.json.decode(store.get("", "chatcmpl-x"), type=InspectRecord)
    assert rec.prompt.tokens == ["<s>", "caf", " ok"] and rec.prompt.cached_tokens == 2
    assert rec.usage.prompt_tokens == 3 and rec.usage.prompt_tokens_details.cached_tokens == 2
    t = rec.choices[0].timeline
    assert t is not None and t.backend_start == 5_000_000 and t.queue == 1_000_000
    # backend seconds -> gateway ns, the backend's time 0 at the Submit
    assert t.chunks == [(6_000_000, 7_000_000, 3)] and t.first_token == 7_000_000
    assert t.decode == [8_000_000] and t.finish == 8_000_000
    assert t.first_token <= rec.timings["ttft_duration"]


def test_observer_builds_a_long_prompt_record_off_the_loop():
    store = InspectStore()
    ids = [1, 4] * (THREAD_TOKENS // 2 + 1)
    req = GenerationRequest(
        request_id="cmpl-long", api="openai", model="m", prompt_ids=ids, sampling=SamplingParams()
    )
    obs = InspectObserver(store, Vocab(), req, alias="req-long")
    trio.run(obs.emit, Completed(prompt_tokens=len(ids), completion_tokens=0, cached_tokens=16))
    rec = msgspec.json.decode(store.get("", "req-long"), type=InspectRecord)
    assert rec.prompt.text == "caf ok" * (len(ids) // 2) and rec.prompt.cached_tokens == 16
    assert rec.choices == []  # no choice finished: no timeline
