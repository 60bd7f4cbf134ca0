"""Incremental detokenization: token ids in, valid UTF-8 text deltas out.

Each token id maps to the exact bytes it stands for (``TextTokenizer.id_to_bytes``, byte-level BPE); the
bytes go through Python's incremental UTF-8 decoder (``codecs.getincrementaldecoder("utf-8")``,
``errors="replace"``). Consequences:

* a character split across tokens is emitted once, when its last byte arrives; no delta ever carries a
  U+FFFD for an incomplete-but-valid prefix;
* hold-back is bounded: the decoder keeps at most 3 bytes (an incomplete sequence); an invalid byte
  (e.g. a lone 0x80) is emitted at once as one U+FFFD and the text after it streams immediately;
* work per token is O(bytes of that token + 3), independent of output length (no re-decoding window);
* the concatenation of all deltas (``flush()`` included) equals ``tokenizer.decode(ids)`` with the same
  ``skip_special_tokens``: both decode the same byte stream with the Unicode "maximal subpart" U+FFFD rule
  (Rust ``String::from_utf8_lossy`` in ``tokenizers``; CPython's UTF-8 codec).

Special tokens are skipped by default (``skip_special_tokens=True``, the OpenAI-visible content).
"""

from __future__ import annotations

import codecs
from collections.abc import Collection, Iterable, Sequence

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Per-request streaming decoder. Not thread-safe; one per sequence (choice).

    Args:
        id_to_bytes: ``id_to_bytes[i]`` = bytes of token ``i`` (``TextTokenizer.id_to_bytes``).
        special_ids: ids to skip when ``skip_special_tokens`` (``TextTokenizer.special_ids``).
        skip_special_tokens: drop special tokens from the text (default True).

    Raises (from ``feed``):
        IndexError: a token id outside ``[0, len(id_to_bytes))``; negative ids are rejected too.
    """

    __slots__ = ("_table", "_special", "_skip", "_dec", "_done")

    def __init__(
        self,
        id_to_bytes: Sequence[bytes],
        special_ids: Collection[int] = (),
        *,
        skip_special_tokens: bool = True,
    ):
        self._table = id_to_bytes
        self._special = special_ids if isinstance(special_ids, (set, frozenset)) else frozenset(special_ids)
        self._skip = skip_special_tokens
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._done = False

    @classmethod
    def for_tokenizer(cls, tokenizer, *, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """Build from a ``templating.TextTokenizer`` (its byte table and special ids)."""
        return cls(tokenizer.id_to_bytes, tokenizer.special_ids, skip_special_tokens=skip_special_tokens)

    def feed(self, token_id: int) -> str:
        """Add one token; return the newly complete text ("" while a character is incomplete)."""
        if token_id < 0:
            raise IndexError(f"token id {token_id} out of range")
        if self._skip and token_id in self._special:
            return ""
        return self._dec.decode(self._table[token_id])

    def feed_many(self, token_ids: Iterable[int]) -> str:
        """Add several tokens (e.g. one engine step's output); return the newly complete text."""
        return "".join([self.feed(t) for t in token_ids])

    def flush(self) -> str:
        """End of sequence: bytes still held (an incomplete character) become U+FFFD. Idempotent."""
        if self._done:
            return ""
        self._done = True
        return self._dec.decode(b"", final=True)

    @property
    def pending_bytes(self) -> int:
        """Number of bytes held back (0..3)."""
        return len(self._dec.getstate()[0])
