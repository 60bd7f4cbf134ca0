"""OpenAI non-streaming renderers: a run's events -> one ``chat.completion`` / ``text_completion`` JSON body.

Text and logprobs are gathered per choice from ``TextDelta``; each choice's ``finish_reason`` from its
``ChoiceFinished``; ``Completed`` sends the body (``usage``, ``timings`` extension in ns) with status 200
and the headers of ``Started`` (x-ratelimit-*). Heartbeats send nothing. An error at any point is a plain
JSON error with its status (nothing was sent before).
"""

from __future__ import annotations

from gateway.generation.events import ChoiceFinished, Completed, Event, Started, TextDelta
from gateway.generation.request import GenerationRequest
from gateway.openai.logprobs import (
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
)
from gateway.openai.renderer import OpenAIRenderer, usage_out
from gateway.openai.schemas import (
    ChatChoiceOut,
    ChatCompletion,
    ChatMessageOut,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCallOut,
    TokenLogprobOut,
    ToolCallOut,
)
from gateway.streaming import ResponseWriter
from gateway.tools.assemble import ToolCallAssembler


class _BodyRenderer(OpenAIRenderer):
    """Gathers text and finish reasons per choice; subclasses gather logprobs and build the body."""

    def __init__(self, names: TokenNames, req: GenerationRequest, w: ResponseWriter) -> None:
        super().__init__(names, req, w)
        self.parts: list[list[str]] = [[] for _ in range(self.n)]
        self.chars = [0] * self.n  # characters gathered per choice
        self.calls = [ToolCallAssembler() for _ in range(self.n)]

    def text(self, index: int) -> str:
        return "".join(self.parts[index])

    def add_logprobs(self, ev: TextDelta) -> None:
        raise NotImplementedError

    def body(self, ev: Completed) -> ChatCompletion | Completion:
        raise NotImplementedError

    async def emit(self, event: Event) -> None:
        if isinstance(event, TextDelta):
            if event.logprobs is not None:
                self.add_logprobs(event)
            if event.text:
                self.parts[event.index].append(event.text)
                self.chars[event.index] += len(event.text)
            if event.tool_calls:
                self.calls[event.index].add(event.tool_calls)
        elif isinstance(event, ChoiceFinished):
            self.reasons[event.index] = event.reason
        elif isinstance(event, Started):
            self.headers = event.headers
        elif isinstance(event, Completed):
            await self.w.json(200, self.body(event), self.headers)


class ChatBody(_BodyRenderer):
    """``stream: false`` on /v1/chat/completions."""

    def __init__(self, names: TokenNames, req: GenerationRequest, w: ResponseWriter) -> None:
        super().__init__(names, req, w)
        self.lps: list[list[TokenLogprobOut]] = [[] for _ in range(self.n)]

    def add_logprobs(self, ev: TextDelta) -> None:
        self.lps[ev.index].extend(chat_logprobs(self.names, ev.logprobs or [], self.k))

    def message(self, i: int) -> ChatMessageOut:
        """Choice ``i``'s message: its text, and its tool calls when it made any (content null when the
        model wrote nothing but calls, as OpenAI)."""
        text = self.text(i)
        if not self.calls[i]:
            return ChatMessageOut("assistant", text, None)
        calls = [
            ToolCallOut(c.id, "function", FunctionCallOut(c.name, c.arguments)) for c in self.calls[i].calls()
        ]
        return ChatMessageOut("assistant", text if text.strip() else None, None, calls)

    def body(self, ev: Completed) -> ChatCompletion:
        choices = [
            ChatChoiceOut(
                i,
                self.message(i),
                ChoiceLogprobs(self.lps[i]) if self.logprobs else None,
                self.reasons[i],
            )
            for i in range(self.n)
        ]
        return ChatCompletion(
            id=self.id,
            object="chat.completion",
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage_out(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens),
            timings=ev.timings,
        )


class CompletionBody(_BodyRenderer):
    """``stream: false`` on /v1/completions (legacy)."""

    def __init__(self, names: TokenNames, req: GenerationRequest, w: ResponseWriter) -> None:
        super().__init__(names, req, w)
        self.lps: list[list[CompletionLogprobs]] = [[] for _ in range(self.n)]

    def add_logprobs(self, ev: TextDelta) -> None:
        offset = self.chars[ev.index]
        self.lps[ev.index].append(
            completion_logprobs(self.names, ev.logprobs or [], self.k, offset, ev.offsets)
        )

    def body(self, ev: Completed) -> Completion:
        choices = [
            CompletionChoice(
                i,
                self.text(i),
                merge_completion_logprobs(self.lps[i], self.k) if self.logprobs else None,
                self.reasons[i],
            )
            for i in range(self.n)
        ]
        usage = usage_out(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens)
        return self.completion(choices, usage=usage, timings=ev.timings)
