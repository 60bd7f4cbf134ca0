"""``InspectRecord``: what one request went through, and the observer that builds it from a run's events.

A record (``GET /v1/inspect/{request_id}``, gateway extension) holds:

* ``prompt``: the exact prompt the model read: its token ids, each token's text (``"".join(tokens) ==
  text``; a character split over tokens is given to the token that completes it), the positions of the
  special (control) tokens, and ``cached_tokens``: the first N tokens were served from the prefix cache
  (``usage.prompt_tokens_details.cached_tokens``, whole KV blocks);
* ``usage`` and ``timings``: the response's own (``timings`` in ns, ``ttft_duration`` is the TTFT the
  response reports);
* per choice its finish reason and ``timeline``: the backend's ``Timeline`` moved onto the gateway's clock,
  integer ns since the request arrived at the gateway. Time 0 of the backend's clock is put at
  ``backend_start`` (``timings.gateway_prep_duration``: the Submit was queued; the hop to the backend
  process takes microseconds on one host). ``chunks``: ``[start, end, tokens]`` per prompt chunk;
  ``first_token``: the backend sampled the choice's first token (the gateway received it at
  ``timings.ttft_duration``, a little later); ``decode``: each later token; ``preemptions``; ``finish``;
  ``dropped``: timeline entries left out (the backend keeps ``MAX_TIMELINE_EVENTS`` per list).

The record is built once, at ``Completed`` (a run that failed or whose client left keeps none; a prompt
over ``THREAD_TOKENS`` tokens in a worker thread, off the event loop), and kept encoded in the
``InspectStore`` under the request's tenant.
"""

from __future__ import annotations

import codecs
import time
from typing import Literal, Protocol

import msgspec
import trio

from backend.protocol import Timeline
from gateway.generation.events import ChoiceFinished, Completed, Event
from gateway.generation.request import GenerationRequest
from gateway.inspector.store import InspectStore
from gateway.openai.renderer import usage_out
from gateway.openai.schemas import UsageOut

_NS = 1_000_000_000
THREAD_TOKENS = 1024  # a longer prompt's record is built in a worker thread (8000 tokens: ~7 ms, 124 KB)


class Vocabulary(Protocol):
    """What the record reads of the tokenizer (``templating.TextTokenizer``)."""

    @property
    def id_to_bytes(self) -> list[bytes]: ...

    @property
    def special_ids(self) -> frozenset[int]: ...


class PromptView(msgspec.Struct, kw_only=True):
    """The prompt as the model read it: ``tokens[i]`` is the text of ``token_ids[i]``; ``special``: indices
    of control tokens; the first ``cached_tokens`` tokens came from the prefix cache."""

    text: str
    token_ids: list[int]
    tokens: list[str]
    special: list[int]
    cached_tokens: int


class TimelineView(msgspec.Struct, kw_only=True):
    """One choice's engine timeline, integer ns since the request's arrival at the gateway."""

    backend_start: int
    queue: int
    chunks: list[tuple[int, int, int]]
    first_token: int | None
    decode: list[int]
    preemptions: list[int]
    finish: int
    dropped: int = 0


class ChoiceView(msgspec.Struct, kw_only=True):
    index: int
    finish_reason: str
    completion_tokens: int
    timeline: TimelineView | None = None


class InspectRecord(msgspec.Struct, kw_only=True):
    """The inspection record of one request (module docstring)."""

    id: str
    object: Literal["inspect.record"] = "inspect.record"
    created: int
    model: str
    prompt: PromptView
    usage: UsageOut
    timings: dict[str, int]
    choices: list[ChoiceView]


def prompt_view(vocab: Vocabulary, ids: list[int], cached_tokens: int) -> PromptView:
    """The prompt's tokens as text (UTF-8 decoded across token boundaries, U+FFFD for invalid bytes)."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    table = vocab.id_to_bytes
    tokens = [dec.decode(table[t]) for t in ids]
    if tokens:
        tokens[-1] += dec.decode(b"", final=True)
    special = [i for i, t in enumerate(ids) if t in vocab.special_ids]
    return PromptView(
        text="".join(tokens),
        token_ids=list(ids),
        tokens=tokens,
        special=special,
        cached_tokens=min(cached_tokens, len(ids)),
    )


def timeline_view(t: Timeline, queue_s: float, backend_start: int) -> TimelineView:
    """``t`` (seconds on the backend's clock) in ns on the gateway's, the backend's time 0 at
    ``backend_start``."""

    def ns(s: float) -> int:
        return backend_start + int(s * _NS)

    return TimelineView(
        backend_start=backend_start,
        queue=int(queue_s * _NS),
        chunks=[(ns(a), ns(b), n) for a, b, n in t.chunks],
        first_token=None if t.first_token is None else ns(t.first_token),
        decode=[ns(s) for s in t.decode],
        preemptions=[ns(s) for s in t.preemptions],
        finish=ns(t.finish),
        dropped=t.dropped,
    )


class InspectObserver:
    """An ``EventSink`` that keeps the run's ``InspectRecord`` in ``store`` under the request's tenant once
    the run completed, readable by the response's id or by ``alias``."""

    def __init__(
        self, store: InspectStore, vocab: Vocabulary, req: GenerationRequest, alias: str | None = None
    ) -> None:
        self.store = store
        self.vocab = vocab
        self.req = req
        self.alias = alias  # the HTTP request's x-request-id
        self.finished: dict[int, ChoiceFinished] = {}

    async def emit(self, event: Event) -> None:
        if isinstance(event, ChoiceFinished):
            self.finished[event.index] = event
        elif isinstance(event, Completed):
            if len(self.req.prompt_ids) > THREAD_TOKENS:
                data = await trio.to_thread.run_sync(self.encoded, event)
            else:
                data = self.encoded(event)
            self.store.put(self.req.tenant_id, self.req.request_id, data, alias=self.alias)

    def encoded(self, done: Completed) -> bytes:
        """The record as JSON bytes (CPU work proportional to the prompt's length)."""
        return msgspec.json.encode(self.record(done))

    def record(self, done: Completed) -> InspectRecord:
        req = self.req
        start = done.timings.get("gateway_prep_duration", 0)
        choices = []
        for i, fin in sorted(self.finished.items()):
            queue = fin.timings.get("queue_duration", 0) / _NS
            tl = timeline_view(fin.timeline, queue, start) if fin.timeline is not None else None
            choices.append(
                ChoiceView(
                    index=i, finish_reason=fin.reason, completion_tokens=fin.completion_tokens, timeline=tl
                )
            )
        return InspectRecord(
            id=req.request_id,
            created=int(time.time()),
            model=req.model,
            prompt=prompt_view(self.vocab, req.prompt_ids, done.cached_tokens),
            usage=usage_out(done.prompt_tokens, done.completion_tokens, done.cached_tokens),
            timings=done.timings,
            choices=choices,
        )
