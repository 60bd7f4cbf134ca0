"""Built-in hook ``"blocklist"``: regular expressions and keywords that block a prompt or cut the output.

Config members (besides ``type``, ``name``, ``stages``, ``roles``)::

    "keywords": ["word", "two words"],   # literal, matched as whole words (no letter/digit/_ either side)
    "patterns": ["b[o0]mb\\\\w*"],         # Python ``re`` syntax, searched anywhere
    "case_sensitive": false,             # default false (re.IGNORECASE)
    "category": "blocklist"              # reported category

Limits (tenant-supplied regexes run on our CPU): at most 256 entries, each at most 256 characters.
Python's ``re`` has no timeout, so the output side only ever scans a bounded window
(``2 * window`` + one chunk of characters).
"""

from __future__ import annotations

import re
from typing import Any

from .base import Hook, OutputChunk, OutputCut, OutputScanner, PromptBlocked, iter_texts

MAX_ENTRIES = 256
MAX_ENTRY_LEN = 256
_CAT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _str_list(params: dict[str, Any], key: str) -> list[str]:
    v = params.pop(key, [])
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise ValueError(f"blocklist: {key!r} must be a list of non-empty strings")
    if any(len(s) > MAX_ENTRY_LEN for s in v):
        raise ValueError(f"blocklist: each of {key!r} must be at most {MAX_ENTRY_LEN} characters")
    return v


def compile_blocklist(
    keywords: list[str], patterns: list[str], case_sensitive: bool
) -> re.Pattern[str] | None:
    """One alternation regex for all entries, or None when both lists are empty.

    Raises:
        ValueError: a pattern that does not compile (``re.error`` text included).
    """
    alts = [r"(?<!\w)" + re.escape(k) + r"(?!\w)" for k in keywords]
    for p in patterns:
        try:
            re.compile(p)
        except re.error as e:
            raise ValueError(f"blocklist: bad regex {p!r}: {e}") from None
        alts.append("(?:" + p + ")")
    if not alts:
        return None
    return re.compile("|".join(alts), 0 if case_sensitive else re.IGNORECASE)


class BlocklistHook(Hook):
    """Blocks prompts / cuts output that match any keyword or regex (see module doc for config)."""

    type = "blocklist"

    @classmethod
    def validate(cls, params: dict[str, Any]) -> dict[str, Any]:
        params = dict(params)
        keywords = _str_list(params, "keywords")
        patterns = _str_list(params, "patterns")
        if len(keywords) + len(patterns) > MAX_ENTRIES:
            raise ValueError(f"blocklist: at most {MAX_ENTRIES} keywords + patterns")
        cs = params.pop("case_sensitive", False)
        if not isinstance(cs, bool):
            raise ValueError("blocklist: 'case_sensitive' must be a boolean")
        cat = params.pop("category", "blocklist")
        if not isinstance(cat, str) or not _CAT_RE.match(cat):
            raise ValueError("blocklist: 'category' must match [A-Za-z0-9_.-]{1,64}")
        if params:
            raise ValueError(f"blocklist: unknown members {sorted(params)}")
        if not keywords and not patterns:
            raise ValueError("blocklist: give at least one of 'keywords' or 'patterns'")
        compile_blocklist(keywords, patterns, cs)
        return {"keywords": keywords, "patterns": patterns, "case_sensitive": cs, "category": cat}

    def __init__(self, name, stages, roles, *, keywords, patterns, case_sensitive, category) -> None:
        super().__init__(name, stages, roles)
        self.category = category
        self.regex = compile_blocklist(keywords, patterns, case_sensitive)

    async def check_prompt(self, tenant_id, messages):
        for _role, text in iter_texts(messages, self.roles):
            if self.regex.search(text):
                raise PromptBlocked(self.category, "blocklist match")
        return None

    def output_scanner(self, tenant_id=None):
        return _BlocklistScanner(self.regex, self.category)


class _BlocklistScanner(OutputScanner):
    """Cuts at the first *conclusive* match that reaches into the pending text.

    A match is conclusive when text follows it (so a trailing ``(?!\\w)`` cannot change), when it
    starts in the part about to be released, or when the stream has ended. A match of at most
    ``window`` characters is therefore always caught before any of it is sent.
    """

    def __init__(self, regex: re.Pattern[str], category: str) -> None:
        self.regex = regex
        self.category = category

    async def scan(self, chunk: OutputChunk) -> OutputChunk | OutputCut:
        ctx = chunk.context
        text = ctx + chunk.pending
        n = len(ctx)
        for m in self.regex.finditer(text):
            if m.end() <= n or m.end() == m.start():
                continue  # entirely in already-sent text (judged before), or an empty match
            start = m.start() - n
            if m.end() < len(text) or start < chunk.release or chunk.final:
                return OutputCut(max(0, start), self.category)
        return chunk
