"""One generation run: a ``GenerationRequest`` in, typed events (``gateway.generation.events``) out.

``run_generation(gw, req, sink)`` does, in order: admission (the tenant's reservation of prompt +
max_tokens * n tokens; ``RateLimited`` 429) -> backend pick (``ServiceUnavailable`` 503) -> ``Submit`` ->
per output: the choice's text pipeline (``gateway.generation.choice``) -> events into ``sink``. It knows
no API: renderers (OpenAI chunks or JSON, Ollama NDJSON or JSON) turn the events into bytes.

The status line is held back until the backend's first output or ``heartbeat_s`` (``Started``), so that an
early backend error is still a plain HTTP error; afterwards a ``Heartbeat`` goes out whenever nothing
arrived for ``heartbeat_s``. Leaving the ``with handle`` block (every choice finished, stop string, client
gone, error) aborts what the backend still runs. With n > 1 a choice the gateway ends (stop string,
content filter) is aborted alone so that it frees its KV blocks.

Completion tokens are counted here only: ``Choice.completion_tokens`` is what the response's usage reports
(the tokens the client was given), and the count billed is ``RequestHandle.generated_tokens``, every token the
backend generated for the request, taken where the outputs arrive: tokens a slow or gone reader never got,
and those sampled after the gateway ended a choice (stop string, content filter) or the request, included.
After the ``with handle`` block the run waits (cancel-shielded, at most ``SETTLE_TIMEOUT_S``) for the
backend's final output of every choice, which carries its own count, so the figure is exact. The request's
finish reason ("abort" when the client went away before any choice finished, "error" after an error) and
why an aborted request ended (``Ended.abort_reason``: "client_disconnect" or "slow_reader") are decided here
only (``_Run.reason``, ``_Run._ended_by``). A streaming client that stops reading is stopped after
``backend.max_backlog_tokens`` unread tokens of a choice (``gateway.backends.request``) and ends as 499
"abort", never as a server error. Billing (``Reservation.finish``: usage ledger, the TPM true-up and the
daily quota) and the ``Ended`` event both run in cancel-shielded cleanup on every exit.

Timings (nanoseconds, Ollama names): ``prompt_eval_count``, ``eval_count`` (tokens),
``queue_duration``, ``prompt_eval_duration``, ``eval_duration``, ``backend_ttft_duration`` and the
speculative decoding's ``draft_tokens`` / ``accepted_tokens`` (tokens, summed over choices), all from the
backend's ``Timings``; ``ttft_duration`` (gateway: arrival -> first token), ``gateway_prep_duration``
(arrival -> Submit queued), ``gateway_overhead_duration`` (stream only: the gateway's own share of TTFT)
and ``total_duration`` (arrival -> now).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import msgspec
import trio

from backend.protocol import FEATURE_GRAMMAR, RequestOutput, Submit
from gateway.backends.request import RequestHandle, SlowConsumer
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import APIError, InternalError, InvalidRequest
from gateway.generation.choice import Choice
from gateway.generation.events import (
    ChoiceFinished,
    Completed,
    Ended,
    Event,
    EventSink,
    Heartbeat,
    Started,
    TextDelta,
)
from gateway.generation.request import GenerationRequest
from gateway.state import Gateway
from gateway.stops import StopMatcher
from ratelimit.reservation import Reservation

log = logging.getLogger("gateway")

_NS = 1_000_000_000
SETTLE_TIMEOUT_S = 5.0  # seconds an ended run waits for the backend's final count (one engine step normally)


def _ns(seconds: float) -> int:
    return int(seconds * _NS)


@asynccontextmanager
async def _no_admission() -> AsyncIterator[None]:
    yield None  # no tenancy: nothing reserved, nothing billed


class _Nothing:
    """Nothing arrived within the heartbeat interval."""


NOTHING = _Nothing()


class _Run:
    """The state of one run (owned by the handler task). See the module docstring."""

    def __init__(self, gw: Gateway, req: GenerationRequest, sink: EventSink) -> None:
        self.gw = gw
        self.req = req
        self.sink = sink
        self.model = req.served if req.served is not None else gw.catalog.default
        tok, _ = self.model.text()
        make_filter = gw.output_filter(req.principal)
        self.choices = [
            Choice(
                i,
                IncrementalDetokenizer(
                    tok.id_to_bytes, tok.special_ids, skip_special_tokens=req.skip_special_tokens
                ),
                StopMatcher(req.stops, include_stop_str_in_output=req.include_stop),
                make_filter() if make_filter is not None else None,
                req.tool_parser() if req.tool_parser is not None else None,
            )
            for i in range(req.sampling.n)
        ]
        self.open = req.sampling.n  # choices not finished
        self.last_reason: str | None = None  # of the last choice to finish
        self.cached_tokens: int | None = None
        self.handle: RequestHandle | None = None
        self.t_submit: float | None = None  # Submit queued (perf_counter)
        self.t_first: float | None = None  # first token received
        self.t_first_sent: float | None = None  # first text handed to a streaming renderer

    # ------------------------------------------------------------------ counts
    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def reason(self, status: int) -> str:
        """The request's finish reason (see ``Ended``)."""
        if any(c.cut for c in self.choices):
            return "content_filter"
        if self.last_reason is not None:
            return self.last_reason
        return "abort" if status == 499 else "error"

    def timings(self, choice: Choice | None = None) -> dict[str, int]:
        """Timings (ns) of one choice, or of the whole request (None)."""
        now = time.perf_counter()
        states = [choice] if choice is not None else self.choices
        d: dict[str, int] = {
            "prompt_eval_count": len(self.req.prompt_ids),
            "eval_count": sum(s.tokens for s in states),
        }
        tms = [s.timings for s in states if s.timings is not None]
        if tms:
            d["queue_duration"] = _ns(max(t.queue for t in tms))
            d["prompt_eval_duration"] = _ns(max(t.prefill for t in tms))
            d["eval_duration"] = _ns(max(t.decode for t in tms))
            d["backend_ttft_duration"] = _ns(min(t.ttft for t in tms))
            d["draft_tokens"] = sum(t.draft_tokens for t in tms)
            d["accepted_tokens"] = sum(t.accepted_tokens for t in tms)
        t0 = self.req.t_arrival
        if self.t_first is not None:
            d["ttft_duration"] = _ns(self.t_first - t0)
        if self.t_submit is not None:
            d["gateway_prep_duration"] = _ns(self.t_submit - t0)
            rx = self.handle.first_rx if self.handle is not None else None
            if rx is not None and self.t_first_sent is not None:
                d["gateway_overhead_duration"] = _ns((self.t_submit - t0) + (self.t_first_sent - rx))
        d["total_duration"] = _ns(now - t0)
        return d

    # ------------------------------------------------------------------ the run
    def _admission(self) -> AbstractAsyncContextManager[Reservation | None]:
        req = self.req
        admit = self.gw.admission(
            req.principal,
            len(req.prompt_ids),
            req.sampling.max_tokens * req.sampling.n,
            req.served_name,
            counted=req.counted,
        )
        return admit(req.request_id) if admit is not None else _no_admission()

    async def run(self) -> None:
        ended: Ended | None = None
        try:
            async with self._admission() as res:
                try:
                    await self._generate(res.headers if res is not None else {})
                    ended = self._ended(200, None)
                except BaseException as exc:
                    ended = self._ended_by(exc)
                    raise
                finally:
                    if ended is not None:
                        ended = await self._settle(ended)
                    if res is not None and ended is not None:  # synchronous: nothing can cancel it
                        self._bill(res, ended)
        except BaseException as exc:
            if ended is None:  # refused at admission (429, 503)
                ended = self._ended_by(exc)
            raise
        finally:
            with trio.CancelScope(shield=True):
                await self.sink.emit(ended or self._ended(500, None))

    async def _settle(self, ended: Ended) -> Ended:
        """``ended`` with the exact count billed: wait (cancel-shielded, at most ``SETTLE_TIMEOUT_S``) until
        the backend reported the last of the request's tokens, then take ``RequestHandle.generated_tokens``."""
        h = self.handle
        if h is None:
            return ended
        with trio.CancelScope(shield=True):
            if not await h.wait_settled(SETTLE_TIMEOUT_S):
                log.warning(
                    "request %s: no final count from the backend; billing the tokens received", h.request_id
                )
        return msgspec.structs.replace(ended, completion_tokens=h.generated_tokens)

    async def _emit(self, event: Event) -> None:
        """Hand ``event`` to the sink; meanwhile the handle knows that its consumer waits on its client (a
        stream's write blocks while the client does not read), so the backlog rule applies."""
        if self.handle is None:
            await self.sink.emit(event)
            return
        with self.handle.sending_to_client():
            await self.sink.emit(event)

    async def _next(self, handle: RequestHandle) -> RequestOutput | None | _Nothing:
        """The next output (None: the backend ended the request), or NOTHING after ``heartbeat_s``."""
        try:
            return handle.receive_nowait()
        except trio.WouldBlock:
            pass
        with trio.move_on_after(self.gw.config.sse_heartbeat):
            return await handle.next()
        return NOTHING

    async def _generate(self, headers: dict[str, str]) -> None:
        req = self.req
        for check in req.grammar_checks:  # after admission: rate limits bound what a tenant can ask for
            await self.model.grammars.check(
                check.grammar, check.param, schemas=check.schemas, tenant=req.tenant_id
            )
        pool = self.model.pool
        if pool is None:
            raise InternalError(f"The model {req.model!r} has no inference backend in this gateway.")
        client = await pool.pick(req.prompt_ids, req.tenant_id)  # routed by prompt start and cache salt
        if req.grammar is not None and FEATURE_GRAMMAR not in client.ready.features:
            param = req.grammar_param or "response_format"
            raise InvalidRequest(
                f"'{param}' is not supported by the inference backend serving {req.model!r}.",
                param=param,
                code="unsupported_parameter",
            )
        submit = Submit(
            request_id=req.request_id,
            prompt_ids=req.prompt_ids,
            sampling=req.sampling,
            cache_salt=req.tenant_id,
            arrival_time=time.time(),
            grammar=req.grammar,
            inspect=req.inspect,
        )
        with client.open_request(submit, max_backlog=self.gw.settings.backend.max_backlog_tokens) as handle:
            self.handle, self.t_submit = handle, handle.submitted_at
            # Hold the status line back briefly so that an early backend error can still be a 4xx/5xx.
            pending: RequestOutput | None | _Nothing = NOTHING
            with trio.move_on_after(self.gw.config.sse_heartbeat):
                pending = await handle.next()
            await self._emit(Started(headers=headers, waiting=pending is NOTHING))
            while self.open > 0:
                out, pending = (await self._next(handle) if pending is NOTHING else pending), NOTHING
                if isinstance(out, _Nothing):
                    await self._emit(Heartbeat())
                elif out is None:
                    raise InternalError(
                        "The inference backend ended the request without finishing it.", code="backend_error"
                    )
                else:
                    await self._output(handle, out)
        await self.sink.emit(
            Completed(
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=self.completion_tokens,
                cached_tokens=self.cached_tokens or 0,
                timings=self.timings(),
            )
        )

    async def _output(self, handle: RequestHandle, out: RequestOutput) -> None:
        """One backend output: the choice's text pipeline, then its events."""
        ch = self.choices[out.index] if 0 <= out.index < len(self.choices) else None
        if ch is None or ch.finish is not None:
            return  # a choice the gateway already ended (its final "abort" output)
        text, calls, fin = await ch.feed(out)
        if out.usage is not None:
            self.cached_tokens = max(self.cached_tokens or 0, out.usage.cached_tokens)
        if out.new_token_ids and self.t_first is None:
            self.t_first = time.perf_counter()
        if fin is not None and out.finish_reason is None and len(self.choices) > 1:
            handle.abort_choice(ch.index)  # the gateway ended it; the backend would go on decoding it
        lps = out.logprobs[: ch.consumed] if self.req.sampling.logprobs and out.logprobs else None
        if ch.consumed or text or lps or calls:
            await self._emit(
                TextDelta(
                    index=ch.index,
                    text=text,
                    tokens=ch.consumed,
                    logprobs=lps,
                    tool_calls=calls,
                    offsets=ch.offsets if lps else [],
                )
            )
            if (text or calls) and self.t_first_sent is None and self.req.stream:
                self.t_first_sent = time.perf_counter()
        if fin is not None:
            self.open -= 1
            self.last_reason = fin
            await self._emit(
                ChoiceFinished(
                    index=ch.index,
                    reason=fin,
                    completion_tokens=ch.completion_tokens,
                    timings=self.timings(ch),
                    content_filter_results=ch.filter.result if ch.cut and ch.filter is not None else None,
                    timeline=ch.timeline,
                )
            )

    # ------------------------------------------------------------------ cleanup
    def _ended_by(self, exc: BaseException) -> Ended:
        """The outcome of a run that ``exc`` ended: 499 when the client went away (trio.Cancelled; abort
        reason "slow_reader" if the request had been stopped for not being read, else "client_disconnect")
        or when a stream was stopped for not being read (``SlowConsumer``), the error's status for another
        ``APIError``, else 500."""
        if isinstance(exc, SlowConsumer) and self.req.stream:
            return self._ended(499, exc, abort="slow_reader")
        if isinstance(exc, APIError):
            return self._ended(exc.status, exc)
        if isinstance(exc, trio.Cancelled):
            slow = self.handle is not None and self.handle.slow
            return self._ended(499, None, abort="slow_reader" if slow else "client_disconnect")
        return self._ended(500, None)

    def _ended(self, status: int, error: APIError | None, abort: str | None = None) -> Ended:
        submitted = self.t_submit is not None
        return Ended(
            status=status,
            reason=self.reason(status),
            abort_reason=abort,
            submitted=submitted,
            prompt_tokens=len(self.req.prompt_ids) if submitted else None,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            timings=self.timings(),
            preemptions=max((c.timings.preemptions for c in self.choices if c.timings), default=0),
            error_type=error.type if error is not None else None,
            error_code=error.code if error is not None else None,
        )

    def _bill(self, res: Reservation, ended: Ended) -> None:
        """Tell the reservation what to bill: completion tokens (every token the backend generated, all
        choices: ``Ended.completion_tokens``), cached tokens, finish reason, status (200 ok, 499 client gone
        or not reading, else the error's), timings in seconds. A request that never reached the backend bills
        no prompt (prompt_tokens=0)."""
        t = ended.timings
        secs = {"total_s": t["total_duration"] / _NS}
        if "ttft_duration" in t:
            secs["ttft_s"] = t["ttft_duration"] / _NS
        if "backend_ttft_duration" in t:
            secs["backend_ttft_s"] = t["backend_ttft_duration"] / _NS
        try:
            res.finish(
                completion_tokens=ended.completion_tokens,
                cached_tokens=ended.cached_tokens or 0,
                finish_reason=ended.reason,
                status=ended.status,
                timings=secs,
                model=self.req.served_name,
                **({} if ended.submitted else {"prompt_tokens": 0}),
            )
        except Exception:  # noqa: BLE001 - billing bookkeeping must not break the response
            log.exception("reservation.finish failed")


async def run_generation(gw: Gateway, req: GenerationRequest, sink: EventSink) -> None:
    """Run ``req`` to its end, pushing its events into ``sink`` (order: ``gateway.generation.events``).

    Raises:
        RateLimited: 429 at admission (before ``Started``).
        ServiceUnavailable: 503, no backend ready (before ``Started``) or the backend went away.
        APIError: the backend rejected the request (e.g. 400) or failed (500); after ``Started`` the
            renderer reports it in its own framing.
        trio.Cancelled: the client went away (billed with status 499, every token generated counted).
    """
    if req.upstream is not None:  # a model of kind openai: gateway.upstream.run (the same events)
        return await req.upstream(sink)
    await _Run(gw, req, sink).run()
