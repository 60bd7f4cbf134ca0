"""Tool-call output types, the ``ToolParser``/``ToolFormat`` interfaces, and JSON-in-text helpers.

Shapes follow the OpenAI API reference ("chat completion object" ``message.tool_calls[]`` and "chat
completion chunk" ``delta.tool_calls[]``): a streamed call is announced once with its ``index``, ``id``
and function ``name`` (``arguments`` ``""``), then grows by ``arguments`` fragments that concatenate to the
final ``arguments`` string. Call ids are ``"call_"`` + 24 random alphanumerics, as OpenAI's.

A ``ToolFormat`` is one model family's way of writing calls (Hermes ``<tool_call>`` blocks in
``gateway.tools.hermes``, Llama 3 JSON in ``gateway.tools.llama3``, Mistral ``[TOOL_CALLS]`` in
``gateway.tools.mistral``). Formats register themselves with ``register_format`` when their module is
imported (``gateway.tools`` imports them all), and ``tool_format`` picks one for a chat template.

Nothing here raises: a parser reports malformed output through ``ToolParser.incomplete``.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any, Protocol

import msgspec

from gateway.tools.spec import ToolPlan

__all__ = [
    "CallsOnly",
    "FirstCallOnly",
    "ToolCallDelta",
    "ToolCall",
    "ToolParser",
    "ToolFormat",
    "tool_format",
    "register_format",
    "new_call_id",
    "json_members",
    "JsonValueEnd",
    "MarkerFinder",
    "partial_suffix",
]

_ID_ALPHABET = string.ascii_letters + string.digits


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True):
    """One streamed piece of a tool call, OpenAI ``delta.tool_calls[]`` shape: the first piece of call
    ``index`` carries ``id`` and ``name`` (``arguments`` ``""``), later pieces carry only argument
    fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A complete call: ``arguments`` is the JSON text of the arguments object exactly as the model wrote
    it (the concatenation of the call's streamed fragments)."""

    id: str
    name: str
    arguments: str


class ToolParser(Protocol):
    """Splits streamed model text into plain content and tool calls (one per output choice)."""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """New model text -> (plain content safe to send now, tool-call deltas). Text that may be the
        start of a call marker is held back."""
        ...

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: flush held-back text and the rest of any call."""
        ...

    @property
    def calls(self) -> list[ToolCall]:
        """The calls so far (after ``finish``: all of them, a truncated one included)."""
        ...

    @property
    def incomplete(self) -> bool:
        """After ``finish``: a call was opened but never closed or never parsed (e.g. cut by max_tokens)."""
        ...


class ToolFormat(Protocol):
    """A model family's tool-call format (Hermes, Llama 3, Mistral)."""

    name: str
    #: control-token strings that open or divide calls in this format; the parser reads the calls with or
    #: without them (the detokenizer drops control tokens), and reads more with them (calls after text)
    markers: tuple[str, ...]

    def preamble(self, plan: ToolPlan) -> str:
        """Text describing the tools, appended to (or used as) the system turn."""
        ...

    def grammar(self, plan: ToolPlan) -> str | None:
        """Lark source (llguidance dialect) constraining the whole output; None = unconstrained."""
        ...

    def parser(self, plan: ToolPlan) -> ToolParser:
        """A fresh streaming parser for one output."""
        ...

    def render_history(self, messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
        """Messages for a template that does not render tools itself (tool calls/results as text)."""
        ...


_FORMATS: dict[str, ToolFormat] = {}


def register_format(fmt: ToolFormat) -> None:
    """Make ``fmt`` available to ``tool_format`` under ``fmt.name``."""
    _FORMATS[fmt.name] = fmt


def tool_format(template_source: str | None) -> ToolFormat:
    """The tool-call format for a model whose chat template is ``template_source`` (None: no template),
    chosen by what the template writes for an assistant's call (checked in this order):

    1. ``"[TOOL_CALLS]"`` -> ``mistral-v11`` when it also writes ``"[ARGS]"`` (Mistral Small 3.2, Devstral,
       Ministral 3), else ``mistral`` (Mistral 7B v0.3, Nemo);
    2. ``"<tool_call>"`` -> ``hermes`` (Qwen2/2.5/3, Hermes 2/3 even on Llama 3, SmolLM3, Granite 4...);
    3. ``"<|start_header_id|>"`` and ``'"parameters"'`` -> ``llama3`` (Llama 3.1/3.2/3.3 Instruct);
    4. anything else, or no template -> ``hermes`` (the gateway writes the tools into the prompt itself when
       the template does not render them).

    The template is the model's own (GGUF ``tokenizer.chat_template``, ``chat_template.jinja`` or
    ``tokenizer_config.json``), so this is the choice by model metadata; the result is in ``docs/tools.md``.
    """
    src = template_source or ""
    if "[TOOL_CALLS]" in src:
        return _FORMATS["mistral-v11" if "[ARGS]" in src else "mistral"]
    if "<tool_call>" not in src and "<|start_header_id|>" in src and '"parameters"' in src:
        return _FORMATS["llama3"]
    return _FORMATS["hermes"]


def new_call_id() -> str:
    """A fresh OpenAI-style call id: ``"call_"`` + 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (0 if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


_DECODER = json.JSONDecoder()


def _skip_ws(text: str, i: int) -> int:
    """The first index at or after ``i`` that is not JSON whitespace."""
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def json_members(text: str) -> list[tuple[str, Any, int, int]] | None:
    """The members of the JSON object that ``text`` is (surrounding whitespace allowed), in order.

    Returns:
        ``[(key, value, start, end), ...]`` where ``text[start:end]`` is the value's raw JSON text; None when
        ``text`` is not exactly one JSON object, or nests too deeply for the decoder (``RecursionError`` is
        caught: this never raises).
    """
    i = _skip_ws(text, 0)
    if not text.startswith("{", i):
        return None
    members: list[tuple[str, Any, int, int]] = []
    i = _skip_ws(text, i + 1)
    if not text.startswith("}", i):
        while True:
            try:
                key, i = _DECODER.raw_decode(text, i)
                if not isinstance(key, str):
                    return None
                i = _skip_ws(text, i)
                if not text.startswith(":", i):
                    return None
                start = _skip_ws(text, i + 1)
                value, end = _DECODER.raw_decode(text, start)
            except (ValueError, RecursionError):
                return None
            members.append((key, value, start, end))
            i = _skip_ws(text, end)
            if text.startswith("}", i):
                break
            if not text.startswith(",", i):
                return None
            i = _skip_ws(text, i + 1)
    return members if not text[i + 1 :].strip(" \t\n\r") else None


class JsonValueEnd:
    """Finds where one JSON value ends in text that arrives piecewise.

    The value starts at ``start``; call ``scan(text, limit)`` with the text so far (it only grows). An object,
    array or string ends at its closing character; a number or literal at the first ``,}]`` or whitespace.
    Only the structure is tracked, nothing is validated.
    """

    def __init__(self, start: int) -> None:
        self.pos = start
        self.done = False
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._literal = False

    def scan(self, text: str, limit: int) -> int:
        """Scan ``text[pos:limit]``; return the end of the value seen so far (``pos``)."""
        i = self.pos
        while i < limit and not self.done:
            c = text[i]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                    self.done = self._depth == 0
            elif self._literal:
                if c in ",}] \t\n\r":
                    self.done = True
                    break
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                self.done = self._depth <= 0
            elif self._depth == 0:
                self._literal = True
            i += 1
        self.pos = i
        return i


class MarkerFinder:
    """Finds the first ``marker`` outside JSON strings in text that arrives piecewise (it only grows).

    ``pos`` is how far the search got: it stops before a possible partial marker at the end of the text.
    """

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.pos = 0
        self._in_str = False
        self._esc = False

    def find(self, text: str) -> int | None:
        """Index of the marker in ``text``, or None (yet)."""
        i, n, marker = self.pos, len(text), self.marker
        while i < n:
            c = text[i]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c == marker[0]:
                if text.startswith(marker, i):
                    self.pos = i
                    return i
                if n - i < len(marker) and marker.startswith(text[i:]):
                    break
            i += 1
        self.pos = i
        return None


class CallsOnly:
    """The parser of a forced call (``tool_choice`` "required" or named): its grammar allows calls only,
    so no text is content, not even the start of a call cut by ``max_tokens`` before its name."""

    def __init__(self, inner: ToolParser) -> None:
        self.inner = inner

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        return "", self.inner.feed(text)[1]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", self.inner.finish()[1]

    @property
    def calls(self) -> list[ToolCall]:
        return self.inner.calls

    @property
    def incomplete(self) -> bool:
        return self.inner.incomplete


class FirstCallOnly:
    """The parser of a request with ``parallel_tool_calls`` false whose format has no grammar to enforce it
    (Llama 3 and Mistral in mode ``auto``): calls after the first are dropped, deltas and all (OpenAI's
    "at most one call"); content is unchanged."""

    def __init__(self, inner: ToolParser) -> None:
        self.inner = inner

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.inner.feed(text)
        return content, [d for d in deltas if d.index == 0]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = self.inner.finish()
        return content, [d for d in deltas if d.index == 0]

    @property
    def calls(self) -> list[ToolCall]:
        return self.inner.calls[:1]

    @property
    def incomplete(self) -> bool:
        return self.inner.incomplete
