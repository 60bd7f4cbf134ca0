"""Stop strings on streamed text (OpenAI ``stop``; vLLM ``include_stop_str_in_output``).

Semantics (documented in ``docs/text.md``):

* The output ends at the FIRST stop-string occurrence in the generated text, "first" meaning the one that
  completes earliest (smallest end offset; ties go to the one starting earliest, i.e. the longer). It is
  found however the text is split into deltas (tokens).
* The stop string itself is excluded from the content (OpenAI), or included when
  ``include_stop_str_in_output`` is true; nothing after it is ever emitted.
* Text that could still be the start of a stop string is held back until resolved: released as soon as it
  can no longer match, dropped if the stop completes. ``flush()`` at the end of generation releases it.
* Work per delta is O((len(delta) + L) * n * L) at worst for n stop strings of length <= L; it does not
  grow with the output length (only the held tail, shorter than L, is rescanned).

Stop strings are matched on decoded text (after ``IncrementalDetokenizer``), so a match never splits a
character.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.errors import InvalidRequest

__all__ = ["StopMatcher", "TextStream", "normalize_stop"]


def normalize_stop(
    value: Any, *, param: str = "stop", max_count: int = 16, max_length: int = 512
) -> list[str]:
    """Normalize the API ``stop`` field: null -> [], a bare string -> [it], an array of strings -> the list.

    Empty strings are dropped (they cannot end anything); duplicates are removed, order kept. OpenAI allows
    up to 4 stop strings; this gateway allows ``max_count`` (default 16).

    Raises:
        InvalidRequest(param=param): ``invalid_type`` for a value that is not a string/array/null or a
            non-string item (``stop[i]``); ``invalid_value`` for more than ``max_count`` items or an item
            longer than ``max_length`` characters.
    """
    if value is None:
        return []
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, (list, tuple)):
        items = list(value)
        for i, s in enumerate(items):
            if not isinstance(s, str):
                raise InvalidRequest(
                    f"'{param}[{i}]' must be a string.", param=f"{param}[{i}]", code="invalid_type"
                )
    else:
        raise InvalidRequest(
            f"'{param}' must be a string, an array of strings, or null.", param=param, code="invalid_type"
        )
    if len(items) > max_count:
        raise InvalidRequest(
            f"'{param}' may hold at most {max_count} strings.", param=param, code="invalid_value"
        )
    out: list[str] = []
    for s in items:
        if len(s) > max_length:
            raise InvalidRequest(
                f"each '{param}' string may be at most {max_length} characters.",
                param=param,
                code="invalid_value",
            )
        if s and s not in out:
            out.append(s)
    return out


class StopMatcher:
    """Per-sequence stop-string filter for a text stream. One per choice; not thread-safe.

    Args:
        stops: the stop strings (use ``normalize_stop``); empty strings are ignored; may be empty.
        include_stop_str_in_output: keep the matched stop string at the end of the content.

    Use::

        out, matched = m.feed(delta)   # send `out`; if matched: finish_reason "stop", abort generation
        ...
        tail = m.flush()               # at the end of generation (EOS / length): send `tail`
    """

    __slots__ = ("stops", "include", "_held", "_max", "matched", "matched_stop")

    def __init__(self, stops: Iterable[str] = (), *, include_stop_str_in_output: bool = False):
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self.include = include_stop_str_in_output
        self._held = ""
        self._max = max((len(s) for s in self.stops), default=0)
        self.matched = False
        #: The stop string that matched, or None.
        self.matched_stop: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta. Returns ``(text safe to emit now, matched)``.

        Once matched, the emitted text ends before (or, with the include flag, with) the stop string, and
        every later call returns ``("", True)``.
        """
        if self.matched:
            return "", True
        if not self.stops:
            return delta, False
        if not delta:
            return "", False
        s = self._held + delta
        # Only occurrences that end inside the new delta can be new: the held tail holds no full stop.
        best_end = -1
        best_start = -1
        best = None
        for stop in self.stops:
            i = s.find(stop)
            if i >= 0:
                end = i + len(stop)
                if best is None or end < best_end or (end == best_end and i < best_start):
                    best, best_start, best_end = stop, i, end
        if best is not None:
            self.matched = True
            self.matched_stop = best
            self._held = ""
            return (s[:best_end] if self.include else s[:best_start]), True
        keep = self._longest_partial(s)
        if keep:
            self._held = s[-keep:]
            return s[:-keep], False
        self._held = ""
        return s, False

    def _longest_partial(self, s: str) -> int:
        """Length of the longest suffix of ``s`` that is a proper prefix of some stop string."""
        tail = s[-(self._max - 1) :] if self._max > 1 else ""
        n = len(tail)
        best = 0
        for stop in self.stops:
            first = stop[0]
            j = tail.find(first, max(0, n - len(stop) + 1))
            while j >= 0:
                if n - j <= best:
                    break
                if stop.startswith(tail[j:]):
                    best = n - j  # the earliest start is the longest candidate for this stop
                    break
                j = tail.find(first, j + 1)
        return best

    def flush(self) -> str:
        """End of generation without a match: release the held text. Returns "" after a match."""
        if self.matched:
            return ""
        out, self._held = self._held, ""
        return out

    @property
    def held(self) -> str:
        """Text currently held back (shorter than the longest stop string)."""
        return self._held


class TextStream:
    """Detokenizer + stop matcher for one choice: token ids in, content deltas out (the gateway's pipeline).

    Args:
        tokenizer: a ``templating.TextTokenizer``.
        stops: stop strings (``normalize_stop`` output).
        include_stop_str_in_output: keep the matched stop string in the content.
        skip_special_tokens: drop special tokens from the text (default True).

    Use::

        ts = TextStream(tok, stops)
        text, matched = ts.feed(step_token_ids)   # send text; if matched: finish "stop", abort the request
        text = ts.finish()                        # on EOS / length / abort: send the rest (held text)

    ``feed`` after a match returns ``("", True)``. The concatenation of all returned text equals
    ``tokenizer.decode(ids)`` cut by the stop rule of ``StopMatcher``.
    """

    __slots__ = ("detok", "stops", "_finished")

    def __init__(
        self,
        tokenizer,
        stops: Iterable[str] = (),
        *,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ):
        from gateway.detokenizer import IncrementalDetokenizer

        self.detok = IncrementalDetokenizer.for_tokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stops = StopMatcher(stops, include_stop_str_in_output=include_stop_str_in_output)
        self._finished = False

    @property
    def matched(self) -> bool:
        """True once a stop string has matched."""
        return self.stops.matched

    def feed(self, token_ids: Iterable[int] | int) -> tuple[str, bool]:
        """Add one id or a list of ids. Returns ``(content delta, stop matched)``.

        Raises:
            IndexError: an id outside the vocabulary.
        """
        if self.stops.matched:
            return "", True
        if isinstance(token_ids, int):
            delta = self.detok.feed(token_ids)
        else:
            delta = self.detok.feed_many(token_ids)
        return self.stops.feed(delta)

    def finish(self) -> str:
        """End of generation: flush the decoder (an incomplete character -> U+FFFD) and release held text.

        If the flushed text completes a stop string, the content is cut there (check ``matched`` after).
        Idempotent.
        """
        if self._finished:
            return ""
        self._finished = True
        if self.stops.matched:
            return ""
        out, matched = self.stops.feed(self.detok.flush())
        if matched:
            return out
        return out + self.stops.flush()
