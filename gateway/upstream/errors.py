"""The errors of an upstream model (kind ``openai``), as the client sees them (``gateway.errors`` tree).

``UpstreamError`` (502 ``upstream_error``): the upstream answered 5xx, broke off, or sent what is not an
OpenAI answer. ``UpstreamUnavailable`` (503 ``upstream_unavailable``): no listed URL could be reached
(connection refused, DNS, connect timeout). ``UpstreamTimeout`` (504 ``upstream_timeout``): no event within
``event_timeout``, or past the request's ``deadline``. ``refused(status, body, headers)`` turns an upstream 4xx into the
same status with its message (429 keeps its ``retry-after``).

Source followed: OpenAI error object (https://platform.openai.com/docs/guides/error-codes); RFC 9110
section 15.6.3 (502 Bad Gateway), 15.6.4 (503), 15.6.5 (504), 10.2.3 (Retry-After).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import APIError, RateLimited, ServiceUnavailable

_MAX_MESSAGE = 500  # characters of an upstream's message passed on


class UpstreamError(APIError):
    """502 ``upstream_error``: the upstream failed (5xx, a read timeout, a broken or malformed stream)."""

    status = 502
    type = "server_error"
    default_code = "upstream_error"


class UpstreamTimeout(UpstreamError):
    """504 ``upstream_timeout``: the upstream sent no event for ``event_timeout`` seconds (comments do not
    count), or its answer outlasted ``deadline`` (``gateway.upstream.config``)."""

    status = 504
    default_code = "upstream_timeout"


class UpstreamUnavailable(ServiceUnavailable):
    """503 ``upstream_unavailable``: no URL of the model answered (refused, unresolvable, connect timeout)."""

    default_code = "upstream_unavailable"


def _text(value: object) -> str | None:
    return value[:_MAX_MESSAGE] if isinstance(value, str) and value else None


def refused(status: int, body: Any, headers: dict[str, str]) -> APIError:
    """The client's error for an upstream 4xx answer ``status`` with JSON ``body`` (any shape).

    The message, type, param and code are the upstream's OpenAI error members when present (the message
    cut to 500 characters). 429 is a ``RateLimited`` with the upstream's ``retry-after`` (and
    ``retry-after-ms``) headers. 401 and 403 are the upstream refusing this gateway's own credentials, not
    the client's: a 502 ``upstream_error`` (the client's key was accepted here).
    """
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, str):  # llama.cpp and Ollama: {"error": "text"}
        err = {"message": err}
    if not isinstance(err, dict):
        err = {"message": body.get("message") if isinstance(body, dict) else None}
    message = _text(err.get("message")) or f"The upstream model server answered {status}."
    code = _text(err.get("code")) if not isinstance(err.get("code"), int) else None
    param = _text(err.get("param"))
    if status in (401, 403):
        return UpstreamError(f"The upstream model server refused the gateway's credentials ({status}).")
    if status == 429:
        keep = {k: v for k, v in headers.items() if k in ("retry-after", "retry-after-ms")}
        return RateLimited(f"Upstream: {message}", code=code or "rate_limit_exceeded", headers=keep)
    return APIError(
        f"Upstream: {message}",
        status=status,
        type=_text(err.get("type")) or "invalid_request_error",
        param=param,
        code=code,
    )
