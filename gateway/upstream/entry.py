"""The request path's way into an upstream model: ``upstream_chat`` and ``upstream_completion`` prepare a
request for a served model of kind ``openai`` (``gateway.upstream.call``) and bind its run
(``gateway.upstream.run``) to it.

Each returns the ``GenerationRequest`` the API's renderer and the observers read, with ``served`` (the
model) and ``upstream`` set: ``upstream(sink)`` is what ``run_generation(gw, req, sink)`` runs for it (the
same events, the same errors)::

    if served.kind == "openai":
        return await upstream_chat(gw, served, chat, principal=p, api="openai", t_arrival=t)

Raises: ``InternalError`` (500) for a served model whose upstream is not an ``OpenAIUpstream`` (a fault of
the catalog's builder); the 400s of ``call``.
"""

from __future__ import annotations

from typing import Protocol

from auth.principal import Principal
from backend.protocol import Grammar
from gateway.catalog import ServedModel
from gateway.errors import InternalError
from gateway.generation.events import EventSink
from gateway.generation.request import GenerationRequest
from gateway.openai.schemas import ChatRequest, CompletionRequest
from gateway.upstream import call as calls
from gateway.upstream.model import OpenAIUpstream
from gateway.upstream.run import Services, run_upstream


class Gateway(Services, calls.Services, Protocol):
    """What the request path hands in (``gateway.state.Gateway`` meets it)."""


def _model(served: ServedModel) -> OpenAIUpstream:
    if not isinstance(served.upstream, OpenAIUpstream):
        raise InternalError(f"The model {served.name!r} has no upstream of kind openai.")
    return served.upstream


def _bound(
    gw: Gateway, served: ServedModel, call: calls.UpstreamCall, req: GenerationRequest
) -> GenerationRequest:
    """``req`` with its model and its run (``GenerationRequest.served``, ``.upstream``)."""
    model = _model(served)

    async def run(sink: EventSink) -> None:
        await run_upstream(gw, model, call, req, sink)

    req.served, req.upstream = served, run
    return req


async def upstream_chat(
    gw: Gateway,
    served: ServedModel,
    req: ChatRequest,
    *,
    principal: Principal | None,
    api: calls.Api,
    t_arrival: float,
    request_id: str | None = None,
    constraint: tuple[Grammar, str] | None = None,
) -> GenerationRequest:
    """A chat request for ``served`` (kind openai), its run bound. Raises as ``call.chat_call`` (400s)."""
    origin = calls.Origin(api=api, principal=principal, t_arrival=t_arrival, request_id=request_id)
    greq, call = await calls.chat_call(_model(served), req, gw=gw, origin=origin, constraint=constraint)
    return _bound(gw, served, call, greq)


async def upstream_completion(
    gw: Gateway,
    served: ServedModel,
    req: CompletionRequest,
    *,
    principal: Principal | None,
    api: calls.Api,
    t_arrival: float,
    request_id: str | None = None,
) -> GenerationRequest:
    """A /v1/completions request for ``served`` (kind openai), its run bound. Raises as
    ``call.completion_call``."""
    origin = calls.Origin(api=api, principal=principal, t_arrival=t_arrival, request_id=request_id)
    greq, call = await calls.completion_call(_model(served), req, gw=gw, origin=origin)
    return _bound(gw, served, call, greq)
