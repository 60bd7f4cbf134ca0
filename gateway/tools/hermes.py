"""The Hermes / Qwen2.5 tool-call format: a ``# Tools`` system preamble, ``<tool_call>`` JSON blocks, and
``<tool_response>`` results (https://github.com/NousResearch/Hermes-Function-Calling; Qwen2.5's chat
template). Documented in ``docs/tools.md``.

Model output, one block per call, blocks separated by ``"\\n"``::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* ``HermesFormat.grammar`` writes llguidance Lark (https://github.com/guidance-ai/llguidance
  ``docs/syntax.md``): each call is a ``%json`` schema ``{"name": const, "arguments": <parameters>}`` in that
  order, written ``json.dumps``-style (``", "`` and ``": "``, no other whitespace).
* ``HermesParser`` splits streamed output into content and OpenAI ``delta.tool_calls`` pieces. Mode
  ``"none"`` uses no parser: text that looks like a call stays content.
* ``HermesFormat.render_history`` turns assistant ``tool_calls`` into blocks and ``tool`` results into
  ``<tool_response>`` blocks inside a ``user`` turn (Qwen2.5's choice; every chat template knows ``user``).

Raises only ``gateway.errors.InvalidRequest`` (``render_history``: a malformed history tool call); the
parser never raises, whatever the model writes (JSON too deeply nested to decode is a block that does not
parse).
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.tools.grammar import function_rules
from gateway.tools.history import dump_call, rewrite_history
from gateway.tools.parser import (
    JsonValueEnd,
    MarkerFinder,
    ToolCall,
    ToolCallDelta,
    json_members,
    new_call_id,
    partial_suffix,
    register_format,
)
from gateway.tools.spec import ToolPlan

__all__ = ["HermesFormat", "HermesParser", "CALL_START", "CALL_END"]

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_RESPONSE_START = "<tool_response>"
_RESPONSE_END = "</tool_response>"

_PREAMBLE = """# Tools

You may call {how} to help with the user's request.

The functions are described by JSON signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a JSON object with the function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

# Free text that never contains a call marker (llguidance's `&` and `~` regex operators).
_TEXT = "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/"


