"""Built-in hook ``"pii"``: redact (or block) e-mail addresses, phone numbers and payment card numbers.

Config members (besides ``type``, ``name``, ``stages``, ``roles``)::

    "kinds": ["email", "phone", "card"],   # default: all three
    "action": "redact",                     # or "block" (prompt: 400; output: cut), category "pii"
    "replacement": "[{KIND}]"               # {KIND} -> EMAIL / PHONE / CARD, {kind} -> email / ...

Detection (deliberately conservative, documented in docs/filters.md):

- ``email``: ``local@domain.tld`` (RFC 5322 "dot-atom" subset: letters, digits, ``._%+-`` in the
  local part, labels of letters/digits/``-``, a TLD of 2+ letters).
- ``card``: 13 to 19 digits, optionally grouped by single spaces or hyphens, not touching other
  digits (no digit or digit+``.``/``-`` on either side), **and passing the Luhn check** (ISO/IEC 7812-1 Annex B). A Luhn-invalid digit run is
  left alone (and is not treated as a phone number either).
- ``phone``: North-American ``(555) 123-4567`` / ``555-123-4567`` / ``555.123.4567`` /
  ``5551234567`` with optional ``+1``, or international ``+CC`` followed by 6-14 more digits in
  groups (E.164: at most 15 digits). Not touching other digits.

On the output stream, a match is redacted once it starts in the part about to be released (so it
has at least ``window`` characters of right context and cannot still grow) or when the stream ends;
a PII item of at most ``window`` characters is therefore never sent unredacted.

Matching is linear in the text: the patterns run on RE2 (UTF-8 bytes, ``matching.compile_re2``), with
Python ``re``'s Unicode ``\\d``; the digit-boundary look-behinds, which RE2 lacks, are checked in
Python at each candidate, and each look-ahead is matched as one or two more characters after the
item (outside its group), which gives the spans the look-around patterns give (the test suite
compares both on random texts). :func:`find_pii` stops past a deadline (``matching.MatchTimeout``), and
the hook runs it through ``matching.run_matching`` (a worker thread for long texts, within the request's
matching budget).
"""

from __future__ import annotations

import re
import time
from typing import Any

from .base import Hook, OutputChunk, OutputCut, OutputScanner, PromptBlocked, iter_texts, map_texts
from .matching import MatchTimeout, compile_re2, matchable, py_class, run_matching

KINDS = ("email", "phone", "card")

#: The same items as these look-around patterns (Python ``re``), which define them:
#:   email  [A-Za-z0-9._%+-]{1,64}@LABEL(?:\.LABEL)*\.[A-Za-z]{2,24}(?![A-Za-z0-9-])
#:          with LABEL = [A-Za-z0-9](?:[A-Za-z0-9-]{0,62}[A-Za-z0-9])?
#:   card   (?<!\d)(?<!\d[.-])\d(?:[ -]?\d){12,18}(?![.-]?\d)
#:   phone  (?<![\d+])(?<!\d[.-])(?:(?:\+?1[ .-]?)?(?:\(\d{3}\)[ .-]?|\d{3}[ .-]?)\d{3}[ .-]?\d{4}
#:          |\+[1-9]\d{0,2}(?:[ .-]?\(?\d{1,4}\)?){2,5})(?![.-]?\d)
#: No digit (nor digit + "." / "-") on either side, so parts of longer digit runs never match
#: (a space does separate items: "555-123-4567 4111111111111111" is a phone and a card).
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9\-]{0,62}[A-Za-z0-9])?"
_EMAIL = r"[A-Za-z0-9._%+\-]{1,64}@" + _LABEL + r"(?:\." + _LABEL + r")*\.[A-Za-z]{2,24}"


