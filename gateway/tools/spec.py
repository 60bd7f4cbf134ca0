"""OpenAI ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` -> a validated ``ToolPlan``.

Shapes (OpenAI API reference, "Chat Completions: create", "function calling")::

    tools: [{"type": "function", "function": {"name": str, "description"?: str,
             "parameters"?: <JSON Schema object>, "strict"?: bool}}, ...]
    tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": str}}
    parallel_tool_calls: bool

Rules (documented in ``docs/tools.md``):

* ``tool_choice`` defaults to ``"auto"`` when tools are given, as OpenAI does; an empty ``tools`` array
  counts as no tools.
* Omitted ``parameters`` means a function without arguments: ``{"type": "object", "properties": {}}``.
* A named ``tool_choice`` becomes mode ``"named"`` and must name one of ``tools``.

Errors are ``gateway.errors.InvalidRequest`` (400 ``invalid_request_error``) whose ``param`` names the
offending field (``tools[1].function.name``, ``tool_choice``...), worded like OpenAI's.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from gateway.errors import InvalidRequest

__all__ = ["FunctionTool", "ToolMode", "ToolPlan", "parse_tools", "NAME_PATTERN"]

#: OpenAI's rule for function names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

ToolMode = Literal["none", "auto", "required", "named"]
_CHOICES: dict[str, ToolMode] = {"none": "none", "auto": "auto", "required": "required"}


class FunctionTool(msgspec.Struct, frozen=True, kw_only=True):
    """One function the model may call; ``parameters`` is the JSON Schema of its arguments object."""

    name: str
    description: str | None = None
    parameters: dict[str, Any]
    strict: bool = False


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
    fn = entry.get("function")
    if fn is None:
        raise InvalidRequest(
            f"Missing required parameter: '{p}.function'.",
            param=f"{p}.function",
            code="missing_required_parameter",
        )
    if not isinstance(fn, dict):
        raise _wrong_type(f"{p}.function", "an object", fn)
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
        parameters = dict(_EMPTY_PARAMETERS)
    elif not isinstance(parameters, dict):
        raise _wrong_type(f"{p}.function.parameters", "an object", parameters)
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
        fn = choice.get("function")
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
            ``strict`` of the wrong type (``tools[i].function.<field>``); ``tool_choice`` not one of the
            accepted values, naming a function not in ``tools``, or ``"required"``/named without tools
            (``tool_choice``); ``parallel_tool_calls`` not a boolean (``parallel_tool_calls``).
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
