"""Admin request bodies: read with a size limit, parsed as JSON (RFC 8259), converted into a schema type.

JSON is parsed with Python's :mod:`json`, which also reads the non-standard ``NaN`` and ``Infinity``: those reach
the field checks (e.g. ``expires_at`` must be finite) and get a 400 naming the field rather than ``invalid_json``.
Errors (all OpenAI-shaped, ``gateway.errors``): 413 ``request_too_large`` over :data:`MAX_BODY` bytes; 400
``invalid_json``; 400 ``missing_required_parameter``, ``invalid_type``, ``invalid_value`` or
``unknown_parameter`` with ``param`` naming the field (``limits.rpm`` for a nested one).
"""

from __future__ import annotations

import json
import re
from typing import TypeVar

import msgspec
from starlette.requests import Request

from gateway.errors import InvalidRequest
from gateway.request_body import read_body

MAX_BODY = 256 * 1024  # bytes
T = TypeVar("T")

_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]*)`")
_UNKNOWN = re.compile(r"contains unknown field `([^`]*)`")


def invalid_body(exc: msgspec.ValidationError) -> InvalidRequest:
    """The 400 for a body that does not fit its type, ``param`` naming the field (dotted when nested)."""
    text = str(exc)
    at = _AT.search(text)
    path = at.group(1).replace("[...]", "") if at else ""
    what = text[: at.start()] if at else text
    for pattern, message, code in (
        (_MISSING, "Missing required field: '{}'.", "missing_required_parameter"),
        (_UNKNOWN, "Unknown field: '{}'.", "unknown_parameter"),
    ):
        if m := pattern.search(what):
            param = f"{path}.{m.group(1)}" if path else m.group(1)
            return InvalidRequest(message.format(param), param=param, code=code)
    code = "invalid_type" if what.startswith("Expected `") and "`, got `" in what else "invalid_value"
    return InvalidRequest(f"Invalid value for '{path}': {what}.", param=path or None, code=code)


async def read_json(request: Request, *, required: bool = False) -> object:
    """The body's JSON value; an empty body is ``{}`` (or a 400 when ``required``)."""
    body = await read_body(request, MAX_BODY)
    if not body.strip():
        if required:
            raise InvalidRequest("This request needs a JSON body.", code="invalid_json")
        return {}
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidRequest("The request body is not valid JSON.", code="invalid_json") from None


async def read_struct(request: Request, typ: type[T], *, required: bool = True) -> T:
    """The body as ``typ`` (a msgspec Struct); see the module docstring for the errors. An empty body is a 400
    ``invalid_json`` unless not ``required`` (then it reads as ``{}``): a PATCH or PUT always says what it
    changes."""
    value = await read_json(request, required=required)
    if not isinstance(value, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_type")
    try:
        return msgspec.convert(value, typ)
    except msgspec.ValidationError as exc:
        raise invalid_body(exc) from None
