"""One generation request, from validated input to OpenAI-shaped output (chat and legacy completions).

``Generation`` owns the per-request text pipeline (plain objects owned by the
handler task): per choice an ``IncrementalDetokenizer`` -> ``StopMatcher``
(text that may start a stop string is held back, a stop split across tokens
is still found), token counting, logprobs, and the final usage/timings. Per
engine step the work is O(new tokens): no re-decoding, no growing windows.

Producers (``stream`` / ``complete``) run inside ``CallResponse``: they pick a
backend, submit, and read the request's channel. Leaving the ``with handle``
block early (stop string matched, client gone, error) sends ``Abort``.

finish_reason rules: a stop string seen in the text is "stop" even when
the backend reported "length" for the same step; backend "stop" (EOS or a
stop token id) is "stop"; "length" is "length". Backend "abort"/"error" and
a lost backend end the request with an error (503/500 before the first
event, an error event after).

Timings (extension field ``timings``, nanoseconds, Ollama names):
``prompt_eval_count``, ``eval_count`` (tokens), ``queue_duration``,
``prompt_eval_duration``, ``eval_duration`` and ``backend_ttft_duration`` (from
the backend's ``Timings``), ``ttft_duration`` (gateway: request arrival ->
first token sent) and ``total_duration`` (gateway: arrival -> end).
"""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import trio

from backend.protocol import RequestOutput, SamplingParams, Submit, Timings
from gateway.backends.request import BackendUnavailable, RequestHandle
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import APIError, InternalError
from gateway.schemas import (
    ChatChoiceOut,
    ChatChunk,
    ChatCompletion,
    ChatMessageOut,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    PromptTokensDetails,
    TokenLogprobOut,
    TopLogprob,
    UsageOut,
    encode,
)
from gateway.stops import StopMatcher
from gateway.streaming import DONE, ResponseWriter

_NS = 1_000_000_000


def _ns(seconds: float) -> int:
    return int(seconds * _NS)


class NullReservation:
    """Stands in for a tenancy reservation when no tenancy is configured: no headers, ``finish`` ignored."""

    headers: dict[str, str] = {}

    def finish(self, **kw: Any) -> None:
        pass


@asynccontextmanager
async def _no_admission():
    yield NullReservation()


class ChoiceState:
    """Text pipeline and counters of one choice."""

    __slots__ = (
        "index",
        "detok",
        "stops",
        "parts",
        "tokens",
        "finish",
        "usage",
        "timings",
        "lp",
        "offset",
        "of",
    )

    def __init__(self, index: int, detok: IncrementalDetokenizer, stops: StopMatcher, of: Any = None) -> None:
        self.index = index
        self.of = of  # the tenant's output filter (gateway.filters.OutputFilter) or None
        self.detok = detok
        self.stops = stops
        self.parts: list[str] = []  # emitted text (kept for non-streaming and completions offsets)
        self.tokens = 0  # tokens received for this choice
        self.finish: str | None = None  # set once: the choice is over for the client
        self.usage = None
        self.timings: Timings | None = None
        self.lp: list | None = None  # accumulated logprob entries (non-streaming)
        self.offset = 0  # characters emitted so far (completions text_offset)


