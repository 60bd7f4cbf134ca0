"""Errors of authentication: who may not call, and why.

The gateway renders them as OpenAI error objects (``{"error": {"message", "type", "param", "code"}}``, see
https://platform.openai.com/docs/guides/error-codes): the attributes below are that object's members plus the
HTTP status and the response headers. Messages never hold a key.

::

    AuthError                 (status, message, type, code, headers)
    ├── Unauthenticated       401: no key, a wrong, revoked or expired key, a disabled tenant, no admin key
    ├── Forbidden             403: a tenant key on an admin route
    └── StoreUnavailable      503 ``store_unavailable`` + ``retry-after``: the tenancy store did not answer
"""

from __future__ import annotations


class AuthError(Exception):
    """Base of the errors :mod:`auth` raises.

    Attributes:
        status: HTTP status (401, 403 or 503).
        message: human-readable text, no key in it.
        type: OpenAI error type (``invalid_request_error``; ``server_error`` for a 503).
        code: machine-readable code (``invalid_api_key``, ``tenant_disabled``, ``admin_required``,
            ``store_unavailable``) or None.
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


class StoreUnavailable(AuthError):
    """503: the tenancy store (PostgreSQL) could not be reached, or did not answer within its timeouts; a key
    this gateway confirmed recently is still served (``auth.authenticator``), everything else gets this.

    Attributes:
        retry_after_s: seconds the client should wait (the ``retry-after`` header).
        detail: the driver's reason, for the operator's log (never sent to a client: it names hosts).
    """

    status = 503
    type = "server_error"

    def __init__(
        self,
        message: str = "The tenancy store is unavailable; retry shortly.",
        *,
        retry_after_s: int = 1,
        detail: str = "",
    ) -> None:
        super().__init__(message, code="store_unavailable", headers={"retry-after": str(retry_after_s)})
        self.retry_after_s = retry_after_s
        self.detail = detail
