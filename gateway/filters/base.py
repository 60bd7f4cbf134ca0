"""The hook interface: two points where a content filter can act.

1. **Before scheduling** (``Hook.check_prompt``): sees the tenant id and the request's
   ``messages`` (OpenAI chat format) before the prompt is templated, tokenized or sent to the
   backend. It may *allow* (return ``None``), *rewrite* (return a new messages list, e.g. with
   redactions; never mutate the input) or *block* (raise :class:`PromptBlocked`).
2. **On the output stream** (``Hook.output_scanner`` -> :class:`OutputScanner`): one scanner per
   choice per request. It sees the generated text in windows (:class:`OutputChunk`) before any of
   it is sent, and may pass it on (possibly rewritten, e.g. redacted) or cut the stream
   (return :class:`OutputCut`).

Units: every length and index here is in Python ``str`` characters (Unicode code points), not
tokens or bytes.

Semantics follow Azure OpenAI content filtering
(https://learn.microsoft.com/azure/ai-services/openai/concepts/content-filter): a blocked prompt is
a 400 with code ``content_filter``; a cut output ends with ``finish_reason: "content_filter"``.

Matching (the end of this module): tenant-supplied patterns are compiled with RE2
(https://github.com/google/re2/wiki/Syntax: linear-time matching, no backreferences or look-around) by
:func:`compile_re2`, and a hook does its matching through :func:`run_matching`, which runs large texts in a
worker thread (RE2 releases the GIL while it matches) and charges the time to the request's
:class:`MatchBudget` (``http.filter_budget`` seconds per stage); :class:`MatchTimeout` when it runs out.
"""

from __future__ import annotations

import array
import contextlib
import functools
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar

import re2
import trio

#: The two hook points, as named in config ``"stages"``.
STAGES = ("prompt", "output")

#: Message roles a hook looks at unless configured otherwise.
ALL_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class PromptBlocked(Exception):
    """Raised by ``Hook.check_prompt`` to block a request.

    Args:
        category: short machine-readable category, e.g. ``"blocklist"``, ``"pii"``, ``"violence"``.
            It becomes the key of ``innererror.content_filter_result`` in the 400 response.
        detail: optional extra text for logs only; it is never sent to the client (it could quote
            the prompt).
    """

    def __init__(self, category: str, detail: str = "") -> None:
        super().__init__(category)
        self.category = category
        self.detail = detail


@dataclass(frozen=True)
class OutputChunk:
    """The text an output scanner is asked about, in characters.

    Attributes:
        context: up to ``window`` characters already sent to the client, read-only (for regex
            look-behind and word boundaries across the release point).
        pending: text not yet sent (possibly already rewritten by earlier hooks in the list).
        release: how many leading characters of ``pending`` the filter means to send after this
            call (``0 <= release <= len(pending)``). A scanner may raise it (e.g. to send a whole
            redaction placeholder); the filter never holds back more than ``window`` characters.
        final: True when the stream has ended (``flush``): everything left is released, so matches
            touching the end of ``pending`` are conclusive.
        offset: characters sent to the client before ``pending[0]`` (absolute position).
        tenant_id: the tenant the request belongs to, or None.
    """

    context: str
    pending: str
    release: int
    final: bool
    offset: int
    tenant_id: str | None = None

    def with_pending(self, pending: str, release: int) -> OutputChunk:
        """A copy with rewritten ``pending`` and ``release`` (clamped to ``[0, len(pending)]``)."""
        return replace(self, pending=pending, release=max(0, min(release, len(pending))))


@dataclass(frozen=True)
class OutputCut:
    """Returned by a scanner to cut the stream.

    Attributes:
        at: index into the ``pending`` the scanner was given; ``pending[:at]`` may still be sent
            (after being re-checked by every output hook as final text); nothing from ``at`` on is
            ever sent, nor anything generated later.
        category: category of the violation (key of ``content_filter_results``).
    """

    at: int
    category: str


class OutputScanner:
    """Per-stream state of one hook on the output stream. Override :meth:`scan`."""

    async def scan(self, chunk: OutputChunk) -> OutputChunk | OutputCut:
        """Look at ``chunk``; return it (maybe rewritten via ``chunk.with_pending``) or an ``OutputCut``."""
        return chunk


