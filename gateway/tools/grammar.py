"""The llguidance Lark pieces every tool format's grammar shares: one ``%json`` rule per function for its
call object (https://github.com/guidance-ai/llguidance ``docs/syntax.md``, ``x-guidance`` options).

``function_rules(tools, args_key)`` gives the rule ``fn`` (one call of any of ``tools``) and its
alternatives: call objects ``{"name": const, <args_key>: <parameters>}`` in that member order, written
``json.dumps``-style (``", "`` and ``": "``, no other whitespace); ``named_rules(tools)`` the same for
formats that write the name, then the arguments object alone. Nothing here raises.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.tools.spec import FunctionTool, relocate_refs

__all__ = ["call_schema", "function_rules", "named_rules"]

# How arguments are written inside the grammar: json.dumps's default separators, no free whitespace.
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def call_schema(tool: FunctionTool, args_key: str = "arguments") -> dict[str, Any]:
    """JSON Schema of one call object; unsupported keywords are ignored unless the tool is strict.
    Local ``$ref`` pointers of the parameters move under ``#/properties/<args_key>``."""
    params = relocate_refs(tool.parameters, f"#/properties/{args_key}")
    if "type" not in params:
        params = {"type": "object", **params}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
        "x-guidance": {**_JSON_STYLE, "lenient": not tool.strict},
    }


def function_rules(tools: Sequence[FunctionTool], args_key: str = "arguments") -> list[str]:
    """Lark lines: ``fn: fn_0 | fn_1 | ...`` and one ``fn_i: %json {...}`` per tool (a Lark alternative
    rather than one ``anyOf``: each tool keeps its own ``lenient`` flag)."""
    lines = ["fn: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
    lines += [f"fn_{i}: %json {json.dumps(call_schema(t, args_key))}" for i, t in enumerate(tools)]
    return lines


def named_rules(tools: Sequence[FunctionTool]) -> list[str]:
    """Lark lines for name-then-arguments calls: ``fn: fn_0 | ...`` and one ``fn_i: "NAME" %json {...}``
    per tool, the arguments object written as in ``call_schema``."""
    lines = ["fn: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        params = t.parameters if "type" in t.parameters else {"type": "object", **t.parameters}
        schema = {**params, "x-guidance": {**_JSON_STYLE, "lenient": not t.strict}}
        lines.append(f"fn_{i}: {json.dumps(t.name)} %json {json.dumps(schema)}")
    return lines
