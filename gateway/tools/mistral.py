"""The Mistral tool-call formats, both opened by the ``[TOOL_CALLS]`` control token. Documented in
``docs/tools.md`` ("Other families").

* ``mistral`` (mistral-common's v3 tokenizer: Mistral 7B v0.3, Mistral Nemo): a JSON array of call objects,
  ``[TOOL_CALLS][{"name": NAME, "arguments": {...}}, ...]``; the ``mistralai-Mistral-Nemo-Instruct-2407``
  template renders history calls so (with an ``"id"`` member) and results as
  ``[TOOL_RESULTS]{"content": ..., "call_id": ...}[/TOOL_RESULTS]``.
* ``mistral-v11`` (v11 and later: Mistral Small 3.2, Devstral, Ministral 3): each call is
  ``[TOOL_CALLS]NAME[ARGS]{...}`` (``[CALL_ID]ID`` before ``[ARGS]`` in Small 3.2's history); chosen when
  the template writes ``[ARGS]``.

Both:

* Call ids are 9 letters and digits: Mistral templates refuse a history call whose id is not
  (``raise_exception("Tool call IDs should be alphanumeric strings with length 9!")``), so ids this gateway
  hands out can be sent back.
* ``grammar``: ``tool_choice`` "required" or named is the calls without their control tokens (a grammar
  matches text, and the detokenizer drops control tokens anyway): ``"[" call (", " call)* "]"`` with calls
  ``{"name": const, "arguments": <parameters>}`` (v3), or ``NAME <arguments>`` repeated (v11); one call for
  a named function or without ``parallel_tool_calls``. llguidance ``%json``, ``json.dumps`` spacing.
  ``auto`` and ``none`` have no grammar.
* ``parser``: ``JsonCallParser`` (v3) or ``NamedCallParser`` (v11), with or without the visible markers;
  text before a visible marker is content; without a marker only a call of an offered function counts;
  without ``parallel_tool_calls`` only the first call is kept (no grammar enforces it in ``auto``).
* ``render_history`` (a template without tools): the layouts above, as text.

Raises only ``gateway.errors.InvalidRequest`` (``render_history``: a malformed history tool call).
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from gateway.tools.grammar import function_rules, named_rules
from gateway.tools.history import dump_call, rewrite_history
from gateway.tools.jsoncall import JsonCallParser, JsonCallSyntax
from gateway.tools.namedcall import NamedCallParser, NamedCallSyntax
from gateway.tools.parser import FirstCallOnly, ToolParser, register_format
from gateway.tools.spec import ToolPlan

__all__ = ["MistralFormat", "SYNTAX", "V11_SYNTAX", "TOOL_CALLS", "ARGS", "mistral_call_id"]

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
SYNTAX = JsonCallSyntax(markers=(TOOL_CALLS,), args_keys=("arguments",), array=True)
V11_SYNTAX = NamedCallSyntax(marker=TOOL_CALLS, id_marker="[CALL_ID]", args_marker=ARGS)
_ID_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """A fresh call id as Mistral templates require it: 9 random letters and digits."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def _call_object(name: str, args: Any) -> dict[str, Any]:
    return {"name": name, "arguments": args}


class MistralFormat:
    """``ToolFormat`` for Mistral models (see the module docstring); ``v11``: the name-then-arguments
    layout."""

    def __init__(self, *, v11: bool = False) -> None:
        self.v11 = v11
        self.name = "mistral-v11" if v11 else "mistral"
        self.markers = (TOOL_CALLS, V11_SYNTAX.id_marker, ARGS) if v11 else SYNTAX.markers

    def preamble(self, plan: ToolPlan) -> str:
        """``[AVAILABLE_TOOLS][...][/AVAILABLE_TOOLS]`` (the signatures as one JSON array) and how to call;
        "" for mode ``none``."""
        if plan.mode == "none":
            return ""
        tools = json.dumps([t.signature() for t in plan.tools], ensure_ascii=False)
        how = (
            f"{TOOL_CALLS}<function-name>{ARGS}<args-json-object> for each call"
            if self.v11
            else f'{TOOL_CALLS} and a JSON array of {{"name": <function-name>, "arguments": <args-json-object>}} objects'
        )
        text = f"[AVAILABLE_TOOLS]{tools}[/AVAILABLE_TOOLS]\n\nTo call functions, answer with {how}."
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
        many = plan.parallel and plan.mode != "named"
        if self.v11:
            start, rules = "start: fn+" if many else "start: fn", named_rules(tools)
        else:
            more = ' (", " fn)*' if many else ""
            start, rules = f'start: "[" fn{more} "]"', function_rules(tools)
        return "\n".join(["%llguidance {}", start, *rules]) + "\n"

    def parser(self, plan: ToolPlan) -> ToolParser:
        """A fresh parser with 9-character ids; calls without ``[TOOL_CALLS]`` must name one of
        ``plan.tools``; without ``plan.parallel``, calls after the first are dropped (``FirstCallOnly``)."""
        names = frozenset(t.name for t in plan.tools)
        if self.v11:
            p: ToolParser = NamedCallParser(V11_SYNTAX, names, mistral_call_id)
        else:
            p = JsonCallParser(SYNTAX, names, mistral_call_id)
        return p if plan.parallel else FirstCallOnly(p)

    def render_history(self, messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
        """Messages for a template without tools: an assistant's calls become ``[TOOL_CALLS][{...}, ...]``
        (v11: ``[TOOL_CALLS]NAME[ARGS]{...}`` per call), a ``tool`` result
        ``[TOOL_RESULTS]{"content": <text as a JSON string>}[/TOOL_RESULTS]`` (v11: the text itself) in a
        ``user`` turn, consecutive results in one. Raises ``InvalidRequest`` as
        ``gateway.tools.history.dump_call``."""
        return rewrite_history(
            messages,
            self.preamble(plan) if plan is not None else "",
            calls_text=self._v11_calls if self.v11 else self._v3_calls,
            result_text=(lambda text: f"[TOOL_RESULTS]{text}[/TOOL_RESULTS]")
            if self.v11
            else (
                lambda text: (
                    "[TOOL_RESULTS]" + json.dumps({"content": text}, ensure_ascii=False) + "[/TOOL_RESULTS]"
                )
            ),
            results_join="",
        )

    @staticmethod
    def _v3_calls(calls: list[tuple[Any, str]]) -> str:
        return TOOL_CALLS + "[" + ", ".join(dump_call(c, p, _call_object) for c, p in calls) + "]"

    @staticmethod
    def _v11_calls(calls: list[tuple[Any, str]]) -> str:
        parts = []
        for c, p in calls:
            obj = json.loads(dump_call(c, p, _call_object))
            parts.append(f"{TOOL_CALLS}{obj['name']}{ARGS}{json.dumps(obj['arguments'], ensure_ascii=False)}")
        return "".join(parts)


register_format(MistralFormat())
register_format(MistralFormat(v11=True))
