"""What constrains a chat request's output: tools (``gateway.tools``) and structured output
(``gateway.structured``), resolved into one grammar, the messages the template renders, and the parser
that turns the output back into tool calls.

Which grammar wins, when a request has several:

1. ``tool_choice`` "required" or a named function: the tool-call grammar (param ``tool_choice``);
2. else ``response_format`` / ``structured_outputs`` (giving both is a 400; Ollama's ``format`` comes in
   as ``override``);
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
from typing import Any

import msgspec

from backend.protocol import Grammar
from gateway.errors import InvalidRequest
from gateway.openai.schemas import ChatRequest
from gateway.state import Gateway
from gateway.structured import formats
from gateway.structured.checker import ref_cycle
from gateway.tools import ToolParser, ToolPlan, parse_tools, tool_format


class ChatConstraints(msgspec.Struct, kw_only=True):
    """``grammar`` (checked) and the parameter it came from; ``messages`` and ``tools`` to render;
    ``plan``: the tool plan; ``parser``: makes one choice's tool-call parser (None: plain content)."""

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


async def chat_constraints(
    gw: Gateway, req: ChatRequest, messages: Any, override: tuple[Grammar, str] | None = None
) -> ChatConstraints:
    """Resolve and check the constraints of ``req`` (see the module docstring). ``messages``: after the
    prompt hooks. Raises ``InvalidRequest``."""
    plan = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    if plan is not None:  # the call grammar's first mask does not reach into the arguments: check here
        for i, tool in enumerate(plan.tools):
            cycle = ref_cycle(tool.parameters)
            if cycle:
                param = f"tools[{i}].function.parameters"
                raise InvalidRequest(
                    f"Invalid value for '{param}': '$ref' cycle {' -> '.join(cycle)} describes no value.",
                    param=param,
                    code="invalid_value",
                )
    grammar: Grammar | None = None
    param: str | None = None
    rf = formats.from_response_format(req.response_format)
    so = formats.from_structured_outputs(req.structured_outputs)
    if rf is not None and so is not None:
        raise InvalidRequest(
            "Give either 'response_format' or 'structured_outputs', not both.",
            param="structured_outputs",
            code="invalid_value",
        )
    if override is not None:
        grammar, param = override
    elif rf is not None:
        grammar, param = rf, "response_format"
    elif so is not None:
        grammar, param = so, "structured_outputs"
    fmt = tool_format(gw.template.source)
    if plan is not None and plan.mode in ("required", "named"):
        src = fmt.grammar(plan)
        if src is not None:
            grammar, param = formats.make_grammar("lark", src), "tool_choice"
    elif plan is not None and plan.mode == "auto" and grammar is None:
        src = fmt.grammar(plan)
        if src is not None:
            grammar, param = formats.make_grammar("lark", src), "tools"
    if grammar is not None and param is not None:
        await gw.grammars.check(grammar, param)
    out = ChatConstraints(grammar=grammar, grammar_param=param, messages=messages, plan=plan)
    if plan is not None and plan.mode != "none":
        out.parser = lambda: fmt.parser(plan)
    if gw.template.supports_tools and gw.template.supports_tool_calls:
        out.tools = req.tools if plan is not None else None
    elif plan is not None or _has_tool_history(messages):
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            out.messages = fmt.render_history(messages, plan)
    return out
