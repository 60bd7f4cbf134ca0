"""The Ollama renderers (gateway/ollama/render.py) fed synthetic run events, writing through the real
``ResponseWriter``: the NDJSON stream and the one-object answer, byte shapes, statistics and errors."""

from __future__ import annotations

import json

from gateway.errors import RateLimited, ServiceUnavailable
from gateway.generation.events import ChoiceFinished, Completed, Ended, Heartbeat, Started, TextDelta
from gateway.ollama.render import JsonAnswer, NdjsonStream, final_stats, renderer
from gateway.streaming import ResponseWriter

TIMINGS = {
    "total_duration": 9_000,
    "prompt_eval_duration": 2_000,
    "eval_duration": 3_000,
    "queue_duration": 1_000,
    "draft_tokens": 5,
    "accepted_tokens": 2,
}
DONE = Completed(prompt_tokens=11, completion_tokens=3, cached_tokens=4, timings=TIMINGS)
RUN = [
    Started(headers={"x-ratelimit-remaining-requests": "7"}),
    TextDelta(index=0, text="Hel", tokens=1),
    Heartbeat(),
    TextDelta(index=0, text="", tokens=1),  # a held-back stop prefix: no line
    TextDelta(index=1, text="other choice", tokens=1),  # Ollama answers choice 0 only
    TextDelta(index=0, text="lo ✓", tokens=1),
    ChoiceFinished(index=0, reason="length", completion_tokens=3),
    DONE,
    Ended(status=200, reason="length", submitted=True, prompt_tokens=11, completion_tokens=3),
]


class Capture:
    def __init__(self) -> None:
        self.messages: list[dict] = []

    async def __call__(self, msg: dict) -> None:
        self.messages.append(msg)

    @property
    def start(self) -> dict:
        assert self.messages[0]["type"] == "http.response.start"
        return self.messages[0]

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.start["headers"])

    @property
    def body(self) -> bytes:
        bodies = self.messages[1:]
        assert all(m["more_body"] for m in bodies[:-1]) and not bodies[-1]["more_body"]
        return b"".join(m["body"] for m in bodies)


async def feed(cls, events, kind="chat"):
    cap = Capture()
    w = ResponseWriter(cap)
    r = cls(w, kind=kind, model="smol", t_arrival=0.0)
    for ev in events:
        await r.emit(ev)
    return cap, r


def check_final(obj: dict, *, text_key: str, text: str) -> None:
    assert obj["done"] is True and obj["done_reason"] == "length"
    assert obj["created_at"].endswith("Z") and obj["model"] == "smol"
    want = {"role": "assistant", "content": text} if text_key == "message" else text
    assert obj[text_key] == want
    stats = {k: obj[k] for k in list(obj)[list(obj).index("done_reason") + 1 :]}
    assert stats == {
        "total_duration": 9_000,
        "load_duration": 0,
        "prompt_eval_count": 11,
        "prompt_eval_duration": 2_000,
        "eval_count": 3,
        "eval_duration": 3_000,
        "prompt_eval_cached_count": 4,
        "queue_duration": 1_000,
        "draft_tokens": 5,
        "accepted_tokens": 2,
    }


async def test_chat_stream_is_one_line_per_delta_then_the_final_line():
    cap, _ = await feed(NdjsonStream, RUN)
    assert cap.start["status"] == 200
    h = cap.headers
    assert h[b"content-type"] == b"application/x-ndjson" and h[b"cache-control"] == b"no-cache"
    assert h[b"x-ratelimit-remaining-requests"] == b"7"
    assert cap.body.endswith(b"\n") and b": ping" not in cap.body
    lines = cap.body.decode().splitlines()
    objs = [json.loads(x) for x in lines]
    assert [list(o)[:4] for o in objs[:-1]] == [["model", "created_at", "message", "done"]] * 2
    assert [o["message"]["content"] for o in objs] == ["Hel", "lo ✓", ""]
    assert [o["done"] for o in objs] == [False, False, True]
    assert "✓" in lines[1] and " " not in lines[0].replace('"Hel"', "")  # compact, UTF-8 unescaped
    check_final(objs[-1], text_key="message", text="")


