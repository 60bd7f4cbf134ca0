"""``run_upstream``: one request to an upstream model, as the typed events of ``gateway.generation.events``.

The same events as a native run, so every renderer (OpenAI SSE and JSON, Ollama NDJSON and JSON) and the
observers (access log, metrics, inspector) serve upstream models unchanged. Order: admission (the tenant's
reservation of the call's prompt count + ``max_tokens * n``; 429 ``RateLimited``) -> the upstream request
(``UpstreamClient.stream``: failover before the first byte; 503/502/4xx) -> per upstream chunk: each
choice's text through its output filter (``gateway.filters``: it may hold text back and cut the stream),
``TextDelta`` / ``ChoiceFinished`` -> ``Completed`` with the usage -> ``Ended``.

Tasks: the run's handler task owns one nursery with one reader task (upstream chunks -> a bounded memory
channel; an upstream failure travels as an item); the reader closing its end is the end of the answer.
``Started`` is held back until the first chunk or ``sse_heartbeat`` (an error the upstream sends first is
still a plain HTTP error); afterwards a ``Heartbeat`` goes out whenever nothing arrived for
``sse_heartbeat``. When every choice is over (an upstream ``finish_reason``, or an output filter cut it)
the run waits for the usage chunk only if the upstream finished every choice itself; otherwise, and on a
client disconnect or an error, leaving the block closes the upstream response in cancel-shielded cleanup,
which closes its connection: the upstream stops generating. Bounds: the upstream request within ``deadline``,
each event within ``event_timeout`` (comments do not count), else 504 ``UpstreamTimeout``; a ``usage`` no
upstream could report (``usage.checked_usage``) is a 502.

Billing (``Reservation.finish``, cancel-shielded, on every exit): the upstream's ``usage`` when it sent
one, else counted here and marked estimated (``gateway.upstream.usage``; ``timings.usage_estimated = 1`` in
the ledger row and a log line). A request the upstream never accepted bills nothing (prompt 0).

Token counts per choice (``TextDelta.tokens``): one per chunk that carried text or a tool-call piece (an
OpenAI-compatible server streams about one token per chunk); the request's are the usage's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import httpx
import trio

from auth.principal import Principal
from gateway.errors import APIError
from gateway.generation.choice import OutputFilter
from gateway.generation.events import (
    ChoiceFinished,
    Completed,
    Ended,
    EventSink,
    FinishReason,
    Heartbeat,
    Started,
    TextDelta,
)
from gateway.generation.request import GenerationRequest
from gateway.sections import HTTPSettings
from gateway.upstream.call import UpstreamCall
from gateway.upstream.errors import UpstreamError, UpstreamTimeout
from gateway.upstream.model import OpenAIUpstream
from gateway.upstream.sse import finish_reason, timed_chunks, tool_call_pieces
from gateway.upstream.usage import Usage, checked_usage, settled, text_tokens
from ratelimit.reservation import Reservation

log = logging.getLogger("gateway.upstream")

_NS = 1_000_000_000
_CHANNEL = 64  # chunks read ahead of the client


class Services(Protocol):
    """What a run uses of the gateway (``gateway.state.Gateway``): the HTTP settings (``sse_heartbeat``),
    admission over the tenant's limits and the tenant's output filters."""

    config: HTTPSettings

    def admission(
        self, principal: Principal | None, prompt_tokens: int, max_tokens: int, model: str
    ) -> Callable[[str], AbstractAsyncContextManager[Reservation]] | None: ...

    def output_filter(self, principal: Principal | None) -> Callable[[], OutputFilter | None] | None: ...


class _Failed:
    """The reader's end: the upstream failed (``exc``)."""

    def __init__(self, exc: APIError) -> None:
        self.exc = exc


class _Choice:
    """One choice of the answer: its output filter, what it received (for counting), how it ended."""

    __slots__ = ("index", "filter", "received", "chunks", "finish", "upstream_finished")

    def __init__(self, index: int, output_filter: OutputFilter | None) -> None:
        self.index = index
        self.filter = output_filter
        self.received: list[str] = []  # raw text and call arguments, before any filter
        self.chunks = 0  # chunks that carried text or a call piece
        self.finish: FinishReason | None = None
        self.upstream_finished = False

    @property
    def cut(self) -> bool:
        return self.filter is not None and self.filter.cut


