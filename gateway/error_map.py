"""The errors of ``auth`` and ``ratelimit`` as the gateway's :class:`~gateway.errors.APIError` tree.

Those libraries know nothing of HTTP rendering; they raise errors that carry OpenAI's members (message, type,
param, code) plus a status and headers, and this is the one place that turns them into the gateway's classes
(so every renderer, JSON, SSE or NDJSON, treats them like any other client error). Bodies, statuses and headers
pass through unchanged.
"""

from __future__ import annotations

from auth.errors import AuthError, Forbidden, StoreUnavailable
from gateway.errors import APIError, AuthenticationError, PermissionDenied, RateLimited, ServiceUnavailable
from ratelimit.errors import AdmissionError, LimiterUnavailable


def api_error(exc: AuthError | AdmissionError) -> APIError:
    """401 :class:`AuthenticationError`, 403 :class:`PermissionDenied`, 429 :class:`RateLimited` or 503
    :class:`ServiceUnavailable` (Redis: ``rate_limiter_unavailable``; the tenancy store: ``store_unavailable``)
    with the same message, type, param, code and headers (``retry-after`` on a 503)."""
    if isinstance(exc, StoreUnavailable):
        return ServiceUnavailable(exc.message, type=exc.type, code=exc.code, headers=exc.headers)
    if isinstance(exc, Forbidden):
        return PermissionDenied(exc.message, code=exc.code, headers=exc.headers)
    if isinstance(exc, AuthError):
        return AuthenticationError(exc.message, code=exc.code, headers=exc.headers)
    if isinstance(exc, LimiterUnavailable):
        return ServiceUnavailable(exc.message, type=exc.type, code=exc.code, headers=exc.headers)
    return RateLimited(exc.message, type=exc.type, param=exc.param, code=exc.code, headers=exc.headers)


def error_status(exc: BaseException) -> int:
    """The HTTP status a request that failed with ``exc`` is billed with: an APIError's, else 500."""
    return exc.status if isinstance(exc, APIError) else 500