async def test_generate_stream_uses_response():
    cap, _ = await feed(NdjsonStream, RUN, kind="generate")
    objs = [json.loads(x) for x in cap.body.splitlines()]
    assert [o["response"] for o in objs] == ["Hel", "lo ✓", ""] and "message" not in objs[0]
    check_final(objs[-1], text_key="response", text="")


async def test_non_stream_is_one_object_with_the_whole_text():
    for kind, key in (("chat", "message"), ("generate", "response")):
        cap, _ = await feed(JsonAnswer, RUN, kind=kind)
        assert cap.start["status"] == 200 and len(cap.messages) == 2
        h = cap.headers
        assert h[b"content-type"] == b"application/json" and int(h[b"content-length"]) == len(cap.body)
        assert h[b"x-ratelimit-remaining-requests"] == b"7"
        assert cap.body.endswith(b"}\n") and cap.body.count(b"\n") == 1
        check_final(json.loads(cap.body), text_key=key, text="Hello ✓")


async def test_done_reason_defaults_to_stop_and_follows_choice_0():
    cap, _ = await feed(
        JsonAnswer, [Started(), ChoiceFinished(index=1, reason="length", completion_tokens=1), DONE]
    )
    assert json.loads(cap.body)["done_reason"] == "stop"
    cap, _ = await feed(
        NdjsonStream, [Started(), ChoiceFinished(index=0, reason="content_filter", completion_tokens=1), DONE]
    )
    assert json.loads(cap.body.splitlines()[-1])["done_reason"] == "content_filter"


async def test_a_stream_without_started_still_has_its_headers():
    cap, _ = await feed(NdjsonStream, [TextDelta(index=0, text="a"), DONE])
    assert cap.headers[b"content-type"] == b"application/x-ndjson"
    assert [json.loads(x)["done"] for x in cap.body.splitlines()] == [False, True]


async def test_error_before_the_answer_is_the_error_object_with_its_status():
    for cls in (NdjsonStream, JsonAnswer):
        cap, r = await feed(cls, [])
        await r.fail(
            RateLimited("Too many requests", code="rate_limit_exceeded", headers={"retry-after": "2"})
        )
        assert cap.start["status"] == 429 and cap.headers[b"retry-after"] == b"2"
        assert cap.headers[b"content-type"] == b"application/json"
        assert json.loads(cap.body) == {
            "error": "Too many requests",
            "type": "requests",
            "code": "rate_limit_exceeded",
        }


async def test_error_after_started_is_one_final_line():
    cap, r = await feed(NdjsonStream, RUN[:2])
    await r.fail(ServiceUnavailable("backend lost"))
    await r.fail(ServiceUnavailable("twice"))  # the stream is over: ignored
    lines = [json.loads(x) for x in cap.body.splitlines()]
    assert cap.start["status"] == 200 and lines[0]["message"]["content"] == "Hel"
    assert lines[-1] == {"error": "backend lost", "type": "server_error", "code": None} and len(lines) == 2


def test_stats_are_clamped_to_the_total():
    s = final_stats(
        Completed(
            prompt_tokens=1,
            completion_tokens=2,
            timings={"total_duration": 10, "prompt_eval_duration": 8, "eval_duration": 5},
        ),
        0.0,
    )
    assert (s.prompt_eval_duration, s.eval_duration, s.total_duration) == (8, 2, 10)
    s = final_stats(Completed(prompt_tokens=1, completion_tokens=2), t_arrival=0.0)  # no total: measured
    assert s.total_duration > 0 and s.prompt_eval_duration == 0 and s.queue_duration == 0


def test_renderer_picks_by_stream():
    w = ResponseWriter(Capture())
    assert isinstance(renderer(w, stream=True, kind="chat", model="m", t_arrival=0.0), NdjsonStream)
    assert isinstance(renderer(w, stream=False, kind="chat", model="m", t_arrival=0.0), JsonAnswer)
