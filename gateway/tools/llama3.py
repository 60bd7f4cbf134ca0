"""The Llama 3.1/3.2/3.3 JSON tool-call format: the whole assistant message is one call object
``{"name": NAME, "parameters": {...}}``, sometimes after the ``<|python_tag|>`` control token (Meta's
"JSON based tool calling" prompt format, https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/;
the ``meta-llama-Llama-3.x-Instruct`` chat templates, which render a history call exactly so and refuse
more than one call per assistant message). Documented in ``docs/tools.md`` ("Other families").

* ``Llama3Format.grammar``: ``tool_choice`` "required" or named is one call object (llguidance ``%json``,
  ``{"name": const, "parameters": <parameters>}`` in that order, ``json.dumps`` spacing), whatever
  ``parallel_tool_calls`` says: the templates take one call per message. ``auto`` has no grammar (the model
  writes as it was trained, control tokens included; the parser decides), ``none`` neither.
* ``Llama3Format.parser``: a ``JsonCallParser``: the call may be preceded by ``<|python_tag|>`` (when the
  detokenizer keeps it) or not; ``"arguments"`` is accepted for ``"parameters"``; calls separated by ``;``
  are several calls (only the first without ``parallel_tool_calls``: no grammar enforces it in ``auto``).
  Without the marker, JSON that does not call an offered function is content.
* ``Llama3Format.render_history`` (a template without tools): calls as that JSON, results as the text of a
  ``user`` turn, the preamble (the Llama 3.2 template's wording) in the system turn.

Raises only ``gateway.errors.InvalidRequest`` (``render_history``: a malformed history tool call).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.tools.grammar import function_rules
from gateway.tools.history import dump_call, rewrite_history
from gateway.tools.jsoncall import JsonCallParser, JsonCallSyntax
from gateway.tools.parser import FirstCallOnly, ToolParser, new_call_id, register_format
from gateway.tools.spec import ToolPlan

__all__ = ["Llama3Format", "SYNTAX", "PYTHON_TAG"]

PYTHON_TAG = "<|python_tag|>"
SYNTAX = JsonCallSyntax(markers=(PYTHON_TAG,), args_keys=("parameters", "arguments"), separator=";")

_PREAMBLE = (
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. '
    "Do not use variables.\n\n"
)


def _call_object(name: str, args: Any) -> dict[str, Any]:
    return {"name": name, "parameters": args}


class Llama3Format:
    """``ToolFormat`` for Llama 3.x Instruct models (see the module docstring)."""

    name = "llama3"
    markers = SYNTAX.markers

    def preamble(self, plan: ToolPlan) -> str:
        """The Llama 3.2 template's tool instructions and one indented JSON signature per tool; "" for mode
        ``none``."""
        if plan.mode == "none":
            return ""
        text = _PREAMBLE + "".join(json.dumps(t.signature(), indent=4) + "\n\n" for t in plan.tools)
        if plan.mode == "named":
            return f'{text}You must call the function "{plan.named}" now.'
        if plan.mode == "required":
            return f"{text}You must call one function now."
        return text.rstrip("\n")

    def grammar(self, plan: ToolPlan) -> str | None:
        """Lark source for a forced call (one call object), None for modes ``none`` and ``auto``."""
        if plan.mode in ("none", "auto"):
            return None
        tools = [t for t in plan.tools if plan.mode != "named" or t.name == plan.named]
        return "\n".join(["%llguidance {}", "start: fn", *function_rules(tools, "parameters")]) + "\n"

    def parser(self, plan: ToolPlan) -> ToolParser:
        """A fresh parser; calls without ``<|python_tag|>`` must name one of ``plan.tools``; without
        ``plan.parallel``, calls after the first are dropped (``FirstCallOnly``)."""
        p = JsonCallParser(SYNTAX, frozenset(t.name for t in plan.tools), new_call_id)
        return p if plan.parallel else FirstCallOnly(p)

    def render_history(self, messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
        """Messages for a template without tools: an assistant's calls become ``{"name", "parameters"}``
        JSON (several joined by ``"; "``), a ``tool`` result its text in a ``user`` turn.
        Raises ``InvalidRequest`` as ``gateway.tools.history.dump_call``."""
        return rewrite_history(
            messages,
            self.preamble(plan) if plan is not None else "",
            calls_text=lambda calls: "; ".join(dump_call(c, p, _call_object) for c, p in calls),
            result_text=lambda text: text,
        )


register_format(Llama3Format())
