"""Ollama tool calling on both sides of the OpenAI shapes the generation path works with.

Sources: Ollama's docs/api.md (https://github.com/ollama/ollama/blob/main/docs/api.md), "Chat request (with
tools)" and "Chat request (with history, with tools)"; the ``ollama`` Python client's ``Message.ToolCall``
(``function: {name: str, arguments: Mapping}``; other members are ignored by it).

Request (``/api/chat``):

    tools        [{"type": "function", "function": {name, description, parameters}}]: the OpenAI shape, passed
                 on as ``ChatRequest.tools`` (checked by ``gateway.tools.parse_tools``: an entry without a
                 name is a 400 naming ``tools[i].function.name``)
    tool_choice  not in Ollama; an extension, as ``options.tool_choice`` or a top-level ``tool_choice``:
                 "auto" (the default with tools), "none", "required", a function name (-> ``{"type":
                 "function", "function": {"name": ...}}``) or that object. Both given and different: 400.
                 A name not in ``tools``: 400 naming ``tool_choice``.

History: an assistant message's ``tool_calls: [{"function": {"name", "arguments": {...}}}]`` become OpenAI
calls ``{"id": "call_<n>", "type": "function", "function": {"name", "arguments": "<JSON text>"}}`` (``n``
counts the conversation's calls from 0; a string ``id`` given is kept; string arguments are kept as they
are). A ``tool`` message (optional ``tool_name``) gets the ``tool_call_id`` of the first unanswered call of
the latest assistant message with that name (with no ``tool_name``: the first unanswered one); when none
is left it goes without. ``content`` is kept (missing: ``""``). Malformed calls (arguments nested too
deeply to encode included): 400 naming ``messages[i].tool_calls[j]...``.

Response: each call of choice 0 as ``{"id", "function": {"name", "arguments": <JSON object>}}``. A call whose
arguments are not a complete JSON object (output cut by ``num_predict``: done_reason "length"; or nested
too deeply to decode) is left out.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import InvalidRequest
from gateway.tools.parser import ToolCall

_MODES = ("auto", "none", "required")


def _given(v: object) -> bool:
    return v is not None and v != ""


def tool_choice(body: dict[str, Any]) -> str | dict[str, Any] | None:
    """The OpenAI ``tool_choice`` of an Ollama body (``options.tool_choice`` or top-level; None: absent).

    Raises:
        InvalidRequest: not a string or an object (param ``options.tool_choice`` / ``tool_choice``), or
            both given and different (``tool_choice``).
    """
    options = body.get("options")
    found: list[tuple[str, Any]] = []
    if isinstance(options, dict) and _given(options.get("tool_choice")):
        found.append(("options.tool_choice", options["tool_choice"]))
    if _given(body.get("tool_choice")):
        found.append(("tool_choice", body["tool_choice"]))
    if not found:
        return None
    if len(found) == 2 and found[0][1] != found[1][1]:
        raise InvalidRequest(
            "'options.tool_choice' and 'tool_choice' disagree: give one of them.",
            param="tool_choice",
            code="invalid_value",
        )
    param, value = found[0]
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise InvalidRequest(
            f"'{param}' must be 'auto', 'none', 'required' or a function name.",
            param=param,
            code="invalid_type",
        )
    return value if value in _MODES else {"type": "function", "function": {"name": value}}


class History:
    """Converts one conversation's messages in order (call numbering and tool result pairing)."""

    def __init__(self) -> None:
        self.n = 0  # calls numbered so far
        self.open: list[tuple[str, str]] = []  # (id, name) of the latest assistant calls not yet answered

    def _call(self, call: object, p: str) -> dict[str, Any]:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise InvalidRequest(
                f"'{p}' must be an object with a 'function' object.", param=p, code="invalid_type"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(
                f"'{p}.function.name' must be a non-empty string.",
                param=f"{p}.function.name",
                code="invalid_value",
            )
        args = fn.get("arguments")
        if args is None:
            args = {}
        if isinstance(args, dict):
            try:
                args = json.dumps(args, ensure_ascii=False)
            except RecursionError:
                raise InvalidRequest(
                    f"'{p}.function.arguments' is nested too deeply.",
                    param=f"{p}.function.arguments",
                    code="invalid_value",
                ) from None
        elif not isinstance(args, str):
            raise InvalidRequest(
                f"'{p}.function.arguments' must be an object.",
                param=f"{p}.function.arguments",
                code="invalid_type",
            )
        cid = call.get("id")  # type: ignore[union-attr]
        if not isinstance(cid, str) or not cid:
            cid = f"call_{self.n}"
        self.n += 1
        return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}

    def message(self, i: int, m: dict[str, Any], content: str) -> dict[str, Any]:
        """Message ``i`` (an Ollama message whose role is a string, ``content`` its text) in OpenAI shape."""
        role = m["role"]
        out: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = m.get("tool_calls")
            self.open = []
            if calls in (None, []):
                return out
            if not isinstance(calls, list):
                raise InvalidRequest(
                    f"messages[{i}].tool_calls must be a list",
                    param=f"messages[{i}].tool_calls",
                    code="invalid_type",
                )
            out["tool_calls"] = [self._call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
            self.open = [(c["id"], c["function"]["name"]) for c in out["tool_calls"]]
        elif role == "tool":
            name = m.get("tool_name")
            if name is not None and not isinstance(name, str):
                raise InvalidRequest(
                    f"messages[{i}].tool_name must be a string",
                    param=f"messages[{i}].tool_name",
                    code="invalid_type",
                )
            if name:
                out["name"] = name
            given = m.get("tool_call_id")
            k = next((k for k, (_, n) in enumerate(self.open) if not name or n == name), None)
            if isinstance(given, str) and given:
                out["tool_call_id"] = given
                k = next((k for k, (cid, _) in enumerate(self.open) if cid == given), None)
            elif k is not None:
                out["tool_call_id"] = self.open[k][0]
            if k is not None:
                del self.open[k]
        return out


def ollama_call(call: ToolCall) -> dict[str, Any] | None:
    """``call`` in Ollama's shape, or None when its arguments are not a JSON object (cut off, or nested too
    deeply to decode). Never raises."""
    try:
        args = json.loads(call.arguments)
    except (ValueError, RecursionError):
        return None
    if not isinstance(args, dict):
        return None
    out: dict[str, Any] = {"function": {"name": call.name, "arguments": args}}
    if call.id:
        out = {"id": call.id, **out}
    return out