def _build():
    d = py_class(r"\d")
    D = f"[{d}]"
    email_tail = r"(?:[^A-Za-z0-9\-]|$)"  # (?![A-Za-z0-9-])
    num_tail = rf"(?:$|[^.\-{d}]|[.\-]$|[.\-][^{d}])"  # (?![.-]?\d)
    card = rf"{D}(?:[ \-]?{D}){{12,18}}"
    phone = (
        rf"(?:(?:\+?1[ .\-]?)?(?:\({D}{{3}}\)[ .\-]?|{D}{{3}}[ .\-]?){D}{{3}}[ .\-]?{D}{{4}}"
        rf"|\+[1-9]{D}{{0,2}}(?:[ .\-]?\(?{D}{{1,4}}\)?){{2,5}})"
    )
    # Groups 1, 2, 3: the item itself (the tails are the look-aheads, matched and left out).
    return compile_re2(f"({_EMAIL}){email_tail}|({card}){num_tail}|({phone}){num_tail}")


_ALL: Any = None
_KIND_OF = {1: "email", 2: "card", 3: "phone"}


def _regex() -> Any:
    global _ALL
    if _ALL is None:
        _ALL = _build()
    return _ALL


def _char_before(b: bytes, i: int) -> tuple[str, int]:
    """The character that ends at byte ``i`` of UTF-8 ``b`` and the byte it starts at (``("", 0)`` at 0)."""
    if i <= 0:
        return "", 0
    j = i - 1
    while j > 0 and 0x80 <= b[j] < 0xC0:
        j -= 1
    return b[j:i].decode("utf-8"), j


def _lookbehind_ok(b: bytes, s: int, kind: str) -> bool:
    r"""``(?<!\d)(?<!\d[.-])`` (card) / ``(?<![\d+])(?<!\d[.-])`` (phone) at byte ``s``."""
    c1, j = _char_before(b, s)
    if c1 and (c1.isdecimal() or (kind == "phone" and c1 == "+")):
        return False
    if c1 in (".", "-"):
        c2, _ = _char_before(b, j)
        return not c2.isdecimal()
    return True


def luhn_ok(digits: str) -> bool:
    """Luhn (mod 10) check of a string of ASCII digits; False for non-digits or empty input."""
    if not digits or not digits.isdigit():
        return False
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def find_pii(text: str, kinds: frozenset[str], deadline: float | None = None):
    """Yield ``(start, end, kind)`` for every PII item of the wanted kinds, left to right, non-overlapping.

    Card candidates that fail Luhn and phone candidates with a wrong digit count are skipped (the
    digit-boundary look-arounds keep their inner parts from matching); a rejected candidate does not
    hide a shorter item inside it: the scan goes on from its next character. Indices are character
    offsets into ``text``. Time linear in ``len(text)`` per candidate found (RE2), and candidates never
    overlap more than their own length.

    Raises:
        MatchTimeout: ``time.monotonic()`` passed ``deadline`` (checked at every candidate).
    """
    text = matchable(text)
    ascii_ = text.isascii()
    b = text.encode("utf-8")
    rx = _regex()
    pos = 0
    last_b = last_c = 0  # the character offset of byte last_b (items come left to right)
    while True:
        if deadline is not None and time.monotonic() > deadline:
            raise MatchTimeout
        m = rx.search(b, pos)
        if m is None:
            return
        g = next(g for g in (1, 2, 3) if m.start(g) >= 0)
        s, e = m.span(g)
        kind = _KIND_OF[g]
        ok = kind == "email" or _lookbehind_ok(b, s, kind)
        if ok and kind == "card":
            digits = re.sub(r"\D", "", b[s:e].decode("utf-8"))
            ok = 13 <= len(digits) <= 19 and luhn_ok(digits)
        elif ok and kind == "phone":
            ok = 7 <= sum(c.isdigit() for c in b[s:e].decode("utf-8")) <= 15
        if not ok:  # scan on from the candidate's next character
            pos = s + 1
            while pos < len(b) and 0x80 <= b[pos] < 0xC0:
                pos += 1
            continue
        pos = e
        if kind in kinds:
            if ascii_:
                yield s, e, kind
            else:
                cs = last_c + len(b[last_b:s].decode("utf-8"))
                ce = cs + len(b[s:e].decode("utf-8"))
                last_b, last_c = e, ce
                yield cs, ce, kind


