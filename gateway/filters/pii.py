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
"""

from __future__ import annotations

import re
from typing import Any

from .base import Hook, OutputChunk, OutputCut, OutputScanner, PromptBlocked, iter_texts, map_texts

KINDS = ("email", "phone", "card")

_EMAIL = r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}[A-Za-z0-9])?)*\.[A-Za-z]{2,24}(?![A-Za-z0-9-])"
# No digit (nor digit + "." / "-") on either side, so parts of longer digit runs never match
# (a space does separate items: "555-123-4567 4111111111111111" is a phone and a card).
_NOD_L = r"(?<!\d)(?<!\d[.-])"
_NOD_R = r"(?![.-]?\d)"
_CARD = _NOD_L + r"\d(?:[ -]?\d){12,18}" + _NOD_R
_PHONE = (
    _NOD_L.replace(r"(?<!\d)", r"(?<![\d+])")
    + r"(?:"
    + r"(?:\+?1[ .-]?)?(?:\(\d{3}\)[ .-]?|\d{3}[ .-]?)\d{3}[ .-]?\d{4}"
    + r"|\+[1-9]\d{0,2}(?:[ .-]?\(?\d{1,4}\)?){2,5}"
    + r")"
    + _NOD_R
)
_ALL = re.compile(f"(?P<email>{_EMAIL})|(?P<card>{_CARD})|(?P<phone>{_PHONE})")


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


def find_pii(text: str, kinds: frozenset[str]):
    """Yield ``(start, end, kind)`` for every PII item of the wanted kinds, left to right, non-overlapping.

    Card candidates that fail Luhn and phone candidates with a wrong digit count are skipped (the
    digit-boundary look-arounds keep their inner parts from matching). Indices are character offsets.
    """
    pos = 0
    while True:
        m = _ALL.search(text, pos)
        if m is None:
            return
        kind = m.lastgroup
        ok = True
        if kind == "card":
            digits = re.sub(r"\D", "", m.group())
            ok = 13 <= len(digits) <= 19 and luhn_ok(digits)
        elif kind == "phone":
            ok = 7 <= sum(c.isdigit() for c in m.group()) <= 15
        if not ok:  # a rejected candidate does not hide a shorter item inside it: scan on from the next char
            pos = m.start() + 1
            continue
        pos = m.end()
        if kind in kinds:
            yield m.start(), m.end(), kind


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

    def redact(self, text: str) -> str:
        """``text`` with every PII item replaced by its placeholder."""
        out, last = [], 0
        for s, e, kind in find_pii(text, self.kinds):
            out.append(text[last:s])
            out.append(self.placeholder(kind))
            last = e
        if not out:
            return text
        out.append(text[last:])
        return "".join(out)

    async def check_prompt(self, tenant_id, messages):
        if self.action == "block":
            for _role, text in iter_texts(messages, self.roles):
                for _s, _e, _kind in find_pii(text, self.kinds):
                    raise PromptBlocked("pii", "pii found")
            return None
        return map_texts(messages, self.redact, self.roles)

    def output_scanner(self, tenant_id=None):
        return _PIIScanner(self)


class _PIIScanner(OutputScanner):
    def __init__(self, hook: PIIHook) -> None:
        self.hook = hook

    async def scan(self, chunk: OutputChunk) -> OutputChunk | OutputCut:
        pending, release = chunk.pending, chunk.release
        n = len(chunk.context)
        out: list[str] = []
        last = 0
        delta = 0  # length change of replacements that end at or before the release point
        inside: int | None = None  # new release point when it falls inside a replaced item
        for s, e, kind in find_pii(chunk.context + pending, self.hook.kinds):
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
