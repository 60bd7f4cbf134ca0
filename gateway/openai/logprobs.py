"""Backend ``TokenLogprob`` entries -> the OpenAI logprobs shapes.

Chat (``choices[].logprobs.content``): one ``{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}`` per token (OpenAI "The chat completion object"). Legacy completions (``choices[].logprobs``):
parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (one ``{token: logprob}`` per token, null
when no alternatives were asked) and ``text_offset`` (characters of the choice's text before the delta
that carried the token). ``k``: alternatives asked (``top_logprobs`` / ``logprobs``), at most 20.
"""

from __future__ import annotations

from typing import Protocol

from backend.protocol import TokenLogprob
from gateway.openai.schemas import CompletionLogprobs, TokenLogprobOut, TopLogprob


class TokenNames(Protocol):
    """Printable text and raw bytes of a token id (``gateway.state.Gateway``)."""

    def token_str(self, tid: int) -> str: ...

    def token_bytes(self, tid: int) -> list[int]: ...


def chat_logprobs(names: TokenNames, items: list[TokenLogprob], k: int) -> list[TokenLogprobOut]:
    """Chat ``logprobs.content`` entries of ``items``, each with its first ``k`` alternatives."""
    out = []
    for it in items:
        top = [TopLogprob(names.token_str(t), lp, names.token_bytes(t)) for t, lp in (it.top or [])[:k]]
        out.append(
            TokenLogprobOut(names.token_str(it.token_id), it.logprob, names.token_bytes(it.token_id), top)
        )
    return out


def completion_logprobs(
    names: TokenNames, items: list[TokenLogprob], k: int, offset: int, within: list[int] | None = None
) -> CompletionLogprobs:
    """Legacy logprobs of the tokens of one delta that starts at character ``offset`` of the choice;
    ``within``: per token the characters of the delta before it (``TextDelta.offsets``; none: 0 each)."""
    toks, lps, tops = [], [], []
    for it in items:
        toks.append(names.token_str(it.token_id))
        lps.append(it.logprob)
        tops.append({names.token_str(t): lp for t, lp in (it.top or [])[:k]} if k else {})
    offs = [offset + w for w in within] if within and len(within) == len(items) else [offset] * len(items)
    return CompletionLogprobs(toks, lps, tops if k else None, offs)


def merge_completion_logprobs(parts: list[CompletionLogprobs], k: int) -> CompletionLogprobs:
    """The parts of one choice (one per delta) as one legacy logprobs object."""
    toks: list[str] = []
    lps: list[float] = []
    tops: list[dict[str, float]] = []
    offs: list[int] = []
    for part in parts:
        toks += part.tokens
        lps += part.token_logprobs
        if part.top_logprobs is not None:
            tops += part.top_logprobs
        offs += part.text_offset
    return CompletionLogprobs(toks, lps, tops if k else None, offs)
