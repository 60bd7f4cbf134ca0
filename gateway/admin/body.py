"""Admin request bodies: read with a size limit, parsed as JSON (RFC 8259), converted into a schema type.

JSON is parsed with Python's :mod:`json`, which also reads the non-standard ``NaN`` and ``Infinity``: those reach
the field checks (e.g. ``expires_at`` must be finite) and get a 400 naming the field rather than ``invalid_json``.
Errors (all OpenAI-shaped, ``gateway.errors``): 413 ``request_too_large`` over :data:`MAX_BODY` bytes; 400
``invalid_json``; 400 ``missing_required_parameter``, ``invalid_type``, ``invalid_value`` or
``unknown_parameter`` with ``param`` naming the field (``limits.rpm`` for a nested one, ``models[1]`` for an
item, ``model_limits.<model>.rpm`` inside an entry of a map, ``model_limits`` for a bad model name as a key).

Text (:func:`checked_text`, on every body before its type is checked): every string of the body, member names
included, must be valid Unicode text: a lone surrogate (``"\\ud800"``, which JSON's escapes can spell but
UTF-8 cannot encode) is a 400 ``invalid_value`` naming the field, as is a NUL character in a name (a tenant's
or key's ``name``, a model name in ``models`` or as a ``model_limits`` key). The message shows the value
escaped. What the store holds is answered escaped the same way (:func:`encoded`, every admin answer).

Then the limits a body sets (:func:`merged`, :func:`replaced`, :func:`model_limits`) and the models it lists
(:func:`model_list`) as the store keeps them.
"""

from __future__ import annotations

import json
import re
from typing import TypeVar

import msgspec
from starlette.requests import Request

from gateway.admin.schemas import LimitsPatch, LimitsPut
from gateway.errors import InvalidRequest
from gateway.request_body import read_body
from ratelimit.core import DEFAULT_WINDOW_S, LIMIT_FIELDS, Limits

MAX_BODY = 256 * 1024  # bytes
T = TypeVar("T")

