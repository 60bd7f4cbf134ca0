"""Built-in hook ``"blocklist"``: regular expressions and keywords that block a prompt or cut the output.

Config members (besides ``type``, ``name``, ``stages``, ``roles``)::

    "keywords": ["word", "two words"],   # literal, matched as whole words (no letter/digit/_ either side)
    "patterns": ["b[o0]mb\\\\w*"],         # RE2 syntax (https://github.com/google/re2/wiki/Syntax)
    "case_sensitive": false,             # default false (Unicode simple case folding)
    "category": "blocklist"              # reported category

Tenant-supplied regexes run on our CPU, so they are compiled with RE2, whose matching is linear in the
text (no backtracking: ``(a+)+$`` costs what ``a+$`` does). RE2 has no backreferences and no
look-around; a pattern RE2 cannot compile is a ``ValueError`` (the admin API's 400) naming it. Limits: at
most 256 entries, each at most 256 characters, and the compiled set within RE2's ``max_mem``
(``matching.RE2_MAX_MEM``). Matching goes through ``matching.run_matching``: off the event loop for large texts,
within the request's time budget.

Keywords are whole words as Python's ``re`` sees them (``(?<!\\w)keyword(?!\\w)``, Unicode ``\\w``), without
look-around: the keyword alternation is matched with one neighbour character on each side that is not
a word character (``matching.py_class("\\\\w")``), on the text padded with a newline at both ends.
"""

from __future__ import annotations

import re
from typing import Any

import re2

from .base import Hook, OutputChunk, OutputCut, OutputScanner, PromptBlocked, iter_texts
from .matching import compile_re2, matchable, py_class, run_matching

MAX_ENTRIES = 256
MAX_ENTRY_LEN = 256
#: Most RE2 program instructions the patterns of one hook may compile to, summed over the patterns
#: (compile time is about linear in it: ~0.1 s at the limit). 256 patterns of 256 plain characters
#: fit; ``\pL{200}`` alone takes ~240,000 (a Unicode class repeated 200 times).
MAX_PROGRAM_SIZE = 1 << 18
_CAT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: The padding around a text searched for keywords: one non-word character each side.
_PAD = "\n"

Span = tuple[int, int]


def _str_list(params: dict[str, Any], key: str) -> list[str]:
    v = params.pop(key, [])
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise ValueError(f"blocklist: {key!r} must be a list of non-empty strings")
    if any(len(s) > MAX_ENTRY_LEN for s in v):
        raise ValueError(f"blocklist: each of {key!r} must be at most {MAX_ENTRY_LEN} characters")
    for s in v:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"blocklist: {key!r} entry {s!r} is not valid text (a lone surrogate)") from None
    return v


