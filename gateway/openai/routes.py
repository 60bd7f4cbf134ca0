"""The OpenAI generation routes: POST /v1/chat/completions and POST /v1/completions (stream or not).

Each handler reads the body (413 over ``max_body_bytes``), decodes it into its typed request (400 naming
the JSON path of a wrong type), prepares a ``GenerationRequest`` (``gateway.openai.prepare``; every check
there answers before any byte is sent) and answers with ``generation_response``: the run's events rendered
as SSE chunks (``gateway.openai.stream``) or one JSON body (``gateway.openai.body``). Admission (429) and
the backend pick (503) happen inside the run, still before the status line. A body with ``"inspect": true``
also leaves an inspection record for ``GET /v1/inspect/{id}`` (``gateway.inspector``).

Sources: OpenAI API reference, "Create chat completion", "Create completion" (legacy).
"""

from __future__ import annotations

from functools import partial

from starlette.requests import Request

from gateway.generation.response import generation_response
from gateway.inspector.routes import inspect_store
from gateway.observability.record import get_record
from gateway.openai.body import ChatBody, CompletionBody
from gateway.openai.prepare import prepare_chat, prepare_completion
from gateway.openai.schemas import decode_chat, decode_completion
from gateway.openai.stream import ChatStream, CompletionStream
from gateway.request_body import read_body
from gateway.state import Gateway
from gateway.streaming import CallResponse


async def chat_completions(request: Request) -> CallResponse:
    """POST /v1/chat/completions (OpenAI "Create chat completion")."""
    rec = get_record(request)
    gw: Gateway = request.app.state.gateway
    principal = await gw.authenticate(request)
    req = decode_chat(await read_body(request, gw.config.max_body_bytes))
    greq = await prepare_chat(gw, req, principal=principal, api="openai", t_arrival=rec.t_arrival)
    greq.inspect = req.inspect
    render = ChatStream if greq.stream else ChatBody
    names = greq.served or gw.catalog.default  # the token texts of logprobs: the resolved model's
    return generation_response(gw, greq, partial(render, names, greq), rec, inspect_store(request))


async def completions(request: Request) -> CallResponse:
    """POST /v1/completions (OpenAI legacy "Create completion"): one raw prompt, no chat template."""
    rec = get_record(request)
    gw: Gateway = request.app.state.gateway
    principal = await gw.authenticate(request)
    req = decode_completion(await read_body(request, gw.config.max_body_bytes))
    greq = await prepare_completion(gw, req, principal=principal, api="openai", t_arrival=rec.t_arrival)
    greq.inspect = req.inspect
    render = CompletionStream if greq.stream else CompletionBody
    names = greq.served or gw.catalog.default
    return generation_response(gw, greq, partial(render, names, greq), rec, inspect_store(request))