class Hook:
    """Base class of every filter hook.

    Subclasses set ``type`` (the config ``"type"`` string), implement :meth:`validate` (config
    checking, raising ``ValueError``) and override :meth:`check_prompt` and/or
    :meth:`output_scanner`. A hook instance is shared by all requests of the tenants whose config
    built it, so it must keep no per-request state outside the scanners it returns.

    Attributes:
        name: the hook's name from config (defaults to its type); reported in filter results.
        stages: subset of ``{"prompt", "output"}`` where it runs.
        roles: message roles it inspects on the prompt side.
    """

    type: ClassVar[str] = ""
    #: Stages a hook of this type supports (a config may choose a subset).
    supported_stages: ClassVar[tuple[str, ...]] = STAGES

    def __init__(
        self, name: str, stages: tuple[str, ...], roles: tuple[str, ...] = ALL_ROLES, **params: Any
    ) -> None:
        self.name = name
        self.stages = frozenset(stages)
        self.roles = frozenset(roles)
        self.params = params

    @classmethod
    def validate(cls, params: dict[str, Any]) -> dict[str, Any]:
        """Check the type-specific config members; return them normalized (JSON-serialisable).

        Raises:
            ValueError: on any unknown member, wrong type or out-of-range value.
        """
        if params:
            raise ValueError(f"hook type {cls.type!r}: unknown members {sorted(params)}")
        return {}

    async def check_prompt(
        self, tenant_id: str | None, messages: list[dict[str, Any]]
    ) -> list[dict[str, Any]] | None:
        """Before-scheduling point. Return None to allow, a new list to rewrite; raise PromptBlocked to block."""
        return None

    def output_scanner(self, tenant_id: str | None = None) -> OutputScanner | None:
        """A fresh scanner for one output stream, or None if this hook does not scan output."""
        return None


# ---------------------------------------------------------------- message text helpers


