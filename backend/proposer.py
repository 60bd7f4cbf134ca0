"""N-gram (prompt-lookup) draft proposer for speculative decoding.

A sequence's own context (prompt then generated tokens) is the draft model: when its last ``k`` tokens
(``k`` from ``max_ngram`` down to ``min_ngram``, longest first) occurred earlier in the context, the
tokens that followed that earlier occurrence are proposed as the next ones. Answers that quote their
prompt, summaries, code edits, JSON repeating keys and multi-turn chats restating earlier turns repeat
n-grams of their context, so these drafts are often right, and they cost no model pass.

``NgramIndex`` keeps, per ``k``, a dict from each ``k``-gram of the context to the position just past
its latest occurrence. It is updated incrementally (``O(max_ngram)`` per appended token, never a rescan),
and a lookup is ``O(max_ngram)`` dict probes. The most recent earlier occurrence wins.

``DraftPolicy`` decides per sequence how much to draft: as many tokens as the matched n-gram is long
plus one (capped by ``num_speculative_tokens``), so a chance 1-token match costs a 2-row verify chunk
and a long quoted run drafts the full length; a sequence whose drafts keep failing backs off (after
``patience`` fully rejected drafts in a row it skips drafting for a number of steps that doubles up to
``max_backoff``; any accepted token resets it), so open-ended text pays little for the drafts it cannot
use. Measured by replaying recorded answers against the verify cost by rows (docs/perf.md, "Draft length
by match length").

Plain Python, no torch. Source followed: Saxena, "Prompt Lookup Decoding" (2023); vLLM's ``ngram``
speculative method (``prompt_lookup_min`` / ``prompt_lookup_max``); Leviathan et al., "Fast Inference
from Transformers via Speculative Decoding" (ICML 2023) for why verification keeps the output exact.
"""

from __future__ import annotations

#: default draft length where generated rows take the row-invariant Q4_1 x Q8_1 kernel (``generated_int4``):
#: it serves 8 rows per pass over the weights; a verify chunk of 6 rows costs ~1.4x a decode step and drafts
#: are as long as their match allows (docs/perf.md, "Draft length by match length")
DRAFT_TOKENS_INT4 = 5
#: default draft length on the dense paths (float32 on CPU, CUDA): a decode step is bound by reading the
#: weights, and 6 rows cost ~1.1x one (2-core EPYC, float32: 64 ms for 1..5 rows, 71 ms for 6)
DRAFT_TOKENS_DENSE = 5
#: fully rejected drafts in a row before a sequence backs off (``DraftPolicy``)
PATIENCE = 8
#: default n-gram lengths matched (tokens): a 1-token match drafts 2 tokens, an 8-token match the full K
PROMPT_LOOKUP_MIN = 1
PROMPT_LOOKUP_MAX = 8


def default_draft_tokens(generated_int4: bool) -> int:
    """``num_speculative_tokens`` when none is configured, by the weight path of generated rows."""
    return DRAFT_TOKENS_INT4 if generated_int4 else DRAFT_TOKENS_DENSE


class NgramIndex:
    """Incremental index of one sequence's n-grams.

    Args:
        min_ngram, max_ngram: the match lengths looked up (tokens, ``1 <= min_ngram <= max_ngram``).

    Attributes:
        indexed: context positions ``e`` whose n-grams ending at ``e`` (exclusive) are in the index.
    """

    __slots__ = ("min_ngram", "max_ngram", "tables", "indexed")

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        # tables[k - min_ngram]: k-gram -> position just past its latest indexed occurrence
        self.tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_ngram, max_ngram + 1)]
        self.indexed = 0

    def _index_upto(self, tokens: list[int], end: int) -> None:
        """Index the n-grams that end at the positions ``(self.indexed, end]`` (exclusive ends)."""
        lo = self.min_ngram
        for e in range(max(self.indexed + 1, lo), end + 1):
            for k in range(lo, min(self.max_ngram, e) + 1):
                self.tables[k - lo][tuple(tokens[e - k : e])] = e
        self.indexed = max(self.indexed, end)

    def match(self, tokens: list[int]) -> tuple[int, int] | None:
        """The longest suffix of ``tokens`` (``min_ngram..max_ngram`` tokens) that occurred earlier:
        ``(end, k)``, the position just past its latest earlier occurrence and its length (tokens), or None.

        ``tokens`` must extend the list given at earlier calls (tokens are only appended).
        """
        n = len(tokens)
        if n < self.min_ngram + 1:
            return None
        # every n-gram ending before the last position: the suffix itself must find an *earlier* occurrence
        self._index_upto(tokens, n - 1)
        lo = self.min_ngram
        for k in range(min(self.max_ngram, n - 1), lo - 1, -1):
            e = self.tables[k - lo].get(tuple(tokens[n - k :]))
            if e is not None:
                return e, k
        return None

    def propose(self, tokens: list[int], num_tokens: int, beyond_match: int | None = None) -> list[int]:
        """Up to ``num_tokens`` draft tokens to follow ``tokens`` (the whole context so far): those after the
        longest ``match``, at most its length plus ``beyond_match`` when given; [] when there is none."""
        m = self.match(tokens) if num_tokens > 0 else None
        if m is None:
            return []
        end, k = m
        if beyond_match is not None:
            num_tokens = min(num_tokens, k + beyond_match)
        return tokens[end : min(len(tokens), end + num_tokens)]


class DraftPolicy:
    """Per-sequence drafting state: its n-gram index and its back-off after rejected drafts.

    Args:
        num_speculative_tokens: most draft tokens per step (tokens).
        min_ngram, max_ngram: see ``NgramIndex``.
        max_backoff: most steps a failing sequence skips drafting (steps).
        patience: fully rejected drafts in a row before the sequence skips drafting (>= 1).

    Attributes:
        draft_tokens / accepted_tokens: this sequence's totals (tokens).
    """

    __slots__ = (
        "index",
        "k",
        "skip",
        "backoff",
        "max_backoff",
        "patience",
        "failures",
        "draft_tokens",
        "accepted_tokens",
    )

    def __init__(
        self,
        num_speculative_tokens: int,
        min_ngram: int = PROMPT_LOOKUP_MIN,
        max_ngram: int = PROMPT_LOOKUP_MAX,
        max_backoff: int = 16,
        patience: int = PATIENCE,
    ) -> None:
        if patience < 1:
            raise ValueError("patience must be >= 1")
        self.index = NgramIndex(min_ngram, max_ngram)
        self.k = num_speculative_tokens
        self.skip = 0
        self.backoff = 1
        self.max_backoff = max_backoff
        self.patience = patience
        self.failures = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Draft for the next step: the tokens after the longest earlier match of the context's suffix, as
        many as the match is long plus one, at most ``min(num_speculative_tokens, limit)``; [] while
        backing off or without a match."""
        if self.skip > 0:
            self.skip -= 1
            return []
        return self.index.propose(tokens, min(self.k, limit), beyond_match=1)

    def record(self, drafted: int, accepted: int) -> None:
        """Feed one verification's outcome (``accepted <= drafted`` tokens)."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if drafted == 0:
            return
        if accepted == 0:
            self.failures += 1
            if self.failures >= self.patience:
                self.skip = self.backoff
                self.backoff = min(self.max_backoff, self.backoff * 2)
        else:
            self.failures = 0
            self.backoff = 1
