"""Request fields that constrain the output, turned into one ``backend.protocol.Grammar``.

Served:

* OpenAI ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
* vLLM's ``structured_outputs`` extra: one of ``json`` (a schema, or a JSON string of one), ``regex``,
  ``choice`` (a list of strings: the output is exactly one of them), ``grammar`` (Lark, llguidance's
  dialect), ``json_object: true``;
* Ollama's ``format``: ``"json"`` or a JSON Schema object.

Every error is ``InvalidRequest`` (400) naming the parameter (``response_format.json_schema.schema``,
``structured_outputs.choice``, ``format``...). Whether the grammar compiles is checked afterwards
(``gateway.structured.checker``).

Sources: OpenAI API reference, "Structured Outputs" and ``response_format``; vLLM "Structured Outputs"
(``structured_outputs``: json, regex, choice, grammar); Ollama API, "Structured outputs" (``format``).
"""

from __future__ import annotations

import json
from typing import Any

from backend.protocol import Grammar, grammar_key
from gateway.errors import InvalidRequest

JSON_OBJECT_SCHEMA = '{"type": "object"}'
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def make_grammar(kind: str, source: str) -> Grammar:
    """A ``Grammar`` with its cache key."""
    return Grammar(kind=kind, source=source, key=grammar_key(kind, source))  # type: ignore[arg-type]


def _bad(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


def schema_grammar(schema: Any, param: str) -> Grammar:
    """A JSON Schema (an object, or ``True`` for any value) as a grammar. Raises ``InvalidRequest``."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise _bad(param, "a JSON Schema must be an object.")
    return make_grammar("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))


def from_response_format(rf: Any) -> Grammar | None:
    """OpenAI ``response_format`` -> a grammar (None for ``text`` or absent). Raises ``InvalidRequest``."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise _bad("response_format", "must be an object with a 'type'.")
    kind = rf.get("type")
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise InvalidRequest(
            f"Unrecognized request argument supplied: 'response_format.{sorted(extra)[0]}'.",
            param=f"response_format.{sorted(extra)[0]}",
            code="unknown_parameter",
        )
    if kind in ("text", "json_object") and "json_schema" in rf:
        raise _bad("response_format.json_schema", f"is only allowed with type 'json_schema', not {kind!r}.")
    if kind == "text":
        return None
    if kind == "json_object":
        return make_grammar("json_schema", JSON_OBJECT_SCHEMA)
    if kind != "json_schema":
        raise _bad(
            "response_format.type",
            f"{str(kind)[:40]!r}. Supported values are: 'text', 'json_object' and 'json_schema'.",
        )
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise InvalidRequest(
            "Missing required parameter: 'response_format.json_schema'.",
            param="response_format.json_schema",
            code="missing_required_parameter",
        )
    name = js.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not set(name) <= _NAME_CHARS:
        raise _bad(
            "response_format.json_schema.name",
            "must be 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'.",
        )
    unknown = sorted(set(js) - {"name", "description", "schema", "strict"})
    if unknown:
        raise InvalidRequest(
            f"Unrecognized request argument supplied: 'response_format.json_schema.{unknown[0]}'.",
            param=f"response_format.json_schema.{unknown[0]}",
            code="unknown_parameter",
        )
    if "strict" in js and not isinstance(js["strict"], bool | None):
        raise _bad("response_format.json_schema.strict", "must be a boolean.")
    if "description" in js and not isinstance(js["description"], str | None):
        raise _bad("response_format.json_schema.description", "must be a string.")
    if "schema" not in js:  # OpenAI: a schema-less json_schema asks for any JSON object
        return make_grammar("json_schema", JSON_OBJECT_SCHEMA)
    return schema_grammar(js["schema"], "response_format.json_schema.schema")


def _lark_string(s: str) -> str:
    """A Lark string literal matching ``s`` exactly (JSON escapes are Lark escapes)."""
    return json.dumps(s, ensure_ascii=False)


def from_structured_outputs(so: Any) -> Grammar | None:
    """vLLM ``structured_outputs`` -> a grammar. Exactly one of json, regex, choice, grammar, json_object.
    Raises ``InvalidRequest``."""
    if so is None:
        return None
    p = "structured_outputs"
    if not isinstance(so, dict):
        raise _bad(p, "must be an object.")
    known = {"json", "regex", "choice", "grammar", "json_object"}
    unknown = sorted(set(so) - known - {"disable_fallback", "disable_any_whitespace", "whitespace_pattern"})
    if unknown:
        raise InvalidRequest(
            f"Unrecognized request argument supplied: '{p}.{unknown[0]}'.",
            param=f"{p}.{unknown[0]}",
            code="unknown_parameter",
        )
    for k in ("disable_fallback", "disable_any_whitespace", "whitespace_pattern"):
        if so.get(k) not in (None, False):
            raise InvalidRequest(
                f"'{p}.{k}' is not supported.", param=f"{p}.{k}", code="unsupported_parameter"
            )
    given = [k for k in ("json", "regex", "choice", "grammar") if so.get(k) is not None]
    if so.get("json_object"):
        given.append("json_object")
    if not given:
        return None
    if len(given) > 1:
        raise _bad(p, f"give only one of json, regex, choice, grammar, json_object (got {', '.join(given)}).")
    k = given[0]
    v = so[k]
    if k == "json_object":
        return make_grammar("json_schema", JSON_OBJECT_SCHEMA)
    if k == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                raise _bad(f"{p}.json", "is not valid JSON.") from None
        return schema_grammar(v, f"{p}.json")
    if k == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise _bad(f"{p}.choice", "must be a non-empty array of non-empty strings.")
        return make_grammar("lark", "start: " + " | ".join(_lark_string(c) for c in v))
    if not isinstance(v, str) or not v:
        raise _bad(f"{p}.{k}", "must be a non-empty string.")
    return make_grammar("regex" if k == "regex" else "lark", v)


def from_ollama_format(fmt: Any) -> Grammar | None:
    """Ollama ``format``: ``"json"`` (any JSON object) or a JSON Schema; ``""``/None: none.
    Raises ``InvalidRequest`` (param ``format``)."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return make_grammar("json_schema", JSON_OBJECT_SCHEMA)
    if isinstance(fmt, dict):
        return schema_grammar(fmt, "format")
    raise _bad("format", 'must be "json" or a JSON Schema object.')