def iter_texts(messages: list[dict[str, Any]], roles: frozenset[str] | None = None):
    """Yield ``(role, text)`` for every text segment: string contents and ``{"type":"text"}`` parts."""
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if roles is not None and role not in roles:
            continue
        c = m.get("content")
        if isinstance(c, str):
            yield role, c
        elif isinstance(c, list):
            for part in c:
                if (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    yield role, part["text"]


def map_texts(
    messages: list[dict[str, Any]], fn, roles: frozenset[str] | None = None
) -> list[dict[str, Any]] | None:
    """Apply ``fn(text) -> text`` to every text segment; return a new list, or None if nothing changed.

    The input is never mutated: changed messages (and their part lists) are shallow-copied.
    """
    out: list[dict[str, Any]] = []
    changed = False
    for m in messages:
        if not isinstance(m, dict) or (roles is not None and m.get("role") not in roles):
            out.append(m)
            continue
        c = m.get("content")
        if isinstance(c, str):
            n = fn(c)
            if n != c:
                m = {**m, "content": n}
                changed = True
        elif isinstance(c, list):
            parts = []
            pchanged = False
            for part in c:
                if (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    n = fn(part["text"])
                    if n != part["text"]:
                        part = {**part, "text": n}
                        pchanged = True
                parts.append(part)
            if pchanged:
                m = {**m, "content": parts}
                changed = True
        out.append(m)
    return out if changed else None


# ---------------------------------------------------------------- matching: RE2, off the event loop, on a budget

#: RE2's memory limit per compiled regex, in bytes (``re2.Options.max_mem``, RE2's own default): the
#: compiled program gets about two thirds of it, the lazily built DFA the rest (past it RE2 falls back
#: to its NFA: slower, still linear). A pattern set that does not fit is a ``ValueError`` (400).
RE2_MAX_MEM = 8 << 20
#: Texts of at most this many characters are matched on the event loop (well under a millisecond with
#: RE2); longer ones in a worker thread.
INLINE_CHARS = 4096
#: Worker threads matching at once, process-wide (half the cores, at least one): a tenant cannot take
#: more CPU than this away from the inference backend, even with matches whose request gave up.
MATCH_THREADS = max(1, (os.cpu_count() or 2) // 2)
#: Seconds of matching per request and stage when the caller gives none (``http.filter_budget``'s default).
DEFAULT_BUDGET = 1.0

T = TypeVar("T")


class MatchTimeout(Exception):
    """The request's matching budget (:class:`MatchBudget`) ran out; the pipeline turns it into a 400
    with code ``content_filter_timeout``."""


def re2_options(*, case_sensitive: bool = True) -> re2.Options:
    """RE2 options for tenant patterns: UTF-8, ``max_mem`` = :data:`RE2_MAX_MEM`, errors not logged."""
    o = re2.Options()
    o.max_mem = RE2_MAX_MEM
    o.log_errors = False
    o.case_sensitive = case_sensitive
    return o


def re2_error(exc: re2.error) -> str:
    """RE2's error text (the binding gives it as bytes)."""
    msg = exc.args[0] if exc.args else ""
    return msg.decode("utf-8", "replace") if isinstance(msg, bytes) else str(msg)


def compile_re2(pattern: str, *, case_sensitive: bool = True) -> Any:
    """``pattern`` compiled with RE2 (:func:`re2_options`); the result has ``search`` and ``finditer``
    like ``re.Pattern`` (str or UTF-8 bytes text; offsets in characters for str, bytes for bytes).

    Raises:
        ValueError: RE2 cannot compile it (its syntax error, a backreference, look-around, a
            program over ``max_mem``), with RE2's reason.
    """
    try:
        return re2.compile(pattern, re2_options(case_sensitive=case_sensitive))
    except re2.error as e:
        raise ValueError(re2_error(e)) from None


_SURROGATE = re.compile("[\ud800-\udfff]")


def matchable(text: str) -> str:
    """``text`` with each lone surrogate (the stdlib ``json`` lets ``"\\ud800"`` through) replaced by
    U+FFFD, one character for one (offsets do not move), so that it encodes to UTF-8 for RE2. Like the
    surrogate, U+FFFD is no word character and no digit."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


@functools.cache
def _all_chars() -> str:
    cps = array.array("I", range(0xD800))
    cps.extend(range(0xE000, 0x110000))
    return cps.tobytes().decode("utf-32-le" if sys.byteorder == "little" else "utf-32-be")


@functools.cache
def py_class(escape: str) -> str:
    """The body of an RE2 character class (``[...]``) holding exactly the code points Python's ``re``
    matches with ``escape`` in a str pattern (e.g. ``"\\w"``: ``str.isalnum()`` or ``_``;
    ``"\\d"``: Unicode decimal digits), so that RE2 patterns keep ``re``'s Unicode semantics
    (RE2's own ``\\w``, ``\\d`` and ``\\b`` are ASCII-only). Built once per escape (~30 ms).
    """
    s = _all_chars()
    parts = []
    for m in re.finditer(escape + "+", s):
        a, b = ord(s[m.start()]), ord(s[m.end() - 1])
        parts.append(f"\\x{{{a:x}}}" if a == b else f"\\x{{{a:x}}}-\\x{{{b:x}}}")
    return "".join(parts)


_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("filter_match_threads")


def _thread_limiter() -> trio.CapacityLimiter:
    if (lim := _LIMITER.get(None)) is None:
        _LIMITER.set(lim := trio.CapacityLimiter(MATCH_THREADS))
    return lim


class MatchBudget:
    """Seconds of matching one request may still spend at one stage (prompt, or one output choice).

    Args:
        seconds: the budget (``http.filter_budget``), > 0.

    Attributes:
        seconds: the whole budget. left: what is left (may go below 0 by the last inline match).
    """

    def __init__(self, seconds: float = DEFAULT_BUDGET) -> None:
        self.seconds = seconds
        self.left = seconds

    async def run(self, fn: Callable[[float], T], size: int) -> T:
        """``fn(deadline)`` (``deadline``: a ``time.monotonic()`` value; a long Python loop in ``fn``
        should raise :class:`MatchTimeout` past it), charged to this budget.

        ``size`` (characters of text ``fn`` looks at) <= :data:`INLINE_CHARS`: called on the event loop;
        else in a worker thread (at most :data:`MATCH_THREADS` at once), abandoned when the budget runs
        out (RE2 cannot be interrupted; its matching is linear in the text and releases the GIL).

        Raises:
            MatchTimeout: the budget ran out (before, during or by this call).
            Whatever ``fn`` raises.
        """
        if self.left <= 0:
            raise MatchTimeout
        t0 = time.monotonic()
        deadline = t0 + self.left
        try:
            if size <= INLINE_CHARS:
                out = fn(deadline)
            else:
                with trio.move_on_after(self.left):
                    return await trio.to_thread.run_sync(
                        fn, deadline, limiter=_thread_limiter(), abandon_on_cancel=True
                    )
                raise MatchTimeout
        finally:
            self.left -= time.monotonic() - t0
        if self.left < 0:
            raise MatchTimeout
        return out


_BUDGET: ContextVar[MatchBudget | None] = ContextVar("filter_match_budget", default=None)


def current_budget() -> MatchBudget:
    """The budget of the stage being filtered in this task (set by the pipeline), else a fresh default one."""
    return _BUDGET.get() or MatchBudget()


@contextlib.contextmanager
def using_budget(budget: MatchBudget) -> Iterator[MatchBudget]:
    """Within the block, :func:`run_matching` in this task charges ``budget``."""
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


async def run_matching(fn: Callable[[float], T], size: int) -> T:
    """``await current_budget().run(fn, size)``: how a hook runs its matching (see :meth:`MatchBudget.run`).

    Raises:
        MatchTimeout: the request's matching budget ran out.
    """
    return await current_budget().run(fn, size)