_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]*)`")
_UNKNOWN = re.compile(r"contains unknown field `([^`]*)`")
_REGEX = re.compile(r"Expected `str` matching regex '.*'$")
_KEY = re.compile(r" - at `key` in `\$\.?([^`]*)`$")
# map members whose entries are typed: an error inside one is located again entry by entry to name the entry
MAPS: dict[str, type] = {"model_limits": LimitsPatch}


def in_words(what: str) -> str:
    """msgspec's complaint with the one pattern of the schemas (``ModelName``'s) said in words."""
    return _REGEX.sub("Expected a name without leading or trailing white space", what)


def invalid_body(exc: msgspec.ValidationError, within: str = "") -> InvalidRequest:
    """The 400 for a body that does not fit its type, ``param`` naming the field (dotted when nested; under
    ``within`` when the value checked is that member of the body)."""
    text = str(exc)
    key = _KEY.search(text)
    if key:
        what = in_words(text[: key.start()])
        return InvalidRequest(
            f"Invalid key in '{key.group(1)}': {what}.", param=key.group(1), code="invalid_value"
        )
    at = _AT.search(text)
    path = at.group(1).replace("[...]", "") if at else ""
    path = f"{within}.{path}" if within and path else within or path
    what = in_words(text[: at.start()] if at else text)
    for pattern, message, code in (
        (_MISSING, "Missing required field: '{}'.", "missing_required_parameter"),
        (_UNKNOWN, "Unknown field: '{}'.", "unknown_parameter"),
    ):
        if m := pattern.search(what):
            param = f"{path}.{m.group(1)}" if path else m.group(1)
            return InvalidRequest(message.format(param), param=param, code=code)
    code = "invalid_type" if what.startswith("Expected `") and "`, got `" in what else "invalid_value"
    return InvalidRequest(f"Invalid value for '{path}': {what}.", param=path or None, code=code)


async def read_json(request: Request, *, required: bool = False, within: str = "") -> object:
    """The body's JSON value, its text checked (:func:`checked_text`; ``within``: the field the body is, for
    ``param``); an empty body is ``{}`` (or a 400 when ``required``)."""
    body = await read_body(request, MAX_BODY)
    if not body.strip():
        if required:
            raise InvalidRequest("This request needs a JSON body.", code="invalid_json")
        return {}
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidRequest("The request body is not valid JSON.", code="invalid_json") from None
    checked_text(value, within)
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")
_NAMES = re.compile(r"name|models\[\d+\]|model_limits\..*", re.DOTALL)  # the members that name something


def escaped(text: str) -> str:
    """``text`` with every lone surrogate written as its escape (``\\ud800``): encodable as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def encoded(obj: object) -> bytes:
    """``obj`` as JSON. A string that UTF-8 cannot encode (a lone surrogate in a row stored before the admin
    API checked its text, or written by hand) is answered with that character escaped (``a\\ud800``), so
    the row can still be listed, found and fixed."""
    try:
        return msgspec.json.encode(obj)
    except UnicodeEncodeError:
        return msgspec.json.encode(_escaped(msgspec.to_builtins(obj)))


def _escaped(value: object) -> object:
    if isinstance(value, str):
        return escaped(value)
    if isinstance(value, dict):
        return {_escaped(k): _escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    return value


def _bad_text(text: str, path: str, param: str) -> InvalidRequest | None:
    """The 400 for ``text`` found at ``path`` (``param`` named), or None when it is valid there."""
    if _SURROGATE.search(text):
        why = "is not valid Unicode text (a lone surrogate)"
    elif "\x00" in text and _NAMES.fullmatch(path):
        why = "holds a NUL character"
    else:
        return None
    shown = escaped(text[:100]).replace("\x00", "\\u0000")
    return InvalidRequest(f"Invalid value for '{param}': '{shown}' {why}.", param=param, code="invalid_value")


def checked_text(value: object, path: str = "") -> None:
    """Raises ``InvalidRequest`` (400 ``invalid_value`` naming the field: ``name``, ``models[1]``,
    ``filters.hooks[0].patterns[2]``; a member name: its map, ``model_limits``) for a string of ``value``
    that is not valid text (see the module docstring); ``path`` names ``value`` itself ("" for a body)."""
    stack: list[tuple[object, str]] = [(value, path)]
    while stack:
        item, at = stack.pop()
        err = None
        if isinstance(item, str):
            err = _bad_text(item, at, at)
        elif isinstance(item, dict):
            for k, v in item.items():
                inner = f"{at}.{k}" if at else str(k)
                if err is None and isinstance(k, str):
                    err = _bad_text(k, inner, at or escaped(k))
                stack.append((v, inner))
        elif isinstance(item, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))
        if err is not None:
            raise err


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
        raise (entry_error(value, exc) or invalid_body(exc)) from None


def entry_error(value: dict[str, object], exc: msgspec.ValidationError) -> InvalidRequest | None:
    """For an error inside an entry of a :data:`MAPS` member (msgspec says ``$.model_limits[...]``): the 400
    whose ``param`` names the entry (``model_limits.<name>.rpm``); None for any other error."""
    at = _AT.search(str(exc))
    member = at.group(1).split("[...]")[0] if at and "[...]" in at.group(1) else None
    entries = value.get(member) if member in MAPS else None
    if not isinstance(entries, dict):
        return None
    for name, entry in entries.items():
        try:
            msgspec.convert(entry, MAPS[member])
        except msgspec.ValidationError as inner:
            return invalid_body(inner, f"{member}.{name}")
    return None


def merged(given: LimitsPut | LimitsPatch, base: Limits) -> Limits:
    """``base`` with the fields ``given`` sets replaced."""
    values = {f: getattr(given, f) for f in (*LIMIT_FIELDS, "window_s")}
    return Limits(**{f: getattr(base, f) if v is msgspec.UNSET else v for f, v in values.items()})


def replaced(given: LimitsPatch, window_s: float = DEFAULT_WINDOW_S) -> Limits:
    """The limits a ``limits`` member sets: absent fields unlimited, ``window_s`` absent: ``window_s``."""
    return merged(given, Limits(window_s=window_s))


def model_limits(given: dict[str, LimitsPatch] | None, base: dict[str, Limits]) -> dict[str, Limits]:
    """The ``model_limits`` a body sets (the whole map; ``null``: ``{}``): per model, absent fields unlimited,
    ``window_s`` absent: that model's current window in ``base`` (60 s for a model new to the map)."""
    return {
        m: replaced(p, base[m].window_s if m in base else DEFAULT_WINDOW_S) for m, p in (given or {}).items()
    }


def model_list(given: list[str] | None) -> list[str] | None:
    """``models`` as stored: each name once, in its first place; None stays None (every model)."""
    return None if given is None else list(dict.fromkeys(given))