@asynccontextmanager
async def _no_admission() -> AsyncIterator[None]:
    yield None  # no tenancy: nothing reserved, nothing billed


class _UpstreamRun:
    """The state of one upstream run (owned by the handler task)."""

    def __init__(
        self, gw: Services, model: OpenAIUpstream, call: UpstreamCall, req: GenerationRequest, sink: EventSink
    ) -> None:
        self.gw, self.model, self.call, self.req, self.sink = gw, model, call, req, sink
        make = gw.output_filter(req.principal)
        self.choices = [_Choice(i, make() if make is not None else None) for i in range(req.sampling.n)]
        self.open = req.sampling.n
        self.usage: Any = None  # the upstream's usage object, once sent
        self.accepted = False  # the upstream answered 2xx
        self.t_sent: float | None = None
        self.t_first: float | None = None
        self._settled: tuple[tuple[int, int], Usage] | None = None

    # ------------------------------------------------------------------ counts
    def _usage(self) -> Usage:
        """The usage billed (``gateway.upstream.usage.settled``), counted once per state of the answer (the
        count over the text received runs only when the upstream sent no usage)."""
        key = (id(self.usage), sum(c.chunks for c in self.choices))
        if self._settled is None or self._settled[0] != key:
            tok, cfg = self.model.tokenizer, self.model.config

            def count() -> int:
                return sum(text_tokens("".join(c.received), tok, cfg) for c in self.choices)

            self._settled = key, settled(self.usage, prompt_tokens=self.call.prompt_tokens, count=count)
        return self._settled[1]

    def _timings(self, usage: Usage | None = None) -> dict[str, int]:
        """Timings (ns, Ollama names) of the request so far; token counts from ``usage`` once settled (a
        choice's: its chunks, and the prompt only when counted exactly here)."""
        now, t0 = time.perf_counter(), self.req.t_arrival
        d: dict[str, int] = {}
        if usage is not None or self.call.prompt_exact:
            d["prompt_eval_count"] = usage.prompt_tokens if usage is not None else self.call.prompt_tokens
        d["eval_count"] = usage.completion_tokens if usage else sum(c.chunks for c in self.choices)
        if self.t_sent is not None:
            d["gateway_prep_duration"] = int((self.t_sent - t0) * _NS)
        if self.t_first is not None:
            d["ttft_duration"] = int((self.t_first - t0) * _NS)
        d["total_duration"] = int((now - t0) * _NS)
        return d

    # ------------------------------------------------------------------ the run
    async def run(self) -> None:
        """Admission, the answer, the bill (cancel-shielded: ``_bill`` is synchronous) and ``Ended``, on
        every exit."""
        req = self.req
        admit = self.gw.admission(
            req.principal, self.call.prompt_tokens, req.sampling.max_tokens * req.sampling.n, req.model
        )
        admission = admit(req.request_id) if admit is not None else _no_admission()
        ended: Ended | None = None
        try:
            async with admission as res:
                try:
                    await self._answer(res.headers if res is not None else {})
                    ended = self._ended(200)
                except BaseException as exc:
                    ended = self._ended_by(exc)
                    raise
                finally:
                    if res is not None and ended is not None:
                        self._bill(res, ended)
        except BaseException as exc:
            ended = ended or self._ended_by(exc)  # none yet: refused at admission
            raise
        finally:
            with trio.CancelScope(shield=True):
                await self.sink.emit(ended or self._ended(500))

    async def _answer(self, headers: dict[str, str]) -> None:
        """The answer within the model's ``deadline`` (else 504, the response closed), then ``Completed``."""
        self.t_sent, deadline = time.perf_counter(), self.model.config.deadline
        with trio.move_on_after(deadline) as scope:
            await self._exchange(headers)
        if scope.cancelled_caught:
            raise UpstreamTimeout(
                f"The upstream server of '{self.model.name}' passed its {deadline:g} s deadline."
            )
        usage = self._usage()
        await self.sink.emit(
            Completed(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
                timings=self._timings(usage),
            )
        )

    async def _exchange(self, headers: dict[str, str]) -> None:
        async with self.model.client.stream(self.call.path, self.call.body, self.req.request_id) as resp:
            self.accepted = True
            send, recv = trio.open_memory_channel[Any](_CHANNEL)
            failure: BaseException | None = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, resp, send)
                try:
                    await self._pump(recv, headers)
                except BaseException as exc:  # raised again below, not wrapped in the nursery's group
                    failure = exc
                finally:
                    nursery.cancel_scope.cancel()  # every choice over, an error or the client gone
            if failure is not None:
                raise failure

    async def _read(self, resp: httpx.Response, send: trio.MemorySendChannel[Any]) -> None:
        """The reader task: every chunk of ``resp`` into ``send``, then a ``_Failed`` if the upstream failed;
        closing ``send`` is the end of the answer (``sse.timed_chunks``: ``event_timeout`` between events)."""
        async with send:
            try:
                async for chunk in timed_chunks(resp, self.model.config.event_timeout, self.model.name):
                    await send.send(chunk)
            except APIError as exc:
                await send.send(_Failed(exc))
            except Exception:  # noqa: BLE001 - whatever an odd answer trips: a 502, never a 500
                log.exception("model %s: unreadable answer", self.model.name)
                await send.send(
                    _Failed(UpstreamError("The upstream model server sent an unreadable answer."))
                )

    async def _next(self, recv: trio.MemoryReceiveChannel[Any]) -> dict[str, Any] | None | Heartbeat:
        """The next chunk, None at the end, or a ``Heartbeat`` after ``sse_heartbeat`` of silence.

        Raises:
            APIError: the upstream failed (the reader's ``_Failed``).
        """
        with trio.move_on_after(self.gw.config.sse_heartbeat):
            try:
                item = await recv.receive()
            except trio.EndOfChannel:
                return None
            if isinstance(item, _Failed):
                raise item.exc
            return item
        return Heartbeat()

    async def _pump(self, recv: trio.MemoryReceiveChannel[Any], headers: dict[str, str]) -> None:
        first = await self._next(recv)
        await self.sink.emit(Started(headers=headers, waiting=isinstance(first, Heartbeat)))
        item = first
        while True:
            if isinstance(item, Heartbeat):
                await self.sink.emit(item)
            elif item is None:
                if self.open > 0:
                    raise UpstreamError("The upstream model server ended the answer without finishing it.")
                return
            else:
                try:
                    await self._chunk(item)
                except (TypeError, ValueError, KeyError, AttributeError):  # a chunk of an unexpected shape
                    log.exception("model %s: a chunk of an unexpected shape", self.model.name)
                    raise UpstreamError(
                        "The upstream model server sent a chunk of an unexpected shape."
                    ) from None
                if self.open == 0 and (
                    self.usage is not None or not all(c.upstream_finished for c in self.choices)
                ):
                    return  # nothing more to wait for (or a stream the gateway ended itself)
            item = await self._next(recv)

    async def _chunk(self, obj: dict[str, Any]) -> None:
        """One upstream chunk: its usage, then each of its choices' pieces."""
        if isinstance(obj.get("usage"), dict):  # never billed unless it could be true
            self.usage = checked_usage(obj["usage"], self.model.context_length, self.req.sampling.n)
        for ch in obj.get("choices") or []:
            if not isinstance(ch, dict) or not isinstance(ch.get("index", 0), int):
                continue
            i = ch.get("index", 0)
            if 0 <= i < len(self.choices):
                await self._piece(self.choices[i], ch)

    async def _piece(self, c: _Choice, ch: dict[str, Any]) -> None:
        if self.call.chat:
            delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
            text, calls = delta.get("content"), tool_call_pieces(delta.get("tool_calls"))
        else:
            text, calls = ch.get("text"), []
        text = text if isinstance(text, str) else ""
        new = bool(text or calls)  # one token (see the module docstring), though a filter may hold it back
        if new:
            c.received.append(text + "".join(d.arguments for d in calls))
            c.chunks += 1
        if c.finish is not None:
            return  # a choice the gateway cut: counted, not sent
        upstream_fin = ch.get("finish_reason")
        final = upstream_fin is not None
        if c.filter is not None:
            text = await c.filter.step(text, final)
            if c.filter.cut:
                calls = []
        if new or text:
            if self.t_first is None:
                self.t_first = time.perf_counter()
            await self.sink.emit(TextDelta(index=c.index, text=text, tokens=int(new), tool_calls=calls))
        if final or c.cut:
            c.upstream_finished = final and not c.cut
            c.finish = "content_filter" if c.cut else finish_reason(upstream_fin)
            self.open -= 1
            await self.sink.emit(
                ChoiceFinished(
                    index=c.index,
                    reason=c.finish,
                    completion_tokens=c.chunks,
                    timings=self._timings(),
                    content_filter_results=c.filter.result if c.cut and c.filter is not None else None,
                )
            )

    # ------------------------------------------------------------------ cleanup
    def _ended_by(self, exc: BaseException) -> Ended:
        """499 for the client gone (``trio.Cancelled``, alone or as the only kind in the group the reader's
        nursery raises when the client leaves), the status of an ``APIError``, else 500."""
        if isinstance(exc, APIError):
            return self._ended(exc.status, exc)
        if isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is None:
            exc = exc.exceptions[0]
        if isinstance(exc, trio.Cancelled):
            return self._ended(499, abort="client_disconnect")
        return self._ended(500)

    def _ended(self, status: int, error: APIError | None = None, abort: str | None = None) -> Ended:
        usage = self._usage() if self.accepted else None
        if any(c.cut for c in self.choices):
            reason = "content_filter"
        else:
            done = [c.finish for c in self.choices if c.finish is not None]
            reason = done[-1] if done else ("abort" if status == 499 else "error")
        return Ended(
            status=status,
            reason=reason,
            abort_reason=abort,
            submitted=self.accepted,
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage and not usage.estimated else None,
            timings=self._timings(usage),
            error_type=error.type if error is not None else None,
            error_code=error.code if error is not None else None,
        )

    def _bill(self, res: Reservation, ended: Ended) -> None:
        """The reservation's true-up: the tokens of ``ended`` (the upstream's usage or the count here),
        ``timings`` in seconds with ``usage_estimated`` 1.0 when counted here; nothing billed for a request
        the upstream never accepted."""
        secs: dict[str, float] = {"total_s": ended.timings["total_duration"] / _NS}
        if "ttft_duration" in ended.timings:
            secs["ttft_s"] = ended.timings["ttft_duration"] / _NS
        if self.accepted and self._usage().estimated:
            secs["usage_estimated"] = 1.0
            log.info(
                "request %s: model %s sent no usage; billed %d prompt + %d completion tokens counted here "
                "(estimated)",
                self.req.request_id,
                self.model.name,
                ended.prompt_tokens or 0,
                ended.completion_tokens,
            )
        prompt = (ended.prompt_tokens or 0) if self.accepted else 0
        tokens = {"prompt_tokens": prompt, "completion_tokens": ended.completion_tokens}
        try:
            res.finish(
                **tokens,
                cached_tokens=ended.cached_tokens or 0,
                finish_reason=ended.reason,
                status=ended.status,
                timings=secs,
                model=self.req.model,
            )
        except Exception:  # noqa: BLE001 - billing bookkeeping must not break the response
            log.exception("reservation.finish failed")


async def run_upstream(
    gw: Services, model: OpenAIUpstream, call: UpstreamCall, req: GenerationRequest, sink: EventSink
) -> None:
    """Run ``call`` against ``model`` to its end, pushing ``req``'s events into ``sink`` (order:
    ``gateway.generation.events``).

    Raises:
        RateLimited: 429 at admission, or the upstream's 429 (with its ``retry-after``), before ``Started``.
        UpstreamUnavailable: 503, no URL reachable. UpstreamError: 502, the upstream failed (after
            ``Started`` the renderer reports it in its own framing).
        APIError: the upstream's 4xx, same status and message.
        trio.Cancelled: the client went away (the upstream request is closed; billed with status 499).
    """
    await _UpstreamRun(gw, model, call, req, sink).run()
