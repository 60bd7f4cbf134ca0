"""The Mistral tool-call format: ``[TOOL_CALLS]`` (a control token) then a JSON array of call objects
``[{"name": NAME, "arguments": {...}}, ...]`` (mistral-common's v3 tokenizer format, used by Mistral 7B
v0.3 and Mistral Nemo; the ``mistralai-Mistral-Nemo-Instruct-2407`` chat template renders history calls so,
with an ``"id"`` member, and tool results as ``[TOOL_RESULTS]{"content": ..., "call_id": ...}[/TOOL_RESULTS]``).
Documented in ``docs/tools.md`` ("Other families").

* Call ids are 9 letters and digits: Mistral templates refuse a history call whose id is not
  (``raise_exception("Tool call IDs should be alphanumeric strings with length 9!")``), so ids this
  gateway hands out can be sent back.
* ``MistralFormat.grammar``: ``tool_choice`` "required" is ``"[" call (", " call)* "]"`` (one call without
  ``parallel_tool_calls``), a named function ``"[" call "]"``; each call ``{"name": const, "arguments":
  <parameters>}`` (llguidance ``%json``, ``json.dumps`` spacing). The ``[TOOL_CALLS]`` control token is not
  part of the grammar: a grammar matches text, and the detokenizer drops control tokens anyway. ``auto``
  and ``none`` have no grammar.
* ``MistralFormat.parser``: a ``JsonCallParser`` for the array (or one bare object), with or without the
  marker; text before a visible marker is content. Without the marker, JSON that does not call an offered
  function is content.
* ``MistralFormat.render_history`` (a template without tools): the layout above, as text.

Raises only ``gateway.errors.InvalidRequest`` (``render_history``: a malformed history tool call).
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from gateway.tools.grammar import function_rules
from gateway.tools.history import dump_call, rewrite_history
from gateway.tools.jsoncall import JsonCallParser, JsonCallSyntax
from gateway.tools.parser import register_format
from gateway.tools.spec import ToolPlan

__all__ = ["MistralFormat", "SYNTAX", "TOOL_CALLS", "mistral_call_id"]

TOOL_CALLS = "[TOOL_CALLS]"
SYNTAX = JsonCallSyntax(markers=(TOOL_CALLS,), args_keys=("arguments",), array=True)
_ID_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """A fresh call id as Mistral templates require it: 9 random letters and digits."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def _call_object(name: str, args: Any) -> dict[str, Any]:
    return {"name": name, "arguments": args}


class MistralFormat:
    """``ToolFormat`` for Mistral models (see the module docstring)."""

    name = "mistral"

    def preamble(self, plan: ToolPlan) -> str:
        """``[AVAILABLE_TOOLS][...][/AVAILABLE_TOOLS]`` (the signatures as one JSON array) and how to call;
        "" for mode ``none``."""
        if plan.mode == "none":
            return ""
        tools = json.dumps([t.signature() for t in plan.tools], ensure_ascii=False)
        text = (
            f"[AVAILABLE_TOOLS]{tools}[/AVAILABLE_TOOLS]\n\nTo call functions, answer with {TOOL_CALLS} and a "
            'JSON array of {"name": <function-name>, "arguments": <args-json-object>} objects.'
        )
        if plan.mode == "named":
            return f'{text}\n\nYou must call the function "{plan.named}" now.'
        if plan.mode == "required":
            return f"{text}\n\nYou must call {'at least' if plan.parallel else 'exactly'} one function now."
        return text if plan.parallel else f"{text}\n\nCall at most one function."

    def grammar(self, plan: ToolPlan) -> str | None:
        """Lark source for a forced call (see the module docstring), None for modes ``none`` and ``auto``."""
        if plan.mode in ("none", "auto"):
            return None
        tools = [t for t in plan.tools if plan.mode != "named" or t.name == plan.named]
        more = ' (", " fn)*' if plan.parallel and plan.mode != "named" else ""
        return "\n".join(["%llguidance {}", f'start: "[" fn{more} "]"', *function_rules(tools)]) + "\n"

    def parser(self, plan: ToolPlan) -> JsonCallParser:
        """A fresh parser with 9-character ids; calls without ``[TOOL_CALLS]`` must name one of
        ``plan.tools``."""
        return JsonCallParser(SYNTAX, frozenset(t.name for t in plan.tools), mistral_call_id)

    def render_history(self, messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
        """Messages for a template without tools: an assistant's calls become ``[TOOL_CALLS][{...}, ...]``,
        a ``tool`` result ``[TOOL_RESULTS]{"content": <text as a JSON string>}[/TOOL_RESULTS]`` in a ``user``
        turn (consecutive results in one). Raises ``InvalidRequest`` as ``gateway.tools.history.dump_call``."""
        return rewrite_history(
            messages,
            self.preamble(plan) if plan is not None else "",
            calls_text=lambda calls: (
                TOOL_CALLS + "[" + ", ".join(dump_call(c, p, _call_object) for c, p in calls) + "]"
            ),
            result_text=lambda text: (
                "[TOOL_RESULTS]" + json.dumps({"content": text}, ensure_ascii=False) + "[/TOOL_RESULTS]"
            ),
            results_join="",
        )


register_format(MistralFormat())
