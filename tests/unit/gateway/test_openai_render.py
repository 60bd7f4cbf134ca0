"""The OpenAI renderers turn a run's events into the bytes the API sends (gateway/openai/stream.py, body.py),
fed synthetic events through a real ResponseWriter."""

from __future__ import annotations

import json

from backend.protocol import SamplingParams, TokenLogprob
from gateway.generation.events import ChoiceFinished, Completed, Heartbeat, Started, TextDelta
from gateway.generation.request import GenerationRequest
from gateway.openai.body import ChatBody, CompletionBody
from gateway.openai.stream import ChatStream, CompletionStream
from gateway.streaming import ResponseWriter


class Names:
    def token_str(self, tid: int) -> str:
        return f"t{tid}"

    def token_bytes(self, tid: int) -> list[int]:
        return list(f"t{tid}".encode())


def _req(**kw: object) -> GenerationRequest:
    sampling = SamplingParams(
        n=kw.pop("n", 1), logprobs=kw.pop("logprobs", False), top_logprobs=kw.pop("k", 0)
    )
    return GenerationRequest(
        request_id="chatcmpl-x", api="openai", model="m", prompt_ids=[1, 2], sampling=sampling, **kw
    )


def _writer() -> tuple[ResponseWriter, list[dict]]:
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    return ResponseWriter(send), sent


def _events(data: bytes) -> list[object]:
    out: list[object] = []
    for block in data.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
        elif block:
            out.append(block)
    return out


async def _feed(renderer, *events) -> None:
    for ev in events:
        await renderer.emit(ev)


async def test_chat_stream_role_first_held_text_finish_usage_done():
    w, sent = _writer()
    req = _req(stream=True, include_usage=True)
    await _feed(
        ChatStream(Names(), req, w),
        Started(headers={"x-ratelimit-remaining-requests": "9"}),
        TextDelta(index=0, text="Hel", tokens=1),
        TextDelta(index=0, text="", tokens=1),  # held back (a stop string may start here): nothing sent
        Heartbeat(),
        TextDelta(index=0, text="lo", tokens=1),
        ChoiceFinished(index=0, reason="stop", completion_tokens=3, timings={"eval_count": 3}),
        Completed(prompt_tokens=2, completion_tokens=3, cached_tokens=1, timings={"eval_count": 3}),
    )
    start, *bodies = sent
    assert start["status"] == 200 and (b"x-ratelimit-remaining-requests", b"9") in start["headers"]
    first = _events(bodies[0]["body"])
    assert first[0]["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert first[1]["choices"][0]["delta"] == {"content": "Hel"}  # the role chunk travels with it
    assert bodies[1]["body"] == b": ping\n\n"
    rest = [e for b in bodies[2:] for e in _events(b["body"])]
    assert rest[0]["choices"][0]["delta"] == {"content": "lo"}
    assert rest[1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert rest[1]["timings"] == {"eval_count": 3} and rest[1]["object"] == "chat.completion.chunk"
    assert rest[2]["choices"] == [] and rest[2]["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    assert rest[3] == "[DONE]" and bodies[-1]["more_body"] is False
    assert {e["id"] for e in rest[:3]} == {"chatcmpl-x"}


async def test_chat_stream_waiting_sends_role_at_once_and_filter_results():
    w, sent = _writer()
    req = _req(stream=True, n=2)
    await _feed(
        ChatStream(Names(), req, w),
        Started(waiting=True),
        ChoiceFinished(
            index=1,
            reason="content_filter",
            completion_tokens=1,
            content_filter_results={"hate": {"filtered": True}},
        ),
    )
    role = _events(sent[1]["body"])
    assert [c["index"] for c in role[0]["choices"]] == [0, 1] and len(role) == 1
    cut = _events(sent[2]["body"])[0]["choices"][0]
    assert cut["finish_reason"] == "content_filter" and cut["content_filter_results"] == {
        "hate": {"filtered": True}
    }


async def test_completion_stream_logprobs_offsets():
    w, sent = _writer()
    req = _req(stream=True, logprobs=True, k=1)
    lp = [TokenLogprob(5, -0.5, [(5, -0.5)]), TokenLogprob(6, -1.0, [(6, -1.0)])]
    await _feed(
        CompletionStream(Names(), req, w),
        Started(),
        TextDelta(index=0, text="ab", tokens=2, logprobs=lp),
        TextDelta(index=0, text="c", tokens=1, logprobs=lp[:1]),
    )
    a, b = (_events(m["body"])[0]["choices"][0] for m in sent[1:3])
    assert (
        a["text"] == "ab"
        and a["logprobs"]["text_offset"] == [0, 0]
        and a["logprobs"]["tokens"] == ["t5", "t6"]
    )
    assert b["logprobs"]["text_offset"] == [2] and b["logprobs"]["top_logprobs"] == [{"t5": -0.5}]
    assert _events(sent[1]["body"])[0]["object"] == "text_completion"


async def test_bodies_gather_text_logprobs_and_usage():
    w, sent = _writer()
    req = _req(logprobs=True)
    lp = [TokenLogprob(5, -0.5)]
    await _feed(
        ChatBody(Names(), req, w),
        Started(headers={"x-ratelimit-limit-requests": "10"}),
        TextDelta(index=0, text="Hi", tokens=1, logprobs=lp),
        Heartbeat(),
        TextDelta(index=0, text=" there", tokens=1),
        ChoiceFinished(index=0, reason="length", completion_tokens=2),
        Completed(prompt_tokens=2, completion_tokens=2, timings={"eval_count": 2}),
    )
    assert sent[0]["status"] == 200 and (b"x-ratelimit-limit-requests", b"10") in sent[0]["headers"]
    body = json.loads(sent[1]["body"])
    assert body["object"] == "chat.completion" and body["usage"]["total_tokens"] == 4
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hi there", "refusal": None}
    assert choice["finish_reason"] == "length"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["t5"]

    w, sent = _writer()
    await _feed(
        CompletionBody(Names(), _req(), w),
        Started(),
        TextDelta(index=0, text="ok", tokens=1),
        ChoiceFinished(index=0, reason="stop", completion_tokens=1),
        Completed(prompt_tokens=2, completion_tokens=1),
    )
    body = json.loads(sent[1]["body"])
    assert body["choices"] == [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}]
