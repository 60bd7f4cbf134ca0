"""Where a request carries its key: the ``Authorization: Bearer`` header only, never the URL.

A key in a query string ends up in access logs, browser histories and ``Referer`` headers, so a request with a
credential-like query parameter is refused (401) on every path, and the parameter is redacted before anything
logs the URL. Headers are ASGI's: a list of ``(name, value)`` byte pairs, names lower-case (RFC 9110 §5.1:
field names are case-insensitive; §11.6.2 ``Authorization``; RFC 6750 §2.1 the ``Bearer`` scheme).
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import parse_qsl, urlencode

from .errors import Unauthenticated

Headers = Iterable[tuple[bytes, bytes]]

# query parameters that could carry a credential: rejected (401) and redacted from the URL (access logs)
QUERY_KEY_PARAMS = frozenset(
    {
        "api_key",
        "api-key",
        "apikey",
        "key",
        "access_token",
        "token",
        "auth",
        "authorization",
        "bearer",
        "secret",
        "password",
    }
)
QUERY_KEY_MESSAGE = "API keys are not accepted in the query string; use the Authorization: Bearer header."


def bearer_token(headers: Headers) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (scheme case-insensitive); ``""`` for another scheme or
    an empty token; None without the header."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return ""
            return token.strip()
    return None


def _credential(name: str, value: str) -> bool:
    return name.lower() in QUERY_KEY_PARAMS or value.startswith("sk-")


def query_has_key(query_string: bytes) -> bool:
    """Whether a raw query string (``a=1&api_key=...``) holds a credential-like parameter: a name in
    :data:`QUERY_KEY_PARAMS` (any case) or a value starting with ``sk-``."""
    if not query_string:
        return False
    return any(
        _credential(k, v) for k, v in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)
    )


def redact_query(query_string: bytes) -> bytes:
    """``query_string`` with every credential-like parameter's value replaced by ``REDACTED``."""
    pairs = parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)
    return urlencode([(k, "REDACTED" if _credential(k, v) else v) for k, v in pairs]).encode("latin-1")


def reject_query_key(query_string: bytes, *, challenge: bool = False) -> None:
    """Raise :class:`Unauthenticated` (401 ``invalid_api_key``) when the query string holds a credential;
    ``challenge`` adds ``www-authenticate: Bearer`` to the answer."""
    if query_has_key(query_string):
        raise Unauthenticated(
            QUERY_KEY_MESSAGE, headers={"www-authenticate": "Bearer"} if challenge else None
        )
