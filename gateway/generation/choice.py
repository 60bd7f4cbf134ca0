"""The text pipeline of one choice: backend tokens -> UTF-8 text -> stop strings -> output filter.

``Choice.feed(out)`` takes one backend ``RequestOutput`` of its choice and returns the text now safe to
send and, once, the finish reason. Per output the work is O(new tokens): the detokenizer and the stop
matcher are incremental (docs/text.md), and text that may start a stop string is held back.

finish_reason rules: a stop string seen in the text is "stop" even when the backend reported "length" for
the same step; backend "stop" (EOS or a stop token id) is "stop"; "length" is "length"; an output filter
that cuts the text makes it "content_filter" (Azure OpenAI semantics, docs/filters.md). Backend "abort" and
"error" are not finish reasons: they raise.

With a tool-call parser (``gateway.tools``) the filtered text then goes through it: plain content and
tool-call pieces come out separately. A choice that stopped with complete calls and no call left open
finishes "tool_calls"; one cut by max_tokens stays "length" even inside a call.
"""

from __future__ import annotations

from typing import Protocol

from backend.protocol import RequestOutput, Timeline, Timings, Usage
from gateway.backends.request import BackendUnavailable
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import InternalError
from gateway.generation.events import FinishReason
from gateway.stops import StopMatcher
from gateway.tools.parser import ToolCallDelta, ToolParser


class OutputFilter(Protocol):
    """A per-choice output filter (``gateway.filters.OutputFilter``): ``step`` returns the text safe to
    send; ``cut`` is True once a hook cut the output (``result``: why, Azure's content_filter_results)."""

    cut: bool
    result: dict | None

    async def step(self, text: str, final: bool) -> str: ...


class Choice:
    """Text pipeline and counters of choice ``index``.

    Attributes:
        tokens: tokens received for this choice (until it finished).
        consumed: tokens of the last output that the choice took (an output may carry several, with
            speculative decoding; a stop string ends the choice at the token that completes it).
        offsets: per consumed token of the last output, the characters released before it within that
            output (before the output filter), so a token's text offset does not depend on how the
            backend grouped tokens into outputs.
        finish: the finish reason, set once; afterwards the choice ignores further outputs.
        usage, timings: the backend's, from its last output (None until then).
        timeline: the backend's ``Timeline`` of the choice, from its last output (None unless inspected).
    """

    __slots__ = (
        "index",
        "detok",
        "stops",
        "filter",
        "tools",
        "tokens",
        "consumed",
        "offsets",
        "finish",
        "usage",
        "timings",
        "timeline",
    )

    def __init__(
        self,
        index: int,
        detok: IncrementalDetokenizer,
        stops: StopMatcher,
        output_filter: OutputFilter | None,
        tools: ToolParser | None = None,
    ) -> None:
        self.index = index
        self.detok = detok
        self.stops = stops
        self.filter = output_filter
        self.tools = tools
        self.tokens = 0
        self.consumed = 0
        self.offsets: list[int] = []
        self.finish: FinishReason | None = None
        self.usage: Usage | None = None
        self.timings: Timings | None = None
        self.timeline: Timeline | None = None

    @property
    def cut(self) -> bool:
        """An output filter cut this choice."""
        return self.filter is not None and self.filter.cut

    @property
    def completion_tokens(self) -> int:
        """Tokens billed for this choice: the backend's count when it finished the choice itself (it may
        count a token the gateway never saw), else the tokens received."""
        if self.usage is not None and self.stops.matched_stop is None:
            return max(self.usage.completion_tokens, self.tokens)
        return self.tokens

    async def feed(self, out: RequestOutput) -> tuple[str, list[ToolCallDelta], FinishReason | None]:
        """Feed one output of this choice: ``(text safe to send, tool-call pieces, finish reason or None)``.

        Raises:
            BackendUnavailable: 503, the backend aborted the choice.
            InternalError: 500 ``backend_error``, the backend failed while generating.
            Whatever the output filter's hooks raise.
        """
        text = ""
        fin: FinishReason | None = None
        ids = out.new_token_ids
        self.consumed = 0
        self.offsets = []
        for t in ids:  # token by token: a stop string ends the choice at the token that completes it
            self.offsets.append(len(text))
            self.consumed += 1
            piece, matched = self.stops.feed(self.detok.feed(t))
            text += piece
            if matched:
                fin = "stop"
                break
        self.tokens += self.consumed
        if fin is None and out.finish_reason is not None:
            if out.finish_reason == "abort":
                raise BackendUnavailable("The request was aborted by the inference backend.")
            if out.finish_reason == "error":
                raise InternalError("The inference backend failed while generating.", code="backend_error")
            tail, matched = self.stops.feed(self.detok.flush())
            text += tail
            if not matched:
                text += self.stops.flush()
            fin = "stop" if matched or out.finish_reason == "stop" else "length"
        if out.usage is not None:
            self.usage = out.usage
        if out.timings is not None:
            self.timings = out.timings
        if out.timeline is not None:
            self.timeline = out.timeline
        if self.filter is not None:
            text = await self.filter.step(text, fin is not None)
            if self.filter.cut:
                fin = "content_filter"
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            if text:
                text, calls = self.tools.feed(text)
            if fin is not None:
                tail, more = self.tools.finish()
                text, calls = text + tail, calls + more
                if fin == "stop" and self.tools.calls and not self.tools.incomplete:
                    fin = "tool_calls"
        if fin is not None:
            self.finish = fin
        return text, calls, fin
