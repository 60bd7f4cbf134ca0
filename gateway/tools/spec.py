"""OpenAI ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` -> a validated ``ToolPlan``.

Shapes (OpenAI API reference, "Chat Completions: create", "function calling")::

    tools: [{"type": "function", "function": {"name": str, "description"?: str,
             "parameters"?: <JSON Schema object>, "strict"?: bool}}, ...]
    tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": str}}
    parallel_tool_calls: bool

Rules (documented in ``docs/tools.md``):

* ``tool_choice`` defaults to ``"auto"`` when tools are given, as OpenAI does; an empty ``tools`` array
  counts as no tools.
* Omitted ``parameters`` means a function without arguments: ``{"type": "object", "properties": {},
  "additionalProperties": false}`` (the arguments must be ``{}``).
* ``parameters`` must describe an object: a ``type`` other than ``"object"`` (or a list of types without
  it) is refused, and so is a value nested deeper than ``MAX_SCHEMA_DEPTH`` objects/arrays (measured
  without recursion: every later stage that walks the schema may then recurse safely).
* Members other than the documented ones (in a tool, its ``function``, a ``tool_choice`` object and its
  ``function``) are refused, as OpenAI refuses them.
* A named ``tool_choice`` becomes mode ``"named"`` and must name one of ``tools``.

``relocate_refs`` copies a (validated) schema with its local ``$ref`` pointers moved, for a format that
embeds ``parameters`` in a bigger schema (Hermes' call schema).

Errors are ``gateway.errors.InvalidRequest`` (400 ``invalid_request_error``) whose ``param`` names the
offending field (``tools[1].function.name``, ``tool_choice``...), worded like OpenAI's.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import msgspec

from gateway.errors import InvalidRequest

__all__ = [
    "FunctionTool",
    "ToolMode",
    "ToolPlan",
    "parse_tools",
    "relocate_refs",
    "NAME_PATTERN",
    "MAX_SCHEMA_DEPTH",
]

#: OpenAI's rule for function names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: Most levels of nested objects/arrays in a ``parameters`` value (the value itself is level 1).
MAX_SCHEMA_DEPTH = 64
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_CHOICE_KEYS = frozenset({"type", "function"})
_CHOICE_FUNCTION_KEYS = frozenset({"name"})
_NO_COPY = frozenset({"const", "enum", "default", "examples"})  # JSON values, not schemas

ToolMode = Literal["none", "auto", "required", "named"]
_CHOICES: dict[str, ToolMode] = {"none": "none", "auto": "auto", "required": "required"}


class FunctionTool(msgspec.Struct, frozen=True, kw_only=True):
    """One function the model may call; ``parameters`` is the JSON Schema of its arguments object."""

    name: str
    description: str | None = None
    parameters: dict[str, Any]
    strict: bool = False

    def signature(self) -> dict[str, Any]:
        """The OpenAI ``tools[]`` entry the prompt shows: ``{"type": "function", "function": {"name",
        "description"?, "parameters"}}``."""
        desc = {"description": self.description} if self.description is not None else {}
        return {"type": "function", "function": {"name": self.name, **desc, "parameters": self.parameters}}


class ToolPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What a request asks of tool calling.

    Attributes:
        tools: the functions, in request order (names unique).
        mode: ``none`` (must not call), ``auto`` (may call), ``required`` (one or more calls),
            ``named`` (exactly one call of ``named``).
        named: the forced function's name (mode ``named`` only).
        parallel: ``parallel_tool_calls``; False allows at most one call.
    """

    tools: tuple[FunctionTool, ...]
    mode: ToolMode
    named: str | None = None
    parallel: bool = True

    def tool(self, name: str) -> FunctionTool | None:
        """The tool called ``name``, or None."""
        return next((t for t in self.tools if t.name == name), None)


