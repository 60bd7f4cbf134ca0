"""Errors of authentication: who may not call, and why.

The gateway renders them as OpenAI error objects (``{"error": {"message", "type", "param", "code"}}``, see
https://platform.openai.com/docs/guides/error-codes): the attributes below are that object's members plus the
HTTP status and the response headers. Messages never hold a key.
"""

from __future__ import annotations


class AuthError(Exception):
    """Base of the errors :mod:`auth` raises.

    Attributes:
        status: HTTP status (401 or 403).
        message: human-readable text, no key in it.
        type: OpenAI error type (``invalid_request_error``).
        code: machine-readable code (``invalid_api_key``, ``tenant_disabled``, ``admin_required``) or None.
        headers: response headers (``www-authenticate: Bearer`` on a tenant-key challenge).
    """

    status = 401
    type = "invalid_request_error"

    def __init__(self, message: str, *, code: str | None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.headers = dict(headers or {})


class Unauthenticated(AuthError):
    """401: no key, a malformed header, a key in the query string, an unknown, revoked or expired key, a
    disabled or deleted tenant, or the admin key missing or wrong."""

    status = 401

    def __init__(
        self, message: str, *, code: str | None = "invalid_api_key", headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message, code=code, headers=headers)


class Forbidden(AuthError):
    """403: a valid tenant key on an admin route."""

    status = 403
