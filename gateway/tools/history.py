"""Tool calls and tool results of a conversation rewritten as text, for a chat template that renders neither
(``ToolFormat.render_history``). Each format says how one call and one result are written; the walk over
the OpenAI messages (``assistant.tool_calls`` / legacy ``function_call``, ``tool`` / legacy ``function``
results) and the preamble's place are the same for all. Rules: ``docs/tools.md`` ("Prompt").

Raises only ``gateway.errors.InvalidRequest``: a history tool call without a ``function`` object naming a
string ``name`` (param ``messages[i].tool_calls[j]`` / ``messages[i].function_call``), non-string
``arguments`` nested too deeply to encode again (``...function.arguments``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from gateway.errors import InvalidRequest
from templating.chat_template import TEXT_PART_SEPARATOR

__all__ = ["message_text", "dump_call", "rewrite_history"]

#: ``(name, arguments) -> dict`` the JSON object a format writes for one call.
CallObject = Callable[[str, Any], dict[str, Any]]


def message_text(content: Any) -> str:
    """A message's content as text: None -> "", text parts joined as ``normalize_messages`` joins them."""
    if content is None:
        return ""
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return TEXT_PART_SEPARATOR.join(p for p in parts if isinstance(p, str))
    return str(content)


def dump_call(call: Any, param: str, obj: CallObject) -> str:
    """One history tool call ``{"function": {"name", "arguments"}}`` as the JSON text of ``obj(name, args)``.

    ``arguments`` is parsed from its JSON string (kept as that string if it does not parse, or is nested too
    deeply to decode). Raises ``InvalidRequest`` (see the module docstring)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest(
            f"Invalid value for '{param}': expected an object with 'function': "
            "{'name': string, 'arguments': string}.",
            param=param,
            code="invalid_value",
        )
    raw = fn.get("arguments")
    args: Any = {} if raw is None else raw
    if isinstance(raw, str):
        try:
            args = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or nested too deeply to decode
            args = raw  # rendered as the JSON string it is
    try:
        return json.dumps(obj(fn["name"], args), ensure_ascii=False)
    except RecursionError:  # decoded, but too deep to encode again from here
        if not isinstance(raw, str):
            raise InvalidRequest(
                f"Invalid value for '{param}.function.arguments': nested too deeply.",
                param=f"{param}.function.arguments",
                code="invalid_value",
            ) from None
        return json.dumps(obj(fn["name"], raw), ensure_ascii=False)


def rewrite_history(
    messages: list[dict[str, Any]],
    preamble: str,
    *,
    calls_text: Callable[[list[tuple[Any, str]]], str],
    result_text: Callable[[str], str],
    results_join: str = "\n",
) -> list[dict[str, Any]]:
    """New message dicts with tool calls and results as text, the preamble in the system turn.

    An assistant message's ``tool_calls`` (or legacy ``function_call``) are removed and its content becomes
    the content (if any) and ``calls_text([(call, param), ...])``, joined by ``"\\n"``. A ``tool`` (or legacy
    ``function``) message becomes ``result_text(content)`` in a ``user`` message; consecutive results share
    one, joined by ``results_join``. ``preamble`` (if not "") is appended to the first system message after
    a blank line, or is a new first system message. Raises ``InvalidRequest`` (module docstring)."""
    out: list[dict[str, Any]] = []
    in_results = False
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in ("tool", "function"):
            block = result_text(message_text(m.get("content")))
            if in_results:
                out[-1]["content"] += results_join + block
            else:
                out.append({"role": "user", "content": block})
            in_results = True
            continue
        in_results = False
        calls = m.get("tool_calls")
        legacy = m.get("function_call")
        if role != "assistant" or not (calls or legacy):
            out.append(dict(m))
            continue
        if calls:
            if not isinstance(calls, list):
                raise InvalidRequest(
                    f"Invalid type for 'messages[{i}].tool_calls': expected an array of tool calls.",
                    param=f"messages[{i}].tool_calls",
                    code="invalid_type",
                )
            written = calls_text([(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)])
        else:
            written = calls_text([({"function": legacy}, f"messages[{i}].function_call")])
        text = message_text(m.get("content"))
        new = {k: v for k, v in m.items() if k not in ("tool_calls", "function_call")}
        new["content"] = f"{text}\n{written}" if text else written
        out.append(new)
    if preamble:
        if out and out[0].get("role") in ("system", "developer"):
            head = message_text(out[0].get("content"))
            out[0] = {**out[0], "content": f"{head}\n\n{preamble}" if head else preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out