class Generation:
    """Everything one request needs after validation. See the module docstring.

    Args:
        gw: the ``Gateway`` (pool, tokenizer, config).
        kind: "chat" or "completion".
        prompt_ids: prompt token ids.
        sampling: backend sampling parameters (max_tokens already resolved).
        stops: normalized stop strings; include_stop: keep the matched stop string.
        logprobs: "chat" (OpenAI chat shape), "completion" (legacy shape) or None.
        include_usage: streaming only: send the usage chunk before [DONE].
        admission: ``admission(request_id)`` -> async context manager yielding a reservation (tenancy), or None.
        output_filter: ``output_filter()`` -> a new per-choice output filter (gateway.filters) or None, or None.
        record: the observability ``RequestRecord`` or None.
    """

    def __init__(
        self,
        gw: Any,
        *,
        kind: str,
        model: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        stops: list[str],
        include_stop: bool,
        logprobs: str | None,
        include_usage: bool,
        cache_salt: str = "",
        admission: Any = None,
        record: Any = None,
        t_arrival: float | None = None,
        output_filter: Any = None,
    ) -> None:
        self.gw = gw
        self.kind = kind
        self.model = model
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.n = sampling.n
        self.stop_list = stops
        self.include_stop = include_stop
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.cache_salt = cache_salt
        self.admission = admission
        self.record = record
        self.t_arrival = t_arrival if t_arrival is not None else time.perf_counter()
        self.t_first: float | None = None
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        tok = gw.tokenizer
        self.choices = [
            ChoiceState(
                i,
                IncrementalDetokenizer(tok.id_to_bytes, tok.special_ids),
                StopMatcher(stops, include_stop_str_in_output=include_stop),
                output_filter() if output_filter is not None else None,
            )
            for i in range(self.n)
        ]
        self.open = self.n  # choices not finished (client's view)
        self.cached_tokens = 0
        self.submitted = False
        self.t_submit: float | None = None  # Submit queued (perf_counter)
        self.t_first_rx: float | None = None  # first output's frame decoded
        self.t_first_sent: float | None = None  # first content event handed to the server
        self.filtered = any(st.of is not None for st in self.choices)

    # ------------------------------------------------------------------ per output
    def apply(self, out: RequestOutput) -> tuple[ChoiceState | None, str, list | None, str | None]:
        """Feed one backend output. Returns ``(choice, text_to_emit, logprob_items, finish_reason)``;
        choice is None when the output belongs to a choice already finished (ignored).

        Raises:
            BackendUnavailable / InternalError: the backend ended the choice with "abort"/"error".
        """
        st = self.choices[out.index] if 0 <= out.index < self.n else None
        if st is None or st.finish is not None:
            return None, "", None, None
        ids = out.new_token_ids
        text = ""
        fin: str | None = None
        if ids:
            st.tokens += len(ids)
            delta = st.detok.feed_many(ids)
            text, matched = st.stops.feed(delta)
            if matched:
                fin = "stop"
        if fin is None and out.finish_reason is not None:
            r = out.finish_reason
            if r == "abort":
                raise BackendUnavailable("The request was aborted by the inference backend.")
            if r == "error":
                raise InternalError("The inference backend failed while generating.", code="backend_error")
            tail, matched = st.stops.feed(st.detok.flush())
            text += tail
            if not matched:
                text += st.stops.flush()
            fin = "stop" if matched or r == "stop" else "length"
        lps = None
        if self.logprobs is not None and out.logprobs:
            lps = out.logprobs
        if out.usage is not None:
            st.usage = out.usage
            self.cached_tokens = max(self.cached_tokens, out.usage.cached_tokens)
        if out.timings is not None:
            st.timings = out.timings
        if fin is not None and out.finish_reason is None:
            self._stop_backend_choice(st)  # a stop string ended it; the backend would go on decoding it
        if st.of is None:
            if text:
                st.parts.append(text)
            if fin is not None:
                st.finish = fin
                self.open -= 1
        rec = self.record
        if rec is not None:
            try:
                if ids:
                    rec.on_tokens(len(ids), text=text or None)
                if fin is not None:
                    rec.on_finish(fin, out.usage, out.timings)
            except Exception:  # noqa: BLE001 - observability must never break a request
                pass
        if ids and self.t_first is None:
            self.t_first = time.perf_counter()
        return st, text, lps, fin

    def _stop_backend_choice(self, st: ChoiceState) -> None:
        """For n > 1: the gateway ended choice ``st`` (stop string, content filter) while the backend still
        decodes it; stop that choice there so it frees its KV blocks (n == 1: closing the handle aborts the
        whole request as soon as the response ends)."""
        h = getattr(self, "_handle", None)
        if self.n > 1 and h is not None and st.finish is None:
            h.abort_choice(st.index)

    async def filt(self, st: ChoiceState, text: str, fin: str | None) -> tuple[str, str | None]:
        """Pass a choice's text through its output filter (content filters, Azure semantics): returns the
        text safe to send now and the finish reason ("content_filter" when the filter cut the output)."""
        of = st.of
        if st.finish is not None:
            return "", None
        safe = await of.step(text, fin is not None)
        if of.cut:
            fin = "content_filter"
            self._stop_backend_choice(st)
        if safe:
            st.parts.append(safe)
        if fin is not None:
            st.finish = fin
            self.open -= 1
        return safe, fin

    # ------------------------------------------------------------------ shapes
    def _token_str(self, tid: int) -> str:
        return self.gw.token_str(tid)

    def chat_logprobs(self, items) -> list[TokenLogprobOut]:
        tb = self.gw.tokenizer.id_to_bytes
        out = []
        for it in items:
            top = [
                TopLogprob(self._token_str(t), lp, list(tb[t]))
                for t, lp in (it.top or [])[: self.sampling.top_logprobs]
            ]
            out.append(TokenLogprobOut(self._token_str(it.token_id), it.logprob, list(tb[it.token_id]), top))
        return out

    def completion_logprobs(self, items, st: ChoiceState) -> CompletionLogprobs:
        toks, lps, tops, offs = [], [], [], []
        k = self.sampling.top_logprobs
        for it in items:
            s = self._token_str(it.token_id)
            toks.append(s)
            lps.append(it.logprob)
            tops.append({self._token_str(t): lp for t, lp in (it.top or [])[:k]} if k else {})
            offs.append(st.offset)
        return CompletionLogprobs(toks, lps, tops if k else None, offs)

    def usage(self) -> UsageOut:
        p = len(self.prompt_ids)
        c = 0
        for st in self.choices:
            if st.usage is not None and st.stops.matched_stop is None:
                c += max(st.usage.completion_tokens, st.tokens)
            else:
                c += st.tokens
        return UsageOut(
            prompt_tokens=p,
            completion_tokens=c,
            total_tokens=p + c,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )

    def timings(self, st: ChoiceState | None = None) -> dict[str, int]:
        now = time.perf_counter()
        states = [st] if st is not None else self.choices
        d: dict[str, int] = {
            "prompt_eval_count": len(self.prompt_ids),
            "eval_count": sum(s.tokens for s in states),
        }
        tms = [s.timings for s in states if s.timings is not None]
        if tms:
            d["queue_duration"] = _ns(max(t.queue for t in tms))
            d["prompt_eval_duration"] = _ns(max(t.prefill for t in tms))
            d["eval_duration"] = _ns(max(t.decode for t in tms))
            d["backend_ttft_duration"] = _ns(min(t.ttft for t in tms))
        if self.t_first is not None:
            d["ttft_duration"] = _ns(self.t_first - self.t_arrival)
        if self.t_submit is not None:
            d["gateway_prep_duration"] = _ns(self.t_submit - self.t_arrival)
            h = getattr(self, "_handle", None)
            rx = h.first_rx if h is not None else None
            if rx is not None and self.t_first_sent is not None:
                d["gateway_overhead_duration"] = _ns(
                    (self.t_submit - self.t_arrival) + (self.t_first_sent - rx)
                )
        d["total_duration"] = _ns(now - self.t_arrival)
        return d

    def _chunk(self, choices: list, **kw: Any) -> bytes:
        if self.kind == "chat":
            return encode(
                ChatChunk(
                    id=self.id,
                    object="chat.completion.chunk",
                    created=self.created,
                    model=self.model,
                    choices=choices,
                    **kw,
                )
            )
        return encode(
            Completion(
                id=self.id,
                object="text_completion",
                created=self.created,
                model=self.model,
                choices=choices,
                **kw,
            )
        )

    def _delta_chunk(self, st: ChoiceState, text: str, lps: list | None) -> bytes:
        if self.kind == "chat":
            lp = ChoiceLogprobs(self.chat_logprobs(lps)) if lps is not None else None
            return self._chunk([ChunkChoice(st.index, Delta(content=text), lp, None)])
        lp = self.completion_logprobs(lps, st) if lps is not None else None
        st.offset += len(text)
        return self._chunk([CompletionChoice(st.index, text, lp, None)])

    def _finish_chunk(self, st: ChoiceState) -> bytes:
        if st.finish == "content_filter" and st.of is not None and st.of.result:
            obj = msgspec.to_builtins(
                ChatChunk(
                    id=self.id,
                    object="chat.completion.chunk",
                    created=self.created,
                    model=self.model,
                    choices=[ChunkChoice(st.index, Delta(), None, st.finish)],
                    timings=self.timings(st),
                )
            )
            if self.kind != "chat":
                obj = msgspec.to_builtins(
                    Completion(
                        id=self.id,
                        object="text_completion",
                        created=self.created,
                        model=self.model,
                        choices=[CompletionChoice(st.index, "", None, st.finish)],
                        timings=self.timings(st),
                    )
                )
            obj["choices"][0]["content_filter_results"] = st.of.result
            return encode(obj)
        if self.kind == "chat":
            return self._chunk([ChunkChoice(st.index, Delta(), None, st.finish)], timings=self.timings(st))
        return self._chunk([CompletionChoice(st.index, "", None, st.finish)], timings=self.timings(st))

    # ------------------------------------------------------------------ producers
    def _submit(self) -> Submit:
        return Submit(
            request_id=self.id,
            prompt_ids=self.prompt_ids,
            sampling=self.sampling,
            cache_salt=self.cache_salt,
            arrival_time=time.time(),
        )

    def _admission(self):
        return self.admission(self.id) if self.admission is not None else _no_admission()

    def _finish_reservation(self, res: Any, status: int) -> None:
        """Tell tenancy what to bill: completion tokens so far (all choices), cached tokens, finish reason,
        HTTP-like status (200 ok, 499 client gone, else the error's status), timings in seconds.
        A request that never reached the backend bills nothing (prompt_tokens=0)."""
        try:
            u = self.usage()
            t = self.timings()
            secs = {"total_s": t["total_duration"] / _NS}
            if "ttft_duration" in t:
                secs["ttft_s"] = t["ttft_duration"] / _NS
            if "backend_ttft_duration" in t:
                secs["backend_ttft_s"] = t["backend_ttft_duration"] / _NS
            kw: dict[str, Any] = {}
            if not self.submitted:
                kw["prompt_tokens"] = 0
            res.finish(
                completion_tokens=u.completion_tokens,
                cached_tokens=u.prompt_tokens_details.cached_tokens,
                finish_reason=self.final_reason()
                or ("abort" if status == 499 else "error" if status != 200 else None),
                status=status,
                timings=secs,
                model=self.model,
                **kw,
            )
        except Exception:  # noqa: BLE001 - billing bookkeeping must not break the response
            import logging

            logging.getLogger("gateway").exception("reservation.finish failed")

    def final_reason(self) -> str | None:
        for st in reversed(self.choices):
            if st.finish is not None:
                return st.finish
        return None

    async def _start_request(self) -> RequestHandle:
        client = await self.gw.pool.pick()
        if self.record is not None:
            try:
                self.record.on_submit(len(self.prompt_ids))
            except Exception:  # noqa: BLE001
                pass
        handle = client.open_request(self._submit())
        self.submitted = True
        self.t_submit = handle.submitted_at
        self._handle = handle
        return handle

    async def stream(self, w: ResponseWriter) -> None:
        """Producer for ``stream: true``: SSE chunks, heartbeats, optional usage chunk, [DONE]."""
        hb = self.gw.config.heartbeat_s
        status = 500
        async with self._admission() as res:
            try:
                with await self._start_request() as handle:
                    # Hold the status line back briefly so that an early backend error can still be a 4xx/5xx.
                    first: RequestOutput | None | bool = False
                    with trio.move_on_after(hb):
                        first = await handle.next()
                    await w.start(res.headers)
                    prefix = (
                        b""  # the role chunk travels in the same write as the first content (one send less)
                    )
                    if self.kind == "chat":
                        role = [
                            ChunkChoice(i, Delta(role="assistant", content=""), None, None)
                            for i in range(self.n)
                        ]
                        prefix = b"data: " + self._chunk(role) + b"\n\n"
                        if first is False:
                            await w.raw(prefix)
                            prefix = b""
                    pending = first
                    while self.open > 0:
                        if pending is False:  # nothing yet: wait, with heartbeats
                            out: RequestOutput | None | bool = False
                            try:
                                out = handle.receive_nowait()
                            except trio.WouldBlock:
                                with trio.move_on_after(hb):
                                    out = await handle.next()
                                if out is False:
                                    if prefix:
                                        await w.raw(prefix)
                                        prefix = b""
                                    await w.ping()
                                    continue
                        else:
                            out, pending = pending, False
                        if out is None:
                            raise InternalError(
                                "The inference backend ended the request without finishing it.",
                                code="backend_error",
                            )
                        st, text, lps, fin = self.apply(out)  # type: ignore[arg-type]
                        if st is None:
                            continue
                        if st.of is not None:
                            text, fin = await self.filt(st, text, fin)
                        if text or lps:
                            await w.raw(prefix + b"data: " + self._delta_chunk(st, text, lps) + b"\n\n")
                            prefix = b""
                            if self.t_first_sent is None and text:
                                self.t_first_sent = time.perf_counter()
                        if fin is not None:
                            await w.raw(prefix + b"data: " + self._finish_chunk(st) + b"\n\n")
                            prefix = b""
                status = 200
                if self.include_usage:
                    await w.event(self._chunk([], usage=self.usage(), timings=self.timings()))
                await w.done()
            except APIError as exc:
                status = exc.status
                await w.error(exc)
            except trio.Cancelled:
                status = 499  # the client went away
                raise
            finally:
                with trio.CancelScope(shield=True):
                    self._finish_reservation(res, status)

    async def collect(self) -> None:
        """Run to the end without sending anything (non-streaming)."""
        with await self._start_request() as handle:
            while self.open > 0:
                out = await handle.next()
                if out is None:
                    raise InternalError(
                        "The inference backend ended the request without finishing it.", code="backend_error"
                    )
                st, text, lps, fin = self.apply(out)
                if st is not None and st.of is not None:
                    text, fin = await self.filt(st, text, fin)
                if st is not None and lps is not None:
                    if st.lp is None:
                        st.lp = []
                    if self.kind == "chat":
                        st.lp.extend(self.chat_logprobs(lps))
                    else:
                        st.lp.append((self.completion_logprobs(lps, st), st.offset))
                    st.offset += len(text)
                elif st is not None:
                    st.offset += len(text)

    async def complete(self, w: ResponseWriter) -> None:
        """Producer for non-streaming requests: one JSON body with every choice, usage and timings."""
        status = 500
        async with self._admission() as res:
            try:
                await self.collect()
                status = 200
                await w.json(200, self.body(), res.headers)
            except APIError as exc:
                status = exc.status
                await w.error(exc)
            except trio.Cancelled:
                status = 499  # the client went away
                raise
            finally:
                with trio.CancelScope(shield=True):
                    self._finish_reservation(res, status)

    def body(self) -> Any:
        if self.kind == "chat":
            choices = []
            for st in self.choices:
                lp = ChoiceLogprobs(st.lp or []) if self.logprobs is not None else None
                choices.append(
                    ChatChoiceOut(st.index, ChatMessageOut("assistant", "".join(st.parts)), lp, st.finish)
                )
            return ChatCompletion(
                id=self.id,
                object="chat.completion",
                created=self.created,
                model=self.model,
                choices=choices,
                usage=self.usage(),
                timings=self.timings(),
            )
        choices = []
        for st in self.choices:
            lp = None
            if self.logprobs is not None:
                toks, lps, tops, offs = [], [], [], []
                for part, _ in st.lp or []:
                    toks += part.tokens
                    lps += part.token_logprobs
                    if part.top_logprobs is not None:
                        tops += part.top_logprobs
                    offs += part.text_offset
                lp = CompletionLogprobs(toks, lps, tops if self.sampling.top_logprobs else None, offs)
            choices.append(CompletionChoice(st.index, "".join(st.parts), lp, st.finish))
        return Completion(
            id=self.id,
            object="text_completion",
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage(),
            timings=self.timings(),
        )


__all__ = ["Generation", "NullReservation", "DONE"]
