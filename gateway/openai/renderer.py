"""What every OpenAI renderer shares: the response's identity (id, created, model), the usage object,
and error reporting through the ``ResponseWriter`` (a JSON error before anything was sent, an SSE error
event and ``[DONE]`` after)."""

from __future__ import annotations

import time

from gateway.errors import APIError
from gateway.generation.request import GenerationRequest
from gateway.openai.logprobs import TokenNames
from gateway.openai.schemas import (
    ChatChunk,
    ChunkChoice,
    Completion,
    CompletionChoice,
    PromptTokensDetails,
    UsageOut,
)
from gateway.streaming import ResponseWriter


def usage_out(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageOut:
    """OpenAI ``usage`` (tokens; ``prompt_tokens_details.cached_tokens``: served from the prefix cache)."""
    return UsageOut(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class OpenAIRenderer:
    """Base of the OpenAI renderers (``EventSink`` + ``fail``). ``created``: UNIX seconds at construction;
    ``k``: logprob alternatives asked."""

    def __init__(self, names: TokenNames, req: GenerationRequest, w: ResponseWriter) -> None:
        self.names = names
        self.w = w
        self.id = req.request_id
        self.created = int(time.time())
        self.model = req.model
        self.n = req.sampling.n
        self.logprobs = req.sampling.logprobs
        self.k = req.sampling.top_logprobs
        self.include_usage = req.include_usage
        self.headers: dict[str, str] = {}
        self.reasons: list[str | None] = [None] * self.n  # finish_reason per choice, once finished

    async def fail(self, exc: APIError) -> None:
        await self.w.error(exc)

    def chat_chunk(
        self,
        choices: list[ChunkChoice],
        *,
        usage: UsageOut | None = None,
        timings: dict[str, int] | None = None,
    ) -> ChatChunk:
        """A ``chat.completion.chunk`` of this response."""
        return ChatChunk(
            id=self.id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            timings=timings,
        )

    def completion(
        self,
        choices: list[CompletionChoice],
        *,
        usage: UsageOut | None = None,
        timings: dict[str, int] | None = None,
    ) -> Completion:
        """A ``text_completion`` of this response (a stream chunk or the whole body)."""
        return Completion(
            id=self.id,
            object="text_completion",
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            timings=timings,
        )
