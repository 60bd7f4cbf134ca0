"""Request bodies: read with a size limit, decoded as JSON with client errors for bad input.

``read_body`` counts bytes while it reads, so a body over the limit is refused (413) whether its size was
announced by Content-Length or it was sent chunked, and it is never held whole in memory. ``decode_json``
turns what msgspec cannot parse (invalid JSON, invalid UTF-8, nesting deeper than the decoder's recursion
limit) into a 400 ``invalid_json`` instead of a 500.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import trio
from starlette.requests import Request

from gateway.errors import InvalidRequest, PayloadTooLarge

DRAIN_BYTES = 64 * 1024 * 1024  # bytes of an oversized body read and dropped before answering 413
DRAIN_SECONDS = 10.0  # the longest an oversized body is drained before the 413 (then: connection close)

_decoder = msgspec.json.Decoder()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body (bytes), counted while read.

    Raises:
        PayloadTooLarge: 413 ``request_too_large`` beyond ``limit`` bytes, announced by Content-Length or
            sent chunked. Up to ``DRAIN_BYTES`` more (for ``DRAIN_SECONDS`` at most) are read and dropped so
            that a client still sending gets to read the answer; past that bound the answer carries
            ``connection: close``.
    """
    cl = request.headers.get("content-length")
    stream = request.stream()
    if cl is not None and cl.strip().isdigit() and int(cl) > limit:
        # drained too, so that a client still writing the announced body reads the 413 (not a write error)
        headers = {"connection": "close"} if int(cl) > limit + DRAIN_BYTES else await _drain(stream, int(cl))
        raise PayloadTooLarge(
            f"Request body of {int(cl)} bytes exceeds the limit of {limit} bytes.",
            code="request_too_large",
            headers=headers,
        )
    parts: list[bytes] = []
    size = 0
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            headers = await _drain(stream, DRAIN_BYTES)
            raise PayloadTooLarge(
                f"Request body exceeds the limit of {limit} bytes.", code="request_too_large", headers=headers
            )
        if chunk:
            parts.append(chunk)
    return b"".join(parts)


async def _drain(stream: AsyncIterator[bytes], budget: int) -> dict[str, str]:
    """Read and drop the rest of a refused body: at most ``budget`` bytes for ``DRAIN_SECONDS``. Returns the
    413's extra headers: none when the body ended, ``connection: close`` when a bound was hit."""
    read = 0
    with trio.move_on_after(DRAIN_SECONDS):
        async for more in stream:
            read += len(more)
            if read > budget:
                return {"connection": "close"}
        return {}
    return {"connection": "close"}


def decode_json(body: bytes) -> object:
    """The JSON value of ``body`` (RFC 8259; objects as ``dict``, arrays as ``list``).

    Raises:
        InvalidRequest: 400 ``invalid_json`` for an empty body, invalid JSON or UTF-8, or nesting too deep.
    """
    if not body.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InvalidRequest(
            f"We could not parse the JSON body of your request: {why}", code="invalid_json"
        ) from None