def _kind(value: object) -> str:
    """JSON type name of a decoded value, with its article ("an object", "a string"...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _wrong_type(param: str, expected: str, value: object) -> InvalidRequest:
    return InvalidRequest(
        f"Invalid type for '{param}': expected {expected}, but got {_kind(value)} instead.",
        param=param,
        code="invalid_type",
    )


def _reject_unknown(obj: dict[str, Any], allowed: frozenset[str], param: str) -> None:
    """Raise ``unknown_parameter`` naming ``param.<key>`` for the first (sorted) member not in ``allowed``."""
    unknown = sorted(str(k) for k in obj if k not in allowed)
    if unknown:
        p = f"{param}.{unknown[0]}"
        raise InvalidRequest(
            f"Unrecognized request argument supplied: '{p}'.", param=p, code="unknown_parameter"
        )


def _depth_exceeds(value: object, limit: int) -> bool:
    """Whether ``value`` nests objects/arrays more than ``limit`` levels deep (iterative, no recursion)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _check_parameters(parameters: dict[str, Any], param: str) -> None:
    """Refuse a ``parameters`` schema nested too deeply or whose ``type`` is not an object's."""
    if _depth_exceeds(parameters, MAX_SCHEMA_DEPTH):
        raise InvalidRequest(
            f"Invalid value for '{param}': the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep.",
            param=param,
            code="invalid_value",
        )
    if "type" in parameters:
        t = parameters["type"]
        if t != "object" and not (isinstance(t, list) and "object" in t):
            shown = json.dumps(t, ensure_ascii=False) if isinstance(t, (str, list)) else _kind(t)
            raise InvalidRequest(
                f"Invalid value for '{param}': the schema must describe an object ('type': 'object'), "
                f"got 'type': {shown[:64]}.",
                param=param,
                code="invalid_value",
            )


def relocate_refs(node: Any, prefix: str) -> Any:
    """A copy of a schema whose local ``$ref`` pointers (``#/...``) are moved under ``prefix``.

    Iterative (an explicit stack, no recursion), so no nesting depth can raise ``RecursionError``; values of
    ``const``/``enum``/``default``/``examples`` are JSON values, kept as they are.
    """
    if not isinstance(node, (dict, list)):
        return node
    root: Any = {} if isinstance(node, dict) else []
    stack: list[tuple[Any, Any]] = [(node, root)]
    while stack:
        src, dst = stack.pop()
        items = src.items() if isinstance(src, dict) else enumerate(src)
        for k, v in items:
            if isinstance(src, dict) and k == "$ref" and isinstance(v, str) and v.startswith("#"):
                v = prefix + v[1:]
            elif isinstance(v, (dict, list)) and not (isinstance(src, dict) and k in _NO_COPY):
                child: Any = {} if isinstance(v, dict) else []
                stack.append((v, child))
                v = child
            if isinstance(dst, dict):
                dst[k] = v
            else:
                dst.append(v)
    return root


