"""``Usage``: the tokens one upstream request is billed, from the upstream's own ``usage`` when it sent one,
else counted here and marked estimated.

Prompt tokens before the request (what admission reserves): the model's tokenizer's count of the message
texts, or without a tokenizer ``ceil(characters * tokens_per_char)`` (``UpstreamConfig.tokens_per_char``,
the safety factor documented in docs/upstream.md), plus ``TOKENS_PER_MESSAGE`` per message and
``TOKENS_PER_REQUEST`` once (the upstream's template adds its markers and, in some templates, a default
system prompt). After the answer the upstream's ``usage`` (OpenAI: ``prompt_tokens``, ``completion_tokens``,
``prompt_tokens_details.cached_tokens``) wins; where it sent none (an upstream without ``stream_options``,
a stream the gateway closed after an output filter cut it or the client left) the completion is counted
over the text received (the tokenizer, else the estimate) and the prompt keeps its reserved count;
``estimated`` is then True (docs/upstream.md: the ledger row's ``timings.usage_estimated`` and a log line
say so).

``implausible(usage, ...)`` (``checked_usage``: raising ``UpstreamError``): an upstream ``usage`` whose counts cannot be true (negative, over
``MAX_TOKEN_COUNT``, or over ``CONTEXT_FACTOR`` times the model's context) is refused by the run as a
malformed answer (502) before any of it is billed: such counts would overflow the ledger's integers or drain a
tenant's token budget for a fault of the upstream's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from gateway.upstream.config import TOKENS_PER_MESSAGE, TOKENS_PER_REQUEST, UpstreamConfig
from gateway.upstream.errors import UpstreamError
from templating import TextTokenizer

log = logging.getLogger("gateway.upstream")


def message_texts(messages: list[dict[str, Any]]) -> Iterator[str]:
    """The text of every message's ``content`` (a string, or the ``text`` of its parts)."""
    for m in messages:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            yield c
        elif isinstance(c, list):
            for part in c:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]


def text_tokens(text: str, tok: TextTokenizer | None, cfg: UpstreamConfig) -> int:
    """Tokens of ``text``: by ``tok`` when given, else ``ceil(len(text) * cfg.tokens_per_char)``."""
    if not text:
        return 0
    if tok is not None:
        return len(tok.encode_plain(text))
    return math.ceil(len(text) * cfg.tokens_per_char)


def prompt_tokens(messages: list[dict[str, Any]], tok: TextTokenizer | None, cfg: UpstreamConfig) -> int:
    """Prompt tokens reserved for ``messages`` (see the module docstring)."""
    n = sum(text_tokens(t, tok, cfg) for t in message_texts(messages))
    return n + TOKENS_PER_MESSAGE * len(messages) + TOKENS_PER_REQUEST


#: The largest token count an upstream may report (a signed 32-bit integer; OpenAI-compatible servers count
#: tokens of one request, far below it).
MAX_TOKEN_COUNT = 2**31 - 1
#: How many times the model's ``context_length`` (per choice) a count may reach before it is malformed: far
#: over what one request can use, so a model whose real context is longer than the configured one still passes
#: (a 1M-token upstream with the default 8192 would have to use 500k tokens of one choice to be refused).
CONTEXT_FACTOR = 64


def implausible(usage: dict[str, Any], *, context_length: int, n: int = 1) -> str | None:
    """Why the upstream's ``usage`` (OpenAI's object) cannot be true, as ``"completion_tokens = 18446744073709551616
    (over 2147483647)"``, or None. Checked: ``prompt_tokens`` (bound: ``CONTEXT_FACTOR * context_length``),
    ``completion_tokens`` (``n`` times that), ``total_tokens`` (their sum) and
    ``prompt_tokens_details.cached_tokens`` (the prompt's), each at most ``MAX_TOKEN_COUNT`` and not negative;
    members that are absent or not numbers are left to ``settled``."""
    prompt = min(MAX_TOKEN_COUNT, CONTEXT_FACTOR * context_length)
    completion = min(MAX_TOKEN_COUNT, prompt * max(1, n))
    details = usage.get("prompt_tokens_details")
    checks = [
        ("prompt_tokens", usage.get("prompt_tokens"), prompt),
        ("completion_tokens", usage.get("completion_tokens"), completion),
        ("total_tokens", usage.get("total_tokens"), min(MAX_TOKEN_COUNT, prompt + completion)),
    ]
    if isinstance(details, dict):
        checks.append(("prompt_tokens_details.cached_tokens", details.get("cached_tokens"), prompt))
    for name, value, bound in checks:
        if isinstance(value, int | float) and not isinstance(value, bool) and not 0 <= value <= bound:
            shown = str(value)[:40]
            return f"{name} = {shown} ({'negative' if value < 0 else f'over {bound}'})"
    return None


def checked_usage(usage: dict[str, Any], context_length: int, n: int) -> dict[str, Any]:
    """``usage`` when it could be true (``implausible``).

    Raises:
        UpstreamError: 502, a malformed answer naming the count (logged too).
    """
    why = implausible(usage, context_length=context_length, n=n)
    if why is None:
        return usage
    log.warning("an upstream answer's usage is malformed: %s", why)
    raise UpstreamError(f"The upstream model server sent a malformed answer: usage {why}.")


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Tokens billed for one upstream request; ``estimated``: counted here, not the upstream's."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    estimated: bool = False


def _int(obj: Any, key: str) -> int | None:
    v = obj.get(key) if isinstance(obj, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def settled(upstream: Any, *, prompt_tokens: int, count: Callable[[], int]) -> Usage:
    """The usage billed: the upstream's ``usage`` object when it has both counts, else ``prompt_tokens``
    (reserved) and ``count()`` (the completion counted here, called only then), marked estimated."""
    p, c = _int(upstream, "prompt_tokens"), _int(upstream, "completion_tokens")
    if p is not None and c is not None:
        cached = _int(upstream.get("prompt_tokens_details"), "cached_tokens") or 0
        return Usage(prompt_tokens=p, completion_tokens=c, cached_tokens=min(cached, p))
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=count(), estimated=True)