class HermesFormat:
    """``ToolFormat`` for Hermes-style models (Hermes 2/3, Qwen2.5) and for models with no format of their
    own (SmolLM2)."""

    name = "hermes"
    markers: tuple[str, ...] = ()  # <tool_call> is an ordinary added token where it exists

    def preamble(self, plan: ToolPlan) -> str:
        """The ``# Tools`` system text; "" for mode ``none`` (the tools are not shown at all)."""
        if plan.mode == "none":
            return ""
        tools = "\n".join(json.dumps(t.signature(), ensure_ascii=False) for t in plan.tools)
        text = _PREAMBLE.format(how="one or more functions" if plan.parallel else "one function", tools=tools)
        if plan.mode == "named":
            return f'{text}\n\nYou must call the function "{plan.named}" now.'
        if plan.mode == "required":
            need = "at least one function" if plan.parallel else "exactly one function"
            return f"{text}\n\nYou must call {need} now."
        return text if plan.parallel else f"{text}\n\nCall at most one function."

    def grammar(self, plan: ToolPlan) -> str | None:
        """Lark source for the whole output, or None (mode ``none``).

        ``auto``: text without ``<tool_call>``, or text then calls (from the first ``<tool_call>`` on, the
        rest must be calls); ``required``: calls only; ``named``: one call of that function. More than one
        call only when ``plan.parallel`` (``named``: always one).
        """
        if plan.mode == "none":
            return None
        tools = [t for t in plan.tools if plan.mode != "named" or t.name == plan.named]
        more = ' ("\\n" call)*' if plan.parallel and plan.mode != "named" else ""
        lines = ["%llguidance {}"]
        if plan.mode == "auto":
            lines += [f"start: TEXT | LEAD body{more}", 'LEAD: TEXT "<tool_call>"', _TEXT]
        else:
            lines += [f"start: call{more}"]
        if plan.mode != "auto" or more:
            lines.append('call: "<tool_call>" body')
        lines.append('body: "\\n" fn "\\n</tool_call>"')
        lines += function_rules(tools)
        return "\n".join(lines) + "\n"

    def parser(self, plan: ToolPlan) -> HermesParser:
        """A fresh ``HermesParser`` (it does not depend on the plan: the grammar does the enforcing)."""
        del plan
        return HermesParser()

    def render_history(self, messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
        """New message dicts with tool calls and results as text, the preamble in the system turn
        (``gateway.tools.history.rewrite_history``).

        ``messages`` are OpenAI messages (as ``normalize_messages`` returns them). An assistant message's
        ``tool_calls`` (or legacy ``function_call``) become ``<tool_call>`` blocks after its content, joined
        by ``"\\n"``; a ``tool`` (or legacy ``function``) message becomes
        ``<tool_response>\\n{content}\\n</tool_response>`` in a ``user`` message; consecutive results share
        one.

        Raises:
            InvalidRequest: a tool call without a ``function`` object naming a string ``name``
                (param ``messages[i].tool_calls[j]`` / ``messages[i].function_call``); non-string
                ``arguments`` nested too deeply to encode (``...function.arguments``).
        """
        return rewrite_history(
            messages,
            self.preamble(plan) if plan is not None else "",
            calls_text=lambda calls: "\n".join(
                f"{CALL_START}\n{dump_call(c, param, _call_object)}\n{CALL_END}" for c, param in calls
            ),
            result_text=lambda text: f"{_RESPONSE_START}\n{text}\n{_RESPONSE_END}",
        )


def _call_object(name: str, args: Any) -> dict[str, Any]:
    return {"name": name, "arguments": args}


_W = r"[ \t\n\r]*"
# The start of a call as the grammar writes it: name first, then the arguments value.
_HEAD = re.compile(rf'{_W}\{{{_W}"name"{_W}:{_W}("(?:[^"\\]|\\.)*"){_W},{_W}"arguments"{_W}:{_W}')


class HermesParser:
    """Streaming ``ToolParser`` for Hermes output.

    * Content is the text outside ``<tool_call>...</tool_call>`` blocks. Whitespace between text and a block
      is dropped (before ``<tool_call>``, after ``</tool_call>``), so the ``"\\n"`` separating calls is never
      content. Held back until resolved: trailing whitespace and a possible partial ``<tool_call>``.
    * A block ends at the first ``</tool_call>`` outside a JSON string (so strings may contain the marker).
    * Once a block reads ``{"name": "<string>", "arguments": `` and the first character of the value, the
      call is announced (``index``, new ``id``, ``name``) and argument text is streamed as it arrives, up to
      the end of the arguments value (found by tracking JSON strings and brackets): fragments concatenate
      to exactly ``ToolCall.arguments``.
    * When the block ends its JSON is parsed (``json_members``). A valid ``{"name": str, "arguments": ...}``
      in another order (or spacing) is announced then, in one piece. A block that does not parse (JSON
      nested too deeply to decode included) is returned as content, verbatim, if it was never announced; an announced one stays a call with the
      argument text streamed so far. Either way ``incomplete`` becomes true.
    * ``finish()`` inside a block: if its JSON is already complete (only ``</tool_call>`` is missing) it
      is a call; otherwise as above (``incomplete``), e.g. output cut by ``max_tokens``.

    The result does not depend on how the text is split into ``feed`` calls.
    """

    def __init__(self) -> None:
        self._buf = ""  # held-back content, or the open block's text after <tool_call>
        self._inside = False
        self._after_call = False  # drop leading whitespace
        self._calls: list[ToolCall] = []
        self._incomplete = False
        self._reset_block()

    def _reset_block(self) -> None:
        self._end = MarkerFinder(CALL_END)
        self._id = ""
        self._name = ""
        self._value: JsonValueEnd | None = None  # set once the call is announced
        self._args_start = 0
        self._head_failed = False

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._calls)

    @property
    def incomplete(self) -> bool:
        return self._incomplete

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._take_text(content) if not self._inside else self._read_block(content, deltas):
            pass
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.feed("")
        out = [content]
        if self._inside:
            t, limit = self._buf, self._end.pos  # past limit: a cut-off "</tool_call>"
            self._end_block(t[:limit], t[limit:], out, deltas, final=True)
        else:
            out.append(self._buf.lstrip() if self._after_call else self._buf)
        self._buf = ""
        return "".join(out), deltas

    def _take_text(self, content: list[str]) -> bool:
        """Content up to the next ``<tool_call>``; True when a block opened."""
        buf = self._buf
        if self._after_call:
            buf = buf.lstrip()
            if not buf:
                self._buf = ""
                return False
            self._after_call = False
        i = buf.find(CALL_START)
        if i >= 0:
            content.append(buf[:i].rstrip())
            self._buf = buf[i + len(CALL_START) :]
            self._inside = True
            return True
        cut = len(buf[: len(buf) - partial_suffix(buf, CALL_START)].rstrip())
        content.append(buf[:cut])
        self._buf = buf[cut:]
        return False

    def _read_block(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Advance the open block; True when it closed."""
        t = self._buf
        end = self._end.find(t)
        self._advance(t, self._end.pos, deltas)
        if end is None:
            return False
        self._end_block(t[:end], CALL_END, content, deltas, final=False)
        self._buf = t[end + len(CALL_END) :]
        return True

    def _advance(self, t: str, limit: int, deltas: list[ToolCallDelta]) -> None:
        """Announce the call once its head is complete; stream the argument text seen up to ``limit``."""
        if self._value is None and not self._head_failed:
            m = _HEAD.match(t, 0, limit)
            if m and m.end() < limit:
                try:
                    name = json.loads(m.group(1))
                except (ValueError, RecursionError):
                    self._head_failed = True
                else:
                    self._announce(name, deltas)
                    self._args_start = m.end()
                    self._value = JsonValueEnd(m.end())
        if self._value is not None:
            start = self._value.pos
            end = self._value.scan(t, limit)
            if end > start:
                deltas.append(ToolCallDelta(index=len(self._calls), arguments=t[start:end]))

    def _announce(self, name: str, deltas: list[ToolCallDelta]) -> None:
        self._id, self._name = new_call_id(), name
        deltas.append(ToolCallDelta(index=len(self._calls), id=self._id, name=name))

    def _end_block(
        self, body: str, rest: str, content: list[str], deltas: list[ToolCallDelta], *, final: bool
    ) -> None:
        """The block is over: ``body`` is its text before ``</tool_call>`` and ``rest`` what follows it in
        the output (the marker, or a cut-off piece of it at the end)."""
        members = json_members(body) or []
        fields = {k: (v, s, e) for k, v, s, e in reversed(members)}  # the first of a repeated key wins
        name = fields.get("name", (None, 0, 0))[0]
        index = len(self._calls)
        if isinstance(name, str) and "arguments" in fields:
            _, start, end = fields["arguments"]
            if self._value is None:
                self._announce(name, deltas)
                sent = start
            else:
                sent = self._value.pos
            if end > sent:
                deltas.append(ToolCallDelta(index=index, arguments=body[sent:end]))
            self._calls.append(ToolCall(id=self._id, name=self._name, arguments=body[start:end]))
        else:
            self._incomplete = True
            if self._value is not None:
                args = body[self._args_start : self._value.pos]
                self._calls.append(ToolCall(id=self._id, name=self._name, arguments=args))
            else:
                content.append(CALL_START + body + rest)
        self._inside = False
        self._after_call = not final
        self._reset_block()


register_format(HermesFormat())
