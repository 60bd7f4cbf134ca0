"""Streaming parser for tool calls written as bare JSON at the start of a message, optionally after a
marker: Llama 3 (``{"name": ..., "parameters": {...}}``, ``<|python_tag|>``) and Mistral
(``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``). Formats: ``gateway.tools.llama3``,
``gateway.tools.mistral``; rules in ``docs/tools.md`` ("Other families").

Output layout accepted (``JsonCallSyntax`` says which pieces a family uses)::

    [ws] [marker] [ws] body [ws] [text]
    body := object (sep object)*            sep: JsonCallSyntax.separator (Llama: ";")
          | "[" object ("," object)* "]"    only when JsonCallSyntax.array (Mistral)
    object := {"name": str, ARGS: value, ...}   ARGS: the first of JsonCallSyntax.args_keys present

The marker is a control token in these vocabularies, so the detokenizer usually drops it: a body at the
start of the message counts without it, but then only as a call of a function the request offered (JSON
that is an ordinary answer stays content). A marker later in the text (after content) opens calls too.

Nothing here raises: malformed output is content (or, for a call already announced, the call with the
argument text streamed so far) and sets ``incomplete``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import msgspec

from gateway.tools.parser import JsonValueEnd, ToolCall, ToolCallDelta, json_members, partial_suffix

__all__ = ["JsonCallSyntax", "JsonCallParser", "WS"]

#: JSON whitespace
WS = " \t\n\r"
_W = r"[ \t\n\r]*"
_STR = r'"(?:[^"\\]|\\.)*"'
_FIRST_KEY = re.compile(rf"\{{{_W}({_STR})")


class JsonCallSyntax(msgspec.Struct, frozen=True, kw_only=True):
    """How one family writes bare-JSON calls.

    Attributes:
        markers: texts that open the calls (control-token strings such as ``"<|python_tag|>"``).
        args_keys: the member holding the arguments, in order of preference (``"parameters"``).
        array: the calls may be one JSON array of objects.
        separator: the character between consecutive call objects outside an array (None: one call).
    """

    markers: tuple[str, ...]
    args_keys: tuple[str, ...]
    array: bool = False
    separator: str | None = None

    def head(self) -> re.Pattern[str]:
        """The start of a call object as a grammar writes it: ``{"name": "<str>", "<args key>": ``, with an
        optional leading ``"type": "function",`` member (group 1: the name's JSON string, group 2: the key)."""
        keys = "|".join(re.escape(k) for k in self.args_keys)
        lead = rf'(?:"type"{_W}:{_W}"function"{_W},{_W})?'
        return re.compile(rf'\{{{_W}{lead}"name"{_W}:{_W}({_STR}){_W},{_W}"({keys})"{_W}:{_W}')


class JsonCallParser:
    """``ToolParser`` for ``JsonCallSyntax`` output (see the module docstring).

    Args:
        syntax: the family's layout.
        names: the functions the request offers; a call without a marker must name one of them.
        new_id: makes a call id (the family's shape).

    * Content before a marker is streamed, holding back trailing whitespace and a possible partial marker.
    * A body is held back until it is known to be calls: a call is announced (``index``, id, name) once
      its head has arrived (``JsonCallSyntax.head``) and the first character of its arguments value; the
      argument text then streams as it arrives, up to the value's end. A valid call in another member order
      is announced when its object closes, in one piece.
    * Without a marker, the body stops being a candidate (and is content, verbatim) as soon as its first
      member is not ``name``, ``type`` or an args key, or it names a function the request does not offer.
    * An object that does not parse is content, verbatim (from the marker on, when it is the first), or
      stays a call with the argument text streamed so far when it was announced; ``incomplete`` is then
      true. ``finish`` inside an object is the same (output cut by ``max_tokens``). A missing ``]`` after
      complete objects is not an error.

    The result does not depend on how the text is split into ``feed`` calls.
    """

    def __init__(self, syntax: JsonCallSyntax, names: frozenset[str], new_id: Callable[[], str]) -> None:
        self._syn = syntax
        self._head = syntax.head()
        self._names = names
        self._new_id = new_id
        self._buf = ""  # unresolved text: in "body", the body from its first character
        self._mode = "start"  # start | text | body
        self._lead = ""  # whitespace and marker before the body (content if the body fails)
        self._marked = False
        self._after = False  # text mode right after calls: drop leading whitespace
        self._calls: list[ToolCall] = []
        self._incomplete = False
        self._reset_body()

    def _reset_body(self) -> None:
        self._pos = 0  # scan position in the body
        self._phase = "open"  # open | obj | between | next
        self._in_array = False
        self._obj_start = 0
        self._obj: JsonValueEnd | None = None
        self._args: JsonValueEnd | None = None  # set once the call is announced
        self._args_start = 0
        self._id = ""
        self._name = ""
        self._checked = False  # the first member of the first object was looked at
        self._nobj = 0  # objects ended so far

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
        step = {"start": self._start, "text": self._text, "body": self._body}
        while step[self._mode](content, deltas):
            pass
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.feed("")
        out = [content]
        if self._mode == "body":
            self._finish_body(out)
        elif self._mode == "start" and self._marked:  # a marker and nothing after it
            self._incomplete = True
            out.append(self._lead + self._buf)
        else:
            out.append(self._buf.lstrip(WS) if self._after else self._buf)
        self._buf = ""
        return "".join(out), deltas

    def _finish_body(self, out: list[str]) -> None:
        """The output ended inside the calls."""
        if self._phase == "obj":
            self._fail(out, len(self._buf))
        elif self._phase == "next":
            self._incomplete = True
        elif self._phase == "open":  # "[" and nothing more
            self._incomplete = self._incomplete or self._marked
            out.append(self._lead + self._buf)

    # -- start of the message, or right after a marker ------------------------------------------------

    def _start(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        s = self._buf.lstrip(WS)
        if not s:
            return False
        ws = self._buf[: len(self._buf) - len(s)]
        if not self._marked:
            for m in self._syn.markers:
                if s.startswith(m):
                    self._lead += ws + m
                    self._buf = s[len(m) :]
                    self._marked = True
                    return True
                if m.startswith(s):
                    return False  # maybe a marker: wait
        if self._opens_body(s):
            self._lead += ws
            self._buf, self._mode, self._phase, self._pos = s, "body", self._first_phase, 0
            return True
        if self._marked:  # a marker followed by something that is not JSON: the marker is content
            self._incomplete = True
            content.append(self._lead)
        else:
            self._buf = self._lead + self._buf
        self._lead, self._marked, self._mode = "", False, "text"
        return True

    _first_phase = "open"  # the body's phase when it starts

    def _opens_body(self, s: str) -> bool:
        """``s`` (not empty, no leading whitespace, after the marker if any) starts the calls."""
        return s[0] == "{" or (self._syn.array and s[0] == "[")

    # -- content --------------------------------------------------------------------------------------

    def _text(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        buf = self._buf
        if self._after:
            buf = buf.lstrip(WS)
            if not buf:
                self._buf = ""
                return False
            self._after = False
        hits = [(buf.find(m), m) for m in self._syn.markers if m in buf]
        if hits:
            i, m = min(hits)
            content.append(buf[:i].rstrip(WS))
            self._buf = buf[i + len(m) :]
            self._lead, self._marked, self._mode = m, True, "start"
            return True
        hold = max((partial_suffix(buf, m) for m in self._syn.markers), default=0)
        cut = len(buf[: len(buf) - hold].rstrip(WS)) if self._syn.markers else len(buf)
        content.append(buf[:cut])
        self._buf = buf[cut:]
        return False

    # -- the calls ------------------------------------------------------------------------------------

    def _body(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        if self._phase == "obj":
            return self._object(content, deltas)
        t, i = self._buf, self._pos
        while i < len(t) and t[i] in WS:
            i += 1
        self._pos = i
        if i >= len(t):
            return False
        c = t[i]
        if self._phase == "open" and c == "[" and self._syn.array and not self._in_array:
            self._in_array, self._pos = True, i + 1
            return True
        if self._phase == "between":
            if self._in_array and c == "]":
                return self._to_text(i + 1, after=True)
            if c == ("," if self._in_array else self._syn.separator):
                self._phase, self._pos = "next", i + 1
                return True
            self._incomplete = self._incomplete or self._in_array  # an array that does not go on
            return self._to_text(i, after=True)
        if c == "{":
            self._phase, self._obj_start, self._obj = "obj", i, JsonValueEnd(i)
            return True
        if self._phase == "next":  # a separator, then no object: the separator is dropped
            self._incomplete = True
            return self._to_text(i, after=False)
        if not self._marked:  # "[" then no object: ordinary JSON
            return self._not_calls()
        self._incomplete = True
        content.append(self._lead + t[:i])
        return self._to_text(i, after=False)

    def _object(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Advance the open object; True when it ended (as a call or as content)."""
        t, start, obj = self._buf, self._obj_start, self._obj
        assert obj is not None
        end = obj.scan(t, len(t))
        first = self._nobj == 0
        if first and not self._marked and not self._checked:
            m = _FIRST_KEY.match(t, start)
            rest = t[start + 1 : end].lstrip(WS)
            if m is None and ((rest and rest[0] != '"') or obj.done):
                return self._not_calls()
            if m is not None:
                self._checked = True
                if _loads(m.group(1)) not in {"name", "type", *self._syn.args_keys}:
                    return self._not_calls()
        if self._args is None:
            h = self._head.match(t, start, end)
            if h and h.end() < end:
                name = _loads(h.group(1))
                if isinstance(name, str) and (self._marked or name in self._names):
                    self._announce(name, deltas)
                    self._args_start, self._args = h.end(), JsonValueEnd(h.end())
                elif first and not self._marked:
                    return self._not_calls()
        if self._args is not None:
            sent = self._args.pos
            upto = self._args.scan(t, end)
            if upto > sent:
                deltas.append(ToolCallDelta(index=len(self._calls), arguments=t[sent:upto]))
        self._pos = end
        if not obj.done:
            return False
        self._end_object(content, deltas, start, end)
        return True

    def _end_object(self, content: list[str], deltas: list[ToolCallDelta], start: int, end: int) -> None:
        """The object ``buf[start:end]`` closed: a call, or content."""
        t = self._buf
        fields = {k: (v, s, e) for k, v, s, e in reversed(json_members(t[start:end]) or [])}  # first wins
        name = fields.get("name", (None, 0, 0))[0]
        key = next((k for k in self._syn.args_keys if k in fields), None)
        announced = self._args is not None
        if (
            isinstance(name, str)
            and key is not None
            and (self._marked or name in self._names)
            and (not announced or name == self._name)
        ):
            s, e = start + fields[key][1], start + fields[key][2]
            if not announced:
                self._announce(name, deltas)
            sent = self._args.pos if self._args is not None else s
            if e > sent:
                deltas.append(ToolCallDelta(index=len(self._calls), arguments=t[sent:e]))
            self._calls.append(ToolCall(id=self._id, name=self._name, arguments=t[s:e]))
        else:  # without a marker, one whole JSON object that is not a call is an ordinary answer
            self._fail(content, end, call_like=self._marked or announced or self._nobj > 0)
        self._nobj += 1
        self._phase, self._obj, self._args, self._checked = "between", None, None, False

    def _fail(self, content: list[str], end: int, *, call_like: bool = True) -> None:
        """The open object (up to ``end``) is not a call: an announced one stays a call with the argument
        text streamed so far; otherwise its text is content (with the lead, for the first object).
        ``call_like``: it was meant as a call (``incomplete``)."""
        self._incomplete = self._incomplete or call_like
        if self._args is not None:
            args = self._buf[self._args_start : self._args.pos]
            self._calls.append(ToolCall(id=self._id, name=self._name, arguments=args))
        elif self._nobj:
            content.append(self._buf[self._obj_start : end])
        else:
            content.append(self._lead + self._buf[:end])
            self._lead = ""

    def _announce(self, name: str, deltas: list[ToolCallDelta]) -> None:
        self._id, self._name = self._new_id(), name
        deltas.append(ToolCallDelta(index=len(self._calls), id=self._id, name=name))

    def _not_calls(self) -> bool:
        """No marker, and the body is ordinary JSON: it is content, and so is what follows."""
        self._buf = self._lead + self._buf
        self._lead, self._mode = "", "text"
        self._reset_body()
        return True

    def _to_text(self, at: int, *, after: bool) -> bool:
        """The body is over at ``at``: what follows is content (whitespace dropped right after calls)."""
        self._buf = self._buf[at:]
        self._mode, self._after = "text", after
        self._lead, self._marked = "", False
        self._reset_body()
        return True


def _loads(s: str) -> object:
    try:
        return json.loads(s)
    except (ValueError, RecursionError):
        return None
