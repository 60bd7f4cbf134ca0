"""The gateway's exception tree, rendered as OpenAI error objects.

Every error a client sees has OpenAI's shape::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

``code`` of a client error (4xx) is never null: one raised without a code takes its class's ``default_code``
(``invalid_request`` for a 400, ``not_found``, ``method_not_allowed``, ``request_timeout``,
``request_too_large``...; a bare ``APIError`` the one of its status in :data:`STATUS_CODES`), so a client can
always branch on it. A server error (5xx) carries the code it was raised with. The codes are listed in
docs/errors.md.

Source followed: https://platform.openai.com/docs/guides/error-codes and the
``openai`` Python client's ``APIStatusError`` mapping (400 BadRequest, 401
Authentication, 403 PermissionDenied, 404 NotFound, 413, 429 RateLimit, 5xx).
"""

from __future__ import annotations

from typing import Any

#: The code of a client error raised with none, by HTTP status (after RFC 9110 section 15's names).
STATUS_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "rate_limit_exceeded",
}


class APIError(Exception):
    """Base of every error returned to a client.

    Attributes:
        status: HTTP status code.
        message: human-readable text (never contains a key or prompt text).
        type: OpenAI error type, e.g. ``invalid_request_error``.
        param: the offending request parameter, or None.
        code: machine-readable code, e.g. ``context_length_exceeded``; for a 4xx never None (``default_code``,
            else the status's in :data:`STATUS_CODES`, else ``invalid_request``).
        headers: extra response headers (``retry-after``, ``x-ratelimit-*``...).
        extra: extra members merged into the error object (e.g. ``innererror``).
    """

    status = 500
    type = "server_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.code = code or self.default_code or _status_code(self.status)
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        """The JSON body ``{"error": {...}}``."""
        err: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        err.update(self.extra)
        return {"error": err}

    def ollama_body(self) -> dict[str, Any]:
        """The Ollama API's shape ``{"error": message, "type", "code"}`` (Ollama clients read ``error`` as a
        string: ollama/docs/api.md, "Errors")."""
        return {"error": self.message, "type": self.type, "code": self.code}

    def body_for(self, path: str) -> dict[str, Any]:
        """The body for a request to ``path``: Ollama's shape under ``/api/``, else OpenAI's."""
        return self.ollama_body() if path.startswith("/api/") else self.body()


def _status_code(status: int) -> str | None:
    """The code of a client error (``status`` 4xx) raised without one; None for a server error."""
    if 400 <= status < 500:
        return STATUS_CODES.get(status, "invalid_request")
    return None


class InvalidRequest(APIError):
    """400: malformed JSON, wrong types, out-of-range values (``param`` names the field)."""

    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    """400 ``context_length_exceeded``: the prompt itself does not fit the model's context (a ``max_tokens`` too
    large for what the prompt leaves is ``InvalidRequest`` ``invalid_value`` naming ``max_tokens``)."""

    def __init__(self, message: str, *, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class ContentFiltered(InvalidRequest):
    """400 ``content_filter`` (Azure OpenAI semantics): a prompt blocked by a content-filter hook."""

    def __init__(self, message: str, *, result: dict[str, Any], param: str = "messages") -> None:
        super().__init__(
            message,
            param=param,
            code="content_filter",
            extra={"innererror": {"code": "ResponsibleAIPolicyViolation", "content_filter_result": result}},
        )


class AuthenticationError(APIError):
    """401: missing, malformed, wrong, expired or revoked API key."""

    status = 401
    type = "invalid_request_error"

    def __init__(self, message: str = "Incorrect API key provided.", **kw: Any) -> None:
        kw.setdefault("code", "invalid_api_key")
        super().__init__(message, **kw)


class PermissionDenied(APIError):
    """403: a valid key used where it has no right (a tenant key on an admin route)."""

    status = 403
    type = "invalid_request_error"
    default_code = "permission_denied"


class NotFound(APIError):
    """404: unknown model, route or resource."""

    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class MethodNotAllowed(APIError):
    """405 ``method_not_allowed``: a route asked with a method it does not have; ``headers`` carry ``Allow``
    (RFC 9110 section 15.5.6)."""

    status = 405
    type = "invalid_request_error"
    default_code = "method_not_allowed"


class RequestTimeout(APIError):
    """408 ``request_timeout``: the request body did not arrive in time (``http.body_timeout``); the
    connection is closed after the answer (RFC 9110 section 15.5.9)."""

    status = 408
    type = "invalid_request_error"
    default_code = "request_timeout"


class PayloadTooLarge(APIError):
    """413: request body over the configured limit (chunked bodies included)."""

    status = 413
    type = "invalid_request_error"
    default_code = "request_too_large"


class RateLimited(APIError):
    """429 ``rate_limit_exceeded`` (or ``insufficient_quota`` for an exhausted daily quota)."""

    status = 429
    type = "requests"
    default_code = "rate_limit_exceeded"


class ServiceUnavailable(APIError):
    """503: no backend (starting, restarting, or shutting down)."""

    status = 503
    type = "server_error"


class LoopDetected(APIError):
    """508 ``loop_detected``: the request has already passed through this gateway (its ``Via`` header names
    this gateway's instance: ``gateway.middleware.hops``), so an upstream model leads back here (RFC 5842
    section 7.2, 508 Loop Detected)."""

    status = 508
    type = "server_error"
    default_code = "loop_detected"


class InternalError(APIError):
    """500: a fault of ours; the message says nothing private."""

    status = 500
    type = "server_error"