class BlocklistMatcher:
    """The keywords and patterns of one blocklist, compiled with RE2. Built by :func:`compile_blocklist`.

    Args:
        keywords: literal strings, matched as whole words.
        patterns: RE2 regexes, each compiled alone first (so that none can change the others when
            they are joined into one alternation).
        case_sensitive: False: Unicode simple case folding (RE2 ``(?i)``).

    Raises:
        ValueError: a pattern RE2 cannot compile (``blocklist: pattern '...' is not supported by
            RE2: <reason>``), or the set does not fit RE2's memory limit.
    """

    def __init__(self, keywords: list[str], patterns: list[str], case_sensitive: bool) -> None:
        self.keywords: Any = None
        self.patterns: Any = None
        size = 0
        for p in patterns:
            try:
                size += compile_re2(p, case_sensitive=case_sensitive).programsize
                if "\\Q" in p:
                    try:
                        compile_re2(f"(?:{p})")  # joined, it would swallow what follows it
                    except ValueError:
                        raise ValueError("it ends inside \\Q...\\E (close it with \\E)") from None
            except ValueError as e:
                raise ValueError(
                    f"blocklist: pattern {p!r} is not supported by RE2 "
                    f"(https://github.com/google/re2/wiki/Syntax: no backreferences, no look-around): {e}"
                ) from None
            if size > MAX_PROGRAM_SIZE:
                raise ValueError(
                    f"blocklist: the patterns up to {p!r} compile to {size} RE2 instructions, "
                    f"more than {MAX_PROGRAM_SIZE} (simplify counted repetitions such as {{200}})"
                )
        try:
            if keywords:
                nonword = "[^" + py_class(r"\w") + "]"
                alts = "|".join(re2.escape(k) for k in keywords)
                fold = "" if case_sensitive else "i"
                self.keywords = compile_re2(f"{nonword}(?{fold}:{alts}){nonword}")
            if patterns:
                alts = "|".join(f"(?:{p})" for p in patterns)
                self.patterns = compile_re2(alts, case_sensitive=case_sensitive)
        except ValueError as e:
            raise ValueError(
                f"blocklist: the keywords and patterns together are too large for RE2: {e}"
            ) from None

    def search(self, text: str) -> bool:
        """Whether any keyword (as a whole word) or pattern matches somewhere in ``text`` (an empty match
        of a pattern counts). Linear in ``len(text)``."""
        text = matchable(text)
        if self.patterns is not None and self.patterns.search(text) is not None:
            return True
        return self.keywords is not None and self.keywords.search(_PAD + text + _PAD) is not None

    def keyword_spans(self, text: str):
        """Yield the ``(start, end)`` character spans of the keyword matches in ``text``, left to right,
        non-overlapping: those of Python's ``finditer`` over ``(?<!\\w)k1(?!\\w)|(?<!\\w)k2(?!\\w)|...``.
        For the output windows (each match costs a pass over ``text``)."""
        if self.keywords is None:
            return
        padded = _PAD + matchable(text) + _PAD
        pos = 0
        while (m := self.keywords.search(padded, pos)) is not None:
            s, e = m.start(), m.end() - 2  # the keyword is m[1:-1]; in text, one character to the left
            yield s, e
            pos = e  # a keyword at text index >= e has its left neighbour at padded index >= e

    def first_conclusive(self, chunk: OutputChunk) -> int | None:
        """Where to cut ``chunk`` (index into ``chunk.pending``), or None. See :class:`_BlocklistScanner`."""
        text = matchable(chunk.context + chunk.pending)
        n = len(chunk.context)
        found: list[Span] = []
        for s, e in self.keyword_spans(text):
            if e > n:
                found.append((s, e))
                break
        if self.patterns is not None:
            for m in self.patterns.finditer(text):
                if m.end() > n and m.end() > m.start():
                    found.append((m.start(), m.end()))
                    break
        cuts = [
            s - n
            for s, e in found
            if e < len(text) or s - n < chunk.release or chunk.final  # conclusive
        ]
        return max(0, min(cuts)) if cuts else None


def compile_blocklist(
    keywords: list[str], patterns: list[str], case_sensitive: bool
) -> BlocklistMatcher | None:
    """The RE2 matcher of all entries, or None when both lists are empty.

    Raises:
        ValueError: a pattern RE2 does not compile (the message names it and gives RE2's reason), or
            the whole set exceeds RE2's memory limit.
    """
    if not keywords and not patterns:
        return None
    return BlocklistMatcher(keywords, patterns, case_sensitive)


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
        self.matcher = compile_blocklist(keywords, patterns, case_sensitive)

    async def check_prompt(self, tenant_id, messages):
        """Raises PromptBlocked on a match; ``matching.MatchTimeout`` past the request's matching budget."""
        texts = [text for _role, text in iter_texts(messages, self.roles)]
        matcher = self.matcher
        if matcher is None or not texts:
            return None

        def any_match(_deadline: float) -> bool:
            return any(matcher.search(t) for t in texts)

        if await run_matching(any_match, sum(map(len, texts))):
            raise PromptBlocked(self.category, "blocklist match")
        return None

    def output_scanner(self, tenant_id=None):
        return _BlocklistScanner(self.matcher, self.category)


class _BlocklistScanner(OutputScanner):
    """Cuts at the earliest *conclusive* keyword or pattern match that reaches into the pending text.

    A match is conclusive when text follows it (so a trailing ``(?!\\w)`` cannot change), when it
    starts in the part about to be released, or when the stream has ended. A match of at most
    ``window`` characters is therefore always caught before any of it is sent. Matches entirely in
    already-sent text were judged before; empty pattern matches are ignored here.
    """

    def __init__(self, matcher: BlocklistMatcher | None, category: str) -> None:
        self.matcher = matcher
        self.category = category

    async def scan(self, chunk: OutputChunk) -> OutputChunk | OutputCut:
        matcher = self.matcher
        if matcher is None:
            return chunk
        at = await run_matching(
            lambda _deadline: matcher.first_conclusive(chunk), len(chunk.context) + len(chunk.pending)
        )
        return chunk if at is None else OutputCut(at, self.category)
