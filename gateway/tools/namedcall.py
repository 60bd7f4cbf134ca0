"""Streaming parser for calls written as a function name and then its JSON arguments, each after a marker:
Mistral's v11 layout ``[TOOL_CALLS]NAME[ARGS]{...}`` (optionally ``[CALL_ID]ID`` before ``[ARGS]``), as the
``Mistral-Small-3.2``, ``Devstral`` and ``Ministral-3`` chat templates render history calls. Format:
``gateway.tools.mistral``; rules in ``docs/tools.md`` ("Other families").

Output layout accepted::

    [ws] [text] (marker NAME [ID_MARKER ID] [ARGS_MARKER] value [ws])+ [text]

All three markers are control tokens, which the detokenizer usually drops: then a call reads
``NAME{...}`` (``NAME`` + 9 id characters when the call id marker was dropped) and counts only at the start
of the message, or right after another call, and only for a function the request offers.

Nothing here raises: malformed output is content (or, once announced, the call with the argument text
streamed so far) and sets ``incomplete``, as in ``gateway.tools.jsoncall``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import msgspec

from gateway.tools.jsoncall import WS, JsonCallParser, JsonCallSyntax
from gateway.tools.parser import JsonValueEnd, ToolCall, ToolCallDelta

__all__ = ["NamedCallSyntax", "NamedCallParser"]

_NAME = re.compile(r"[A-Za-z0-9_-]*")
_ID = re.compile(r"[A-Za-z0-9]*")
_DROPPED_ID = 9  # characters of a call id whose marker the detokenizer dropped


class NamedCallSyntax(msgspec.Struct, frozen=True, kw_only=True):
    """Markers of the name-then-arguments layout (Mistral v11: ``[TOOL_CALLS]``, ``[CALL_ID]``, ``[ARGS]``)."""

    marker: str
    id_marker: str
    args_marker: str


class NamedCallParser(JsonCallParser):
    """``ToolParser`` for ``NamedCallSyntax`` output (see the module docstring).

    * Content before a marker streams, holding back trailing whitespace and a possible partial marker; at
      the start of the message a word is held only while it may still be an offered function's name.
    * A call is announced (``index``, id, name) when the first character of its arguments value arrives;
      the argument text then streams up to the value's end. When the value ends its JSON is checked: a
      value that does not parse keeps the call (argument text as written) and sets ``incomplete``.
    * After a marker, a name that is not followed by ``[ARGS]``, ``[CALL_ID]`` or ``{`` makes the marker
      and what follows content (``incomplete``). ``finish`` inside a value is a call with the text so far
      (``incomplete``); inside a name, content.

    The result does not depend on how the text is split into ``feed`` calls.
    """

    def __init__(self, syntax: NamedCallSyntax, names: frozenset[str], new_id: Callable[[], str]) -> None:
        super().__init__(JsonCallSyntax(markers=(syntax.marker,), args_keys=()), names, new_id)
        self._named = syntax

    def _finish_body(self, out: list[str]) -> None:
        """The output ended inside the calls: in a value (a call, ``incomplete``) or in a name (content)."""
        if self._phase == "obj" and self._args is not None:
            self._incomplete = True
            self._calls.append(
                ToolCall(id=self._id, name=self._name, arguments=self._buf[self._args_start :])
            )
        elif self._phase != "between":  # a name, then nothing
            self._incomplete = self._incomplete or self._marked
            out.append(self._lead + self._buf)

    _first_phase = "name"

    def _opens_body(self, s: str) -> bool:
        """After a marker anything is read as a name; at the start of the message, a word."""
        return self._marked or _NAME.match(s).end() > 0  # type: ignore[union-attr]

    def _resolve(self, word: str) -> str | None:
        """The function a name as written stands for, or None (see the module docstring)."""
        if word in self._names or (self._marked and word):
            return word
        base = word[:-_DROPPED_ID]
        return base if len(word) > _DROPPED_ID and base in self._names else None

    def _may_be_name(self, word: str) -> bool:
        """``word`` can still grow into an offered name (plus dropped id characters)."""
        return any(
            n.startswith(word) or (word.startswith(n) and len(word) <= len(n) + _DROPPED_ID)
            for n in self._names
        )

    def _body(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        t, i = self._buf, self._pos
        if self._phase == "name":
            end = _NAME.match(t, i).end()  # type: ignore[union-attr]
            word = t[i:end]
            if not self._marked and not self._may_be_name(word):
                return self._not_named(content)
            if end == len(t):
                return False
            rest = t[end:]
            nm = self._named
            if any(m.startswith(rest) and m != rest for m in (nm.id_marker, nm.args_marker)):
                return False  # maybe a marker: wait
            name = self._resolve(word)
            if name is None:
                return self._not_named(content)
            if rest.startswith(nm.id_marker):
                id_end = _ID.match(t, end + len(nm.id_marker)).end()  # type: ignore[union-attr]
                if id_end == len(t):
                    return False
                end = id_end
                rest = t[end:]
                if nm.args_marker.startswith(rest) and nm.args_marker != rest:
                    return False
            if rest.startswith(nm.args_marker):
                end += len(nm.args_marker)
            elif not rest.startswith("{"):
                return self._not_named(content)
            self._name, self._phase, self._pos = name, "args", end
            return True
        if self._phase == "args":
            while i < len(t) and t[i] in WS:
                i += 1
            if i >= len(t):
                return False
            self._announce(self._name, deltas)
            self._args_start, self._args, self._phase = i, JsonValueEnd(i), "obj"
        if self._phase == "obj":
            assert self._args is not None
            sent = self._args.pos
            upto = self._args.scan(t, len(t))
            if upto > sent:
                deltas.append(ToolCallDelta(index=len(self._calls), arguments=t[sent:upto]))
            if not self._args.done:
                return False
            args = t[self._args_start : upto]
            self._incomplete = self._incomplete or not _parses(args)
            self._calls.append(ToolCall(id=self._id, name=self._name, arguments=args))
            self._args, self._phase, self._pos = None, "between", upto
            return True
        return self._between(t, i)

    def _between(self, t: str, i: int) -> bool:
        """After a call: another call (marked, or a bare offered name), or the end of the calls."""
        while i < len(t) and t[i] in WS:
            i += 1
        self._pos = i
        if i >= len(t):
            return False
        marker = self._named.marker
        if t.startswith(marker, i):
            self._buf, self._pos, self._phase, self._marked = t[i + len(marker) :], 0, "name", True
            self._lead = marker
            return True
        if marker.startswith(t[i:]):
            return False
        if _NAME.match(t, i).end() > i:  # type: ignore[union-attr]
            self._buf, self._pos, self._phase, self._marked, self._lead = t[i:], 0, "name", False, ""
            return True
        return self._to_text(i, after=True)

    def _not_named(self, content: list[str]) -> bool:
        """What looked like a name is not a call: content (the marker too, ``incomplete``)."""
        if self._marked:
            self._incomplete = True
            content.append(self._lead)
            self._lead, self._marked = "", False
        return self._not_calls()


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True