class PIIHook(Hook):
    """Redacts or blocks PII in prompts and/or output (see module doc)."""

    type = "pii"

    @classmethod
    def validate(cls, params: dict[str, Any]) -> dict[str, Any]:
        params = dict(params)
        kinds = params.pop("kinds", list(KINDS))
        if not isinstance(kinds, list) or not kinds or any(k not in KINDS for k in kinds):
            raise ValueError(f"pii: 'kinds' must be a non-empty list drawn from {list(KINDS)}")
        action = params.pop("action", "redact")
        if action not in ("redact", "block"):
            raise ValueError("pii: 'action' must be 'redact' or 'block'")
        rep = params.pop("replacement", "[{KIND}]")
        if not isinstance(rep, str) or len(rep) > 64:
            raise ValueError("pii: 'replacement' must be a string of at most 64 characters")
        try:
            rep.format(KIND="X", kind="x")
        except (KeyError, IndexError, ValueError):
            raise ValueError("pii: 'replacement' may only use the fields {KIND} and {kind}") from None
        if params:
            raise ValueError(f"pii: unknown members {sorted(params)}")
        return {"kinds": list(dict.fromkeys(kinds)), "action": action, "replacement": rep}

    def __init__(self, name, stages, roles, *, kinds, action, replacement) -> None:
        super().__init__(name, stages, roles)
        self.kinds = frozenset(kinds)
        self.action = action
        self.replacement = replacement

    def placeholder(self, kind: str) -> str:
        return self.replacement.format(KIND=kind.upper(), kind=kind)

    def redact(self, text: str, deadline: float | None = None) -> str:
        """``text`` with every PII item replaced by its placeholder.

        Raises:
            MatchTimeout: past ``deadline`` (``time.monotonic()``).
        """
        out, last = [], 0
        for s, e, kind in find_pii(text, self.kinds, deadline):
            out.append(text[last:s])
            out.append(self.placeholder(kind))
            last = e
        if not out:
            return text
        out.append(text[last:])
        return "".join(out)

    async def check_prompt(self, tenant_id, messages):
        """Redacts (a new list) or blocks (PromptBlocked); ``matching.MatchTimeout`` past the request's budget."""
        size = sum(len(t) for _role, t in iter_texts(messages, self.roles))
        if self.action == "block":

            def found(deadline: float) -> bool:
                return any(
                    next(find_pii(t, self.kinds, deadline), None) is not None
                    for _role, t in iter_texts(messages, self.roles)
                )

            if await run_matching(found, size):
                raise PromptBlocked("pii", "pii found")
            return None
        return await run_matching(
            lambda deadline: map_texts(messages, lambda t: self.redact(t, deadline), self.roles), size
        )

    def output_scanner(self, tenant_id=None):
        return _PIIScanner(self)


class _PIIScanner(OutputScanner):
    def __init__(self, hook: PIIHook) -> None:
        self.hook = hook

    async def scan(self, chunk: OutputChunk) -> OutputChunk | OutputCut:
        return await run_matching(
            lambda deadline: self._scan(chunk, deadline), len(chunk.context) + len(chunk.pending)
        )

    def _scan(self, chunk: OutputChunk, deadline: float) -> OutputChunk | OutputCut:
        pending, release = chunk.pending, chunk.release
        n = len(chunk.context)
        out: list[str] = []
        last = 0
        delta = 0  # length change of replacements that end at or before the release point
        inside: int | None = None  # new release point when it falls inside a replaced item
        for s, e, kind in find_pii(chunk.context + pending, self.hook.kinds, deadline):
            if e <= n:
                continue  # entirely in already-sent text
            s, e = max(0, s - n), e - n
            if not (chunk.final or s < release):
                break  # starts in the held-back tail: it may still grow; judge it later
            if self.hook.action == "block":
                return OutputCut(s, "pii")
            ph = self.hook.placeholder(kind)
            out.append(pending[last:s])
            out.append(ph)
            last = e
            if e <= release:
                delta += len(ph) - (e - s)
            elif s < release:
                inside = sum(map(len, out))
        if not out:
            return chunk
        out.append(pending[last:])
        new_pending = "".join(out)
        if chunk.final:
            return chunk.with_pending(new_pending, len(new_pending))
        return chunk.with_pending(new_pending, inside if inside is not None else release + delta)
