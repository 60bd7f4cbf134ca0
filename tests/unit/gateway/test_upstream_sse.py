"""``gateway.upstream.sse.chunks``: an upstream's answer read as chunk objects, whatever pieces it comes in.

The line ends of SSE (``\\n``, ``\\r\\n``, ``\\r``) split across pieces read as one; an upstream that streams
without line ends, or a JSON answer without end, fails with ``UpstreamError`` once over the 4 MiB cap,
without holding the rest of the body (the cap bounds what is read).
"""

from __future__ import annotations

import json

import httpx
import pytest

from gateway.upstream.errors import UpstreamError
from gateway.upstream.sse import chunks


def _event(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]})


def _response(
    pieces: list[bytes], content_type: str = "text/event-stream"
) -> tuple[httpx.Response, list[int]]:
    sent = [0]

    async def body():
        for p in pieces:
            sent[0] += len(p)
            yield p

    return httpx.Response(200, headers={"content-type": content_type}, content=body()), sent


async def _texts(resp: httpx.Response) -> list[str]:
    return [c["choices"][0]["delta"]["content"] async for c in chunks(resp)]


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
async def test_events_split_anywhere_read_the_same(end):
    whole = f"{_event('a')}{end}{end}: comment{end}{_event('b')}{end}{end}data: [DONE]{end}{end}".encode()
    for cut in range(1, len(whole)):
        resp, _ = _response([whole[:cut], whole[cut:]])
        assert await _texts(resp) == ["a", "b"], (end, cut)


async def test_a_stream_without_line_ends_fails_at_the_cap_not_the_end():
    pieces = [b"data: "] + [b"a" * 1_000_000] * 64  # 64 MB, no line end
    resp, sent = _response(pieces)
    with pytest.raises(UpstreamError, match="over 4 MiB"):
        await _texts(resp)
    assert sent[0] < 8_000_000


async def test_a_json_answer_over_the_cap_fails_without_reading_the_rest():
    resp, sent = _response([b'{"choices": "'] + [b"a" * 1_000_000] * 64, "application/json")
    with pytest.raises(UpstreamError, match="over 4 MiB"):
        await _texts(resp)
    assert sent[0] < 8_000_000


async def test_a_json_answer_is_one_chunk():
    body = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]
    }
    resp, _ = _response([json.dumps(body).encode()], "application/json")
    assert await _texts(resp) == ["hi"]
