"""The typed events one generation run yields, and the sink that receives them.

A run (``gateway.generation.run``) turns one ``GenerationRequest`` into this
sequence, pushed in order into an ``EventSink``::

    Started                      at most once, before any text: the request was admitted and the
                                 backend answered (or the heartbeat interval passed); carries the
                                 rate-limit headers. Errors raised before it are plain HTTP errors.
    (TextDelta | Heartbeat | ChoiceFinished)*
                                 per choice: text (with logprobs when asked), then one ChoiceFinished.
                                 Heartbeat: nothing arrived for ``heartbeat_s`` (SSE sends a comment).
    Completed                    exactly once on success, after every ChoiceFinished: usage and timings of
                                 the whole request.
    Ended                        exactly once, always last, on every exit (success, error, client gone):
                                 what the request consumed, for bookkeeping (metrics, access log). It may
                                 come after the client left: renderers ignore it.

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

from backend.protocol import Timeline, TokenLogprob
from gateway.tools.parser import ToolCallDelta

FinishReason = Literal["stop", "length", "content_filter", "tool_calls"]


class Started(msgspec.Struct, tag="started", frozen=True, kw_only=True):
    """The answer may start: ``headers`` go on the HTTP response (x-ratelimit-*). ``waiting``: the heartbeat
    interval passed before the backend's first output (nothing follows at once; a stream may send its
    opening bytes now)."""

    headers: dict[str, str] = {}
    waiting: bool = False


class TextDelta(msgspec.Struct, tag="text", frozen=True, kw_only=True):
    """New text of choice ``index``. ``tokens``: tokens generated for it since the last delta (the text may be
    empty while a stop string is held back). ``logprobs``: one entry per token when logprobs were asked.
    ``tool_calls``: pieces of tool calls parsed out of the output (``text`` is then the plain content
    only): the first piece of a call has its id and name, later ones argument fragments. ``offsets``: with
    logprobs, per token the characters of ``text`` before it (a delta may carry several tokens)."""

    index: int
    text: str
    tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCallDelta] = []
    offsets: list[int] = []


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    """Nothing arrived for the heartbeat interval (streaming renderers send a keep-alive)."""


class ChoiceFinished(msgspec.Struct, tag="finish", frozen=True, kw_only=True):
    """Choice ``index`` is over. ``reason``: stop (EOS, stop token or stop string), length (max_tokens or the
    context), content_filter (an output filter cut it; ``content_filter_results`` says why), tool_calls
    (the output ended with complete tool calls).
    ``completion_tokens``: tokens billed for this choice. ``timings``: of this choice (ns). ``timeline``: the
    backend's record of this choice (seconds since its arrival there), when the request asked to be
    inspected (``GenerationRequest.inspect``)."""

    index: int
    reason: FinishReason
    completion_tokens: int
    timings: dict[str, int] = {}
    content_filter_results: dict | None = None
    timeline: Timeline | None = None


class Completed(msgspec.Struct, tag="completed", frozen=True, kw_only=True):
    """The request is over: token counts summed over choices, cached prompt tokens, timings (ns)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    timings: dict[str, int] = {}


class Ended(msgspec.Struct, tag="ended", frozen=True, kw_only=True):
    """The run is over, however it ended. ``status``: 200 (success), 499 (the client went away or stopped
    reading) or the HTTP status of the ``APIError`` that ended it (``error_type``/``error_code``: that error's).
    ``reason``: the request's finish reason: "content_filter" when an output filter cut any choice, else
    the reason of the last choice to finish; "abort" (client gone) or "error" when no choice finished.
    ``abort_reason``: why a 499 ended: "client_disconnect" (the client went away, or the request was
    cancelled at shutdown) or "slow_reader" (a stream whose client stopped reading was stopped after its
    token backlog); None otherwise.
    ``submitted``: the request reached a backend; ``prompt_tokens`` is None before that.
    ``completion_tokens``: the count billed: every token the backend generated for the request, all choices
    (tokens the client never received included; it may exceed ``Completed.completion_tokens``, which is
    what the client was given); ``cached_tokens``: None when no backend usage arrived. ``timings``: as
    ``Completed.timings`` (ns); ``preemptions``: times the backend preempted the request (max over
    choices)."""

    status: int
    reason: str
    abort_reason: str | None = None
    submitted: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None
    timings: dict[str, int] = {}
    preemptions: int = 0
    error_type: str | None = None
    error_code: str | None = None


Event = Started | TextDelta | Heartbeat | ChoiceFinished | Completed | Ended


class EventSink(Protocol):
    """Receives a run's events in order (a renderer, an observer, or a fan-out of both)."""

    async def emit(self, event: Event) -> None: ...
