"""The request path's way into an upstream model: ``upstream_chat`` and ``upstream_completion`` prepare a
request (``gateway.upstream.call``) and bind its run (``gateway.upstream.run``) to it.

Each returns the ``GenerationRequest`` the API's renderer and the observers read, and ``run(sink)``, which
plays the role of ``run_generation(gw, req, sink)`` for it (the same events, the same errors)::

    greq, run = await upstream_chat(gw, model, chat, principal=p, api="openai", t_arrival=t)
    await run(Tee(renderer, observer))
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from auth.principal import Principal
from backend.protocol import Grammar
from gateway.generation.events import EventSink
from gateway.generation.request import GenerationRequest
from gateway.openai.schemas import ChatRequest, CompletionRequest
from gateway.upstream import call as calls
from gateway.upstream.model import OpenAIUpstream
from gateway.upstream.run import Services, run_upstream

Run = Callable[[EventSink], Awaitable[None]]


class Gateway(Services, calls.Services, Protocol):
    """What the request path hands in (``gateway.state.Gateway`` meets it)."""


def _bound(gw: Gateway, model: OpenAIUpstream, call: calls.UpstreamCall, req: GenerationRequest) -> Run:
    async def run(sink: EventSink) -> None:
        await run_upstream(gw, model, call, req, sink)

    return run


async def upstream_chat(
    gw: Gateway,
    model: OpenAIUpstream,
    req: ChatRequest,
    *,
    principal: Principal | None,
    api: calls.Api,
    t_arrival: float,
    request_id: str | None = None,
    constraint: tuple[Grammar, str] | None = None,
) -> tuple[GenerationRequest, Run]:
    """A chat request for ``model`` and its run. Raises as ``call.chat_call`` (400s) before anything runs."""
    origin = calls.Origin(api=api, principal=principal, t_arrival=t_arrival, request_id=request_id)
    greq, call = await calls.chat_call(model, req, gw=gw, origin=origin, constraint=constraint)
    return greq, _bound(gw, model, call, greq)


async def upstream_completion(
    gw: Gateway,
    model: OpenAIUpstream,
    req: CompletionRequest,
    *,
    principal: Principal | None,
    api: calls.Api,
    t_arrival: float,
    request_id: str | None = None,
) -> tuple[GenerationRequest, Run]:
    """A /v1/completions request for ``model`` and its run. Raises as ``call.completion_call``."""
    origin = calls.Origin(api=api, principal=principal, t_arrival=t_arrival, request_id=request_id)
    greq, call = await calls.completion_call(model, req, gw=gw, origin=origin)
    return greq, _bound(gw, model, call, greq)
