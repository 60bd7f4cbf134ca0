"""The gateway's exception tree, rendered as OpenAI error objects.

Every error a client sees has OpenAI's shape::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

Source followed: https://platform.openai.com/docs/guides/error-codes and the
``openai`` Python client's ``APIStatusError`` mapping (400 BadRequest, 401
Authentication, 403 PermissionDenied, 404 NotFound, 413, 429 RateLimit, 5xx).
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """Base of every error returned to a client.

    Attributes:
        status: HTTP status code.
        message: human-readable text (never contains a key or prompt text).
        type: OpenAI error type, e.g. ``invalid_request_error``.
        param: the offending request parameter, or None.
        code: machine-readable code, e.g. ``context_length_exceeded``.
        headers: extra response headers (``retry-after``, ``x-ratelimit-*``...).
        extra: extra members merged into the error object (e.g. ``innererror``).
    """

    status = 500
    type = "server_error"

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
        self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
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


class InvalidRequest(APIError):
    """400: malformed JSON, wrong types, out-of-range values (``param`` names the field)."""

    status = 400
    type = "invalid_request_error"


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


class NotFound(APIError):
    """404: unknown model, route or resource."""

    status = 404
    type = "invalid_request_error"


class PayloadTooLarge(APIError):
    """413: request body over the configured limit (chunked bodies included)."""

    status = 413
    type = "invalid_request_error"


class RateLimited(APIError):
    """429 ``rate_limit_exceeded`` (or ``insufficient_quota`` for an exhausted daily quota)."""

    status = 429
    type = "requests"


class ServiceUnavailable(APIError):
    """503: no backend (starting, restarting, or shutting down)."""

    status = 503
    type = "server_error"


class InternalError(APIError):
    """500: a fault of ours; the message says nothing private."""

    status = 500
    type = "server_error"