def _parse_tool(i: int, entry: object, seen: set[str]) -> FunctionTool:
    p = f"tools[{i}]"
    if not isinstance(entry, dict):
        raise _wrong_type(p, "an object", entry)
    kind = entry.get("type")
    if kind != "function":
        shown = repr(kind) if isinstance(kind, str) else _kind(kind)
        raise InvalidRequest(
            f"Invalid value for '{p}.type': {shown}. Supported values are: 'function'.",
            param=f"{p}.type",
            code="invalid_value",
        )
    _reject_unknown(entry, _TOOL_KEYS, p)
    fn = entry.get("function")
    if fn is None:
        raise InvalidRequest(
            f"Missing required parameter: '{p}.function'.",
            param=f"{p}.function",
            code="missing_required_parameter",
        )
    if not isinstance(fn, dict):
        raise _wrong_type(f"{p}.function", "an object", fn)
    _reject_unknown(fn, _FUNCTION_KEYS, f"{p}.function")
    pn = f"{p}.function.name"
    name = fn.get("name")
    if name is None:
        raise InvalidRequest(
            f"Missing required parameter: '{pn}'.", param=pn, code="missing_required_parameter"
        )
    if not isinstance(name, str):
        raise _wrong_type(pn, "a string", name)
    if not _NAME.fullmatch(name):
        what = "empty string" if not name else "string does not match pattern"
        raise InvalidRequest(
            f"Invalid '{pn}': {what}. Expected a string that matches the pattern '{NAME_PATTERN}'.",
            param=pn,
            code="invalid_value",
        )
    if name in seen:
        raise InvalidRequest(
            f"Invalid '{pn}': duplicate function name '{name}'. Function names must be unique.",
            param=pn,
            code="invalid_value",
        )
    seen.add(name)
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise _wrong_type(f"{p}.function.description", "a string", description)
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}  # no arguments
    elif not isinstance(parameters, dict):
        raise _wrong_type(f"{p}.function.parameters", "an object", parameters)
    else:
        _check_parameters(parameters, f"{p}.function.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _wrong_type(f"{p}.function.strict", "a boolean", strict)
    return FunctionTool(name=name, description=description, parameters=parameters, strict=bool(strict))


def _parse_choice(choice: object) -> tuple[ToolMode | None, str | None]:
    """``tool_choice`` -> (mode or None when absent, forced name)."""
    if choice is None:
        return None, None
    if isinstance(choice, str):
        if choice in _CHOICES:
            return _CHOICES[choice], None
    elif isinstance(choice, dict) and choice.get("type") == "function":
        _reject_unknown(choice, _CHOICE_KEYS, "tool_choice")
        fn = choice.get("function")
        if isinstance(fn, dict):
            _reject_unknown(fn, _CHOICE_FUNCTION_KEYS, "tool_choice.function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str) and name:
            return "named", name
    shown = repr(choice[:64]) if isinstance(choice, str) else _kind(choice)
    raise InvalidRequest(
        f"Invalid value for 'tool_choice': {shown}. Supported values are: 'none', 'auto', 'required', "
        'or an object {"type": "function", "function": {"name": ...}}.',
        param="tool_choice",
        code="invalid_value",
    )


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolPlan | None:
    """Validate OpenAI ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (raw decoded JSON values).

    Returns:
        None when there is nothing to do (no tools, and ``tool_choice`` absent, ``"none"`` or ``"auto"``);
        else the plan. ``tool_choice`` defaults to ``"auto"``, ``parallel_tool_calls`` to true.

    Raises:
        InvalidRequest: ``tools`` not an array (param ``tools``); an entry not an object (``tools[i]``);
            ``type`` not ``"function"`` (``tools[i].type``, code ``invalid_value``); ``function`` missing or
            not an object (``tools[i].function``); a name missing, not a string, empty, not matching
            ``NAME_PATTERN`` or repeated (``tools[i].function.name``); ``description``/``parameters``/
            ``strict`` of the wrong type (``tools[i].function.<field>``); ``parameters`` nested deeper than
            ``MAX_SCHEMA_DEPTH`` or with a ``type`` that is not ``"object"`` (nor a list holding it)
            (``tools[i].function.parameters``, code ``invalid_value``); a member not in the shapes above
            (code ``unknown_parameter``, param the member's path: ``tools[i].x``, ``tools[i].function.x``,
            ``tool_choice.x``, ``tool_choice.function.x``); ``tool_choice`` not one of the accepted values,
            naming a function not in ``tools``, or ``"required"``/named without tools (``tool_choice``);
            ``parallel_tool_calls`` not a boolean (``parallel_tool_calls``).
    """
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise _wrong_type("tools", "an array", tools)
    seen: set[str] = set()
    parsed = tuple(_parse_tool(i, t, seen) for i, t in enumerate(tools))
    mode, named = _parse_choice(tool_choice)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _wrong_type("parallel_tool_calls", "a boolean", parallel_tool_calls)
    if not parsed:
        if mode in (None, "none", "auto"):
            return None
        raise InvalidRequest(
            f"Invalid value for 'tool_choice': {'a named function' if named else repr(mode)} requires "
            "'tools' to list at least one function.",
            param="tool_choice",
            code="invalid_value",
        )
    if named is not None and named not in seen:
        raise InvalidRequest(
            f"Invalid value for 'tool_choice': function '{named[:64]}' is not one of the functions in 'tools'.",
            param="tool_choice",
            code="invalid_value",
        )
    return ToolPlan(
        tools=parsed,
        mode=mode or "auto",
        named=named,
        parallel=parallel_tool_calls is not False,
    )
