"""Matching tenant text without stalling anyone: RE2, off the event loop, on a time budget.

- Tenant-supplied patterns are compiled with RE2 (https://github.com/google/re2/wiki/Syntax) by
  :func:`compile_re2`: matching time linear in the text whatever the pattern (no backtracking, hence no
  backreferences or look-around), memory bounded by ``max_mem`` (:data:`RE2_MAX_MEM`).
- A hook runs its matching as ``await run_matching(fn, size)``: texts of more than :data:`INLINE_CHARS`
  characters are matched in a worker thread (RE2 releases the GIL while it matches, so the event loop
  keeps serving other requests), at most one thread per tenant and :data:`MATCH_THREADS` in all.
- The time is charged to the request's :class:`MatchBudget` (``http.filter_budget`` seconds: the prompt
  stage of a request, or one output step); :class:`MatchTimeout` when it runs out (the pipeline answers
  400 ``content_filter_timeout``).
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
from typing import Any, TypeVar

import re2
import trio

from gateway.slots import KeySlots

#: RE2's memory limit per compiled regex, in bytes (``re2.Options.max_mem``, RE2's own default): the
#: compiled program gets about two thirds of it, the lazily built DFA the rest (past it RE2 falls back
#: to its NFA: slower, still linear). A pattern set that does not fit is a ``ValueError`` (400).
RE2_MAX_MEM = 8 << 20
#: Texts of at most this many characters are matched on the event loop (well under a millisecond with
#: RE2); longer ones in a worker thread.
INLINE_CHARS = 4096
#: Worker threads matching at once, process-wide (one per core, at least two); one tenant has at most
#: one at a time, even counting matches whose request gave up (they keep their slot until they end).
MATCH_THREADS = max(2, os.cpu_count() or 2)
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


def compile_re2(pattern: str, *, case_sensitive: bool = True) -> Any:
    """``pattern`` compiled with RE2 (:func:`re2_options`); the result has ``search``, ``finditer``,
    ``programsize`` (str or UTF-8 bytes text; offsets in characters for str, bytes for bytes).

    Raises:
        ValueError: RE2 cannot compile it (its syntax error, a backreference, look-around, a
            program over ``max_mem``), with RE2's reason.
    """
    try:
        return re2.compile(pattern, re2_options(case_sensitive=case_sensitive))
    except re2.error as e:
        msg = e.args[0] if e.args else ""
        raise ValueError(msg.decode("utf-8", "replace") if isinstance(msg, bytes) else str(msg)) from None


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
    matches with ``escape`` in a str pattern (``"\\w"``: ``str.isalnum()`` or ``_``; ``"\\d"``: Unicode
    decimal digits), so that RE2 patterns keep ``re``'s Unicode semantics (RE2's own ``\\w``, ``\\d`` and
    ``\\b`` are ASCII-only). Built once per escape (~30 ms).
    """
    s = _all_chars()
    parts = []
    for m in re.finditer(escape + "+", s):
        a, b = ord(s[m.start()]), ord(s[m.end() - 1])
        parts.append(f"\\x{{{a:x}}}" if a == b else f"\\x{{{a:x}}}-\\x{{{b:x}}}")
    return "".join(parts)


_SLOTS: trio.lowlevel.RunVar[KeySlots] = trio.lowlevel.RunVar("filter_match_slots")


def _slots() -> KeySlots:
    if (s := _SLOTS.get(None)) is None:
        _SLOTS.set(s := KeySlots(MATCH_THREADS))
    return s


class MatchBudget:
    """Seconds of matching one request may still spend at one stage (prompt, or one output step).

    Args:
        seconds: the budget (``http.filter_budget``), > 0.
        key: whose thread slot large matches take (the tenant id; None: one shared key).

    Attributes:
        seconds: the whole budget. left: what is left (below 0 once an inline match overran it).
    """

    def __init__(self, seconds: float = DEFAULT_BUDGET, key: object = None) -> None:
        self.seconds = seconds
        self.left = seconds
        self.key = key

    async def run(self, fn: Callable[[float], T], size: int) -> T:
        """``fn(deadline)`` (``deadline``: a ``time.monotonic()`` value; a long Python loop in ``fn``
        should raise :class:`MatchTimeout` past it), charged to this budget.

        ``size`` (characters of text ``fn`` looks at) <= :data:`INLINE_CHARS`: called on the event loop;
        else in a worker thread (waiting for the tenant's slot counts against the budget), abandoned
        when the budget runs out (RE2 cannot be interrupted; its matching is linear in the text).

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
                limiter = _slots().bind(self.key)
                with trio.move_on_after(self.left):
                    return await trio.to_thread.run_sync(
                        fn, deadline, limiter=limiter, abandon_on_cancel=True
                    )
                limiter.abandon()
                raise MatchTimeout
        finally:
            self.left -= time.monotonic() - t0
        if self.left < 0:
            raise MatchTimeout
        return out


_BUDGET: ContextVar[MatchBudget | None] = ContextVar("filter_match_budget", default=None)


@contextlib.contextmanager
def using_budget(budget: MatchBudget) -> Iterator[MatchBudget]:
    """Within the block, :func:`run_matching` in this task charges ``budget``."""
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


async def run_matching(fn: Callable[[float], T], size: int) -> T:
    """``fn(deadline)`` charged to the budget of the stage being filtered in this task (set by the
    pipeline with :func:`using_budget`; a fresh default one outside it). See :meth:`MatchBudget.run`.

    Raises:
        MatchTimeout: the request's matching budget ran out.
    """
    return await (_BUDGET.get() or MatchBudget()).run(fn, size)
