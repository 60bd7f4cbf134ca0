"""What constrains a chat request's output: tools (``gateway.tools``) and structured output
(``gateway.structured``), resolved into one grammar, the messages the template renders, and the parser
that turns the output back into tool calls.

Which grammar wins, when a request has several:

1. ``tool_choice`` "required" or a named function: the tool-call grammar (param ``tool_choice``); a
   ``response_format`` given too is still checked (a bad one is a 400), though a forced call leaves no
   text answer for it to shape;
2. else ``response_format`` / ``structured_outputs`` (giving both is a 400; Ollama's ``format`` comes in
   as ``override``); with ``tools`` in "auto" the output then follows the schema and is not parsed for
   calls;
3. else ``tools`` with ``tool_choice`` "auto": the tool format's auto grammar, if it has one;
4. else none.

Tools reach the prompt through the model's chat template when it renders ``tools``; otherwise the tool
format writes them into the system turn and rewrites tool calls and tool results in the history
(``ToolFormat.render_history``). With ``tool_choice`` "none" there is no parser: text that looks like a
call stays content.

Errors: ``InvalidRequest`` (400) naming the parameter, from parsing or from the grammar check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from backend.protocol import Grammar
from gateway.errors import InvalidRequest
from gateway.openai.schemas import ChatRequest
from gateway.structured import formats
from gateway.structured.checker import GrammarCheck
from gateway.tools import ToolParser, ToolPlan, parse_tools, tool_format
from gateway.tools.parser import CallsOnly
from templating import ChatTemplate


class Templated(Protocol):
    """What the constraints read of the served model (``gateway.catalog.ServedModel``): its chat template
    (None: the default tool format, tools written into the system turn)."""

    @property
    def template(self) -> ChatTemplate | None: ...


class ChatConstraints(msgspec.Struct, kw_only=True):
    """``grammar`` and the parameter it came from; ``checks``: every grammar of the request to check
    (the one sent first); ``messages`` and ``tools`` to render; ``plan``: the tool plan; ``parser``: makes
    one choice's tool-call parser (None: plain content)."""

    checks: list[GrammarCheck] = []
    grammar: Grammar | None = None
    grammar_param: str | None = None
    messages: Any = None
    tools: list[Any] | None = None
    plan: ToolPlan | None = None
    parser: Callable[[], ToolParser] | None = None


def _has_tool_history(messages: Any) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages
    )


def chat_constraints(
    model: Templated, req: ChatRequest, messages: Any, override: tuple[Grammar, str] | None = None
) -> ChatConstraints:
    """Resolve the constraints of ``req`` for ``model`` (the served model: its template's tool format; see the
    module docstring). ``messages``: after the prompt hooks.
    The grammars are checked later, by the run after admission (``ChatConstraints.checks``).
    Raises ``InvalidRequest`` (shapes: tools, tool_choice, response_format, structured_outputs)."""
    plan = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    rf = formats.from_response_format(req.response_format)
    so = formats.from_structured_outputs(req.structured_outputs)
    if rf is not None and so is not None:
        raise InvalidRequest(
            "Give either 'response_format' or 'structured_outputs', not both.",
            param="structured_outputs",
            code="invalid_value",
        )
    checks: list[GrammarCheck] = []
    if override is not None:
        checks.append(GrammarCheck(grammar=override[0], param=override[1]))
    elif rf is not None:
        checks.append(GrammarCheck(grammar=rf, param="response_format"))
    elif so is not None:
        checks.append(GrammarCheck(grammar=so, param="structured_outputs"))
    template = model.template
    fmt = tool_format(template.source if template is not None else None)
    tool_src = fmt.grammar(plan) if plan is not None else None
    if plan is not None and tool_src is not None and (plan.mode in ("required", "named") or not checks):
        schemas = [(f"tools[{i}].function.parameters", t.parameters) for i, t in enumerate(plan.tools)]
        param = "tool_choice" if plan.mode in ("required", "named") else "tools"
        # a forced call wins over response_format (there is no text answer), which is still checked
        checks.insert(
            0, GrammarCheck(grammar=formats.make_grammar("lark", tool_src), param=param, schemas=schemas)
        )
    out = ChatConstraints(messages=messages, plan=plan, checks=checks)
    if checks:
        out.grammar, out.grammar_param = checks[0].grammar, checks[0].param
    # the output is parsed for calls only when the tools' grammar (or none) shapes it
    if (
        plan is not None
        and plan.mode != "none"
        and (not checks or checks[0].param in ("tools", "tool_choice"))
    ):
        if plan.mode in ("required", "named"):
            out.parser = lambda: CallsOnly(fmt.parser(plan))
        else:
            out.parser = lambda: fmt.parser(plan)
    if template is not None and template.supports_tools and template.supports_tool_calls:
        out.tools = req.tools if plan is not None else None
    elif plan is not None or _has_tool_history(messages):
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            out.messages = fmt.render_history(messages, plan)
    return out
