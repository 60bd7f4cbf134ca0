"""The typed events one generation run yields, and the sink that receives them.

A run (``gateway.generation.run``) turns one ``GenerationRequest`` into this
sequence, pushed in order into an ``EventSink``::

    Started                      exactly once, before anything else: the request was admitted and the
                                 backend answered (or the heartbeat interval passed); carries the
                                 rate-limit headers. Errors raised before it are plain HTTP errors.
    (TextDelta | Heartbeat | ChoiceFinished)*
                                 per choice: text (with logprobs when asked), then one ChoiceFinished.
                                 Heartbeat: nothing arrived for ``heartbeat_s`` (SSE sends a comment).
    Completed                    exactly once, last, on success: usage and timings of the whole request.

An ``APIError`` raised by the run after ``Started`` is reported by the renderer in its own framing (an SSE
error event, an NDJSON error line); before ``Started`` it is the HTTP status of the answer.

Renderers (OpenAI chat/completion chunks, non-stream JSON, Ollama NDJSON/JSON) and observability (metrics
counters, the access log) are both fed these events; nothing reads response bytes back.

Shapes: ``text`` is a ``str`` (never split inside a UTF-8 character); ``tokens`` counts generated tokens
(an int >= 0); timings are integer nanoseconds under Ollama's names (``prompt_eval_count``,
``eval_count``, ``queue_duration``, ``prompt_eval_duration``, ``eval_duration``, ``ttft_duration``,
``total_duration``...).
"""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec

from backend.protocol import TokenLogprob

FinishReason = Literal["stop", "length", "content_filter"]


class Started(msgspec.Struct, tag="started", frozen=True, kw_only=True):
    """The answer may start: ``headers`` go on the HTTP response (x-ratelimit-*)."""

    headers: dict[str, str] = {}


class TextDelta(msgspec.Struct, tag="text", frozen=True, kw_only=True):
    """New text of choice ``index``. ``tokens``: tokens generated for it since the last delta (the text may be
    empty while a stop string is held back). ``logprobs``: one entry per token when logprobs were asked."""

    index: int
    text: str
    tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """Nothing arrived for the heartbeat interval (streaming renderers send a keep-alive)."""


class ChoiceFinished(msgspec.Struct, tag="finish", frozen=True, kw_only=True):
    """Choice ``index`` is over. ``reason``: stop (EOS, stop token or stop string), length (max_tokens or the
    context), content_filter (an output filter cut it; ``content_filter_results`` says why).
    ``completion_tokens``: tokens billed for this choice. ``timings``: of this choice (ns)."""

    index: int
    reason: FinishReason
    completion_tokens: int
    timings: dict[str, int] = {}
    content_filter_results: dict | None = None


class Completed(msgspec.Struct, tag="completed", frozen=True, kw_only=True):
    """The request is over: token counts summed over choices, cached prompt tokens, timings (ns)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    timings: dict[str, int] = {}


Event = Started | TextDelta | Heartbeat | ChoiceFinished | Completed


class EventSink(Protocol):
    """Receives a run's events in order (a renderer, an observer, or a fan-out of both)."""

    async def emit(self, event: Event) -> None: ...
