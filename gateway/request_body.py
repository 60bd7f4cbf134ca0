"""Request bodies: read with a size limit, decoded as JSON with client errors for bad input.

``read_body`` counts bytes while it reads, so a body over the limit is refused (413) whether its size was
announced by Content-Length or it was sent chunked, and it is never held whole in memory: at most ``limit``
bytes and one chunk (hypercorn's reads are 64 KiB). The refusal is raised at once; the rest of the body is
drained by ``gateway.middleware.body.BodyGuard`` before the 413 ends, so that a client still writing reads the
answer. That middleware also bounds the time the body takes to arrive (408 ``request_timeout``, raised from
the read here). ``decode_json`` turns what msgspec cannot parse (invalid JSON, invalid UTF-8, nesting deeper
than the decoder's recursion limit) into a 400 ``invalid_json`` instead of a 500.

Nesting is bounded for every body the generation routes decode (``check_depth``: ``MAX_DEPTH`` arrays and
objects inside one another, anywhere in the body): the template, the prompt hooks, the tool and grammar
code walk request values recursively, and a value nested hundreds deep would end in a ``RecursionError``
(a 500) or a native stack overflow there; it is a 400 ``invalid_json`` at the door instead.
"""

from __future__ import annotations

import msgspec
import numpy as np
from starlette.requests import Request

from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.middleware.body import DRAIN_BYTES

_decoder = msgspec.json.Decoder()

#: Arrays and objects nested inside one another that a request body may hold (the top-level object is 1).
#: A JSON Schema of 60 levels of ``properties`` fits; real requests nest under 20.
MAX_DEPTH = 128


def nesting_depth(body: bytes) -> int:
    """Deepest nesting of arrays and objects in ``body``, valid JSON (RFC 8259), brackets inside strings not
    counted; 0 for a scalar. Vectorized (numpy, no Python loop over the body): a 4 MiB body takes tens of
    milliseconds, and a body with at most ``MAX_DEPTH`` opening brackets none (the count is the bound)."""
    if body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return MAX_DEPTH  # at most this deep: nothing to measure
    # escapes out first (left to right, as JSON parses them): every quote left delimits a string
    a = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    inside = (np.cumsum(a == 34, dtype=np.int64) & 1).astype(bool)  # after an opening quote, to its close
    step = np.zeros(a.shape, dtype=np.int32)
    step[(a == 91) | (a == 123)] = 1
    step[(a == 93) | (a == 125)] = -1
    step[inside] = 0
    return int(np.cumsum(step).max(initial=0))


def check_depth(body: bytes) -> None:
    """Raise ``InvalidRequest`` (400 ``invalid_json``) for a body nested more than ``MAX_DEPTH`` deep."""
    depth = nesting_depth(body)
    if depth > MAX_DEPTH:
        raise InvalidRequest(
            f"We could not parse the JSON body of your request: nested {depth} levels deep, more than the "
            f"{MAX_DEPTH} accepted.",
            code="invalid_json",
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The request body (bytes), counted while read.

    Raises:
        PayloadTooLarge: 413 ``request_too_large`` beyond ``limit`` bytes, announced by Content-Length (before
            any byte is read; with ``connection: close`` when the rest is more than the guard drains) or
            counted while a chunked body is read.
        RequestTimeout: 408 ``request_timeout`` when the body does not arrive within ``http.body_timeout``.
    """
    cl = request.headers.get("content-length")
    if cl is not None and cl.strip().isdigit() and int(cl) > limit:
        raise PayloadTooLarge(
            f"Request body of {int(cl)} bytes exceeds the limit of {limit} bytes.",
            code="request_too_large",
            headers={"connection": "close"} if int(cl) > DRAIN_BYTES else None,
        )
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(
                f"Request body exceeds the limit of {limit} bytes.", code="request_too_large"
            )
        if chunk:
            parts.append(chunk)
    return b"".join(parts)


def decode_json(body: bytes) -> object:
    """The JSON value of ``body`` (RFC 8259; objects as ``dict``, arrays as ``list``).

    Raises:
        InvalidRequest: 400 ``invalid_json`` for an empty body, invalid JSON or UTF-8, or nesting deeper than
            ``MAX_DEPTH``.
    """
    if not body.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        value = _decoder.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InvalidRequest(
            f"We could not parse the JSON body of your request: {why}", code="invalid_json"
        ) from None
    check_depth(body)
    return value
