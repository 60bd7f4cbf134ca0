"""Errors of admission: a request over a limit, or a limiter that cannot answer.

The gateway renders them as OpenAI error objects (``{"error": {"message", "type", "param", "code"}}``; 429s as
https://platform.openai.com/docs/guides/rate-limits describes): the attributes below are that object's members
plus the HTTP status and the response headers (``retry-after``, ``retry-after-ms``, ``x-ratelimit-*``,
``x-should-retry``).

::

    Exception
     ├── AdmissionError            rendered: HTTP status, OpenAI error object, headers
     │    ├── RateLimitExceeded    429 a limit or the daily quota
     │    └── LimiterUnavailable   503 the shared store did not answer
     └── StoreError                raised by the Redis limiter (never rendered): admission turns it into a
                                   LimiterUnavailable, or admits without limits in fail-open mode
"""

from __future__ import annotations


class AdmissionError(Exception):
    """Base of the errors :mod:`ratelimit` raises.

    Attributes:
        status: HTTP status (429 or 503).
        message: human-readable text.
        type: OpenAI error type (``requests``, ``tokens``, ``insufficient_quota``, ``server_error``).
        param: the request parameter to change (``max_tokens`` for a request larger than a limit) or None.
        code: ``rate_limit_exceeded``, ``insufficient_quota`` or ``rate_limiter_unavailable``.
        headers: response headers.
    """

    status = 429

    def __init__(
        self,
        message: str,
        *,
        type: str,
        code: str,
        headers: dict[str, str],
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers)


class RateLimitExceeded(AdmissionError):
    """429: a limit (rpm, tpm, concurrency) or the daily quota does not let the request in."""

    status = 429


class LimiterUnavailable(AdmissionError):
    """503: the shared rate-limit store (Redis) did not answer in time; nothing stays reserved."""

    status = 503


class StoreError(Exception):
    """The shared rate-limit store (Redis) failed: no connection (refused, reset, DNS, TLS handshake, wrong
    password), no reply within the command timeout, or an error reply. The message names the cause in one line
    (never the password); the original exception is ``__cause__``."""
