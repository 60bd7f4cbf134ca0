"""The Ollama-compatible API: ``POST /api/chat``, ``POST /api/generate`` (NDJSON stream by default, one JSON
object with ``"stream": false``), ``GET /api/tags``, ``GET /api/ps``, ``POST /api/show``, ``GET /api/version``.

Shapes follow Ollama's docs/api.md (https://github.com/ollama/ollama/blob/main/docs/api.md) and what the
official ``ollama`` Python client (0.6) parses. A chat or generate body is read with the /v1 size limit
(413 over ``max_body_bytes``, chunked bodies included: ``gateway.request_body``), translated into a
``ChatRequest`` (``translate``), prepared like a /v1 chat request (``prepare_chat``: the same validation,
prompt hooks, chat template and context checks; ``format`` as its grammar constraint, ``tools`` as its
tools) and run (``generation_response``: admission, backend, output filters, billing), its events
rendered by ``render``. So auth, rate limits, filters, templating and metrics are those of /v1, and the
request is labelled ``api="ollama"`` in metrics and the access log.

An empty prompt / message list answers at once with done_reason "load" ("unload" with ``keep_alive: 0``),
as Ollama does. Errors are ``{"error": message, "type", "code"}`` with the /v1 status and headers (the
client raises ``ollama.ResponseError(error, status_code)``); an error after streaming began is one final
``{"error": ...}`` line. /api/version is public (``PUBLIC_PATHS``), as in Ollama; the others need a key.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from auth.principal import Principal
from backend.protocol import ModelCard
from gateway.catalog import ServedModel
from gateway.errors import APIError, InvalidRequest
from gateway.generation.response import Renderer, generation_response
from gateway.observability.record import get_record
from gateway.ollama import models
from gateway.ollama.render import Kind, error_response, piece, renderer
from gateway.ollama.translate import format_constraint, load_only, model_name, to_chat_request, unloads
from gateway.openai.prepare import prepare_chat
from gateway.request_body import decode_json, read_body
from gateway.state import Gateway
from gateway.streaming import CallResponse, ResponseWriter

OLLAMA_VERSION = "0.6.3-gateway"  # what /api/version reports (the client API level followed)


class OllamaAPI:
    """The Ollama routes of gateway ``gw``.

    Args:
        gw: the gateway (authentication, body limit, model card and names, the generation path).
    """

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def routes(self) -> list[Route]:
        """Starlette routes of the Ollama API."""
        return [
            Route("/api/chat", self.chat, methods=["POST"]),
            Route("/api/generate", self.generate, methods=["POST"]),
            Route("/api/tags", self.tags, methods=["GET"]),
            Route("/api/version", self.version, methods=["GET"]),
            Route("/api/show", self.show, methods=["POST"]),
            Route("/api/ps", self.ps, methods=["GET"]),
        ]

    async def chat(self, request: Request) -> Response | CallResponse:
        """POST /api/chat (Ollama "Generate a chat completion")."""
        return await self._generation(request, "chat")

    async def generate(self, request: Request) -> Response | CallResponse:
        """POST /api/generate (Ollama "Generate a completion"): system + prompt through the chat template."""
        return await self._generation(request, "generate")

    async def _generation(self, request: Request, kind: Kind) -> Response | CallResponse:
        rec = get_record(request)
        rec.api = "ollama"
        gw = self.gw
        try:
            principal = await gw.authenticate(request)
            body = decode_json(await read_body(request, gw.config.max_body_bytes))
            if isinstance(body, dict) and load_only(body, kind):
                return self._load(body, kind, principal)
            chat = to_chat_request(body, kind)
            req = await prepare_chat(
                gw,
                chat,
                principal=principal,
                api="ollama",
                t_arrival=rec.t_arrival,
                constraint=format_constraint(body),
            )
        except APIError as exc:
            rec.set_error(exc.type, exc.code)
            return error_response(exc)

        def render(w: ResponseWriter) -> Renderer:
            return renderer(w, stream=req.stream, kind=kind, model=chat.model, t_arrival=req.t_arrival)

        return generation_response(gw, req, render, rec)

    def _load(self, body: dict[str, Any], kind: Kind, principal: Principal | None) -> Response:
        """Ollama's answer to a load-only request (``translate.load_only``): done, nothing generated.
        Raises ``NotFound`` (404 model_not_found) for a model that is not served (or not the tenant's)."""
        model = model_name(body)
        self.gw.catalog.resolve(model, principal)
        obj = piece(kind, model, "", True)
        obj["done_reason"] = "unload" if unloads(body) else "load"
        return JSONResponse(obj)

    async def _principal(self, request: Request) -> Principal | None | Response:
        """The request's principal, or the error response when it fails authentication."""
        try:
            return await self.gw.authenticate(request)
        except APIError as exc:
            get_record(request).set_error(exc.type, exc.code)
            return error_response(exc)

    def _listed(self, principal: Principal | None) -> list[models.Listed]:
        """(name, card, context length) of every name of every model ``principal`` may use whose card is
        known (a native model before its first ready backend is left out)."""
        out: list[models.Listed] = []
        for m, name in self.gw.catalog.listing(principal):
            shown = _shown(m)
            if shown is not None:
                out.append((name, *shown))
        return out

    async def tags(self, request: Request) -> Response:
        """GET /api/tags (Ollama "List Local Models"): every model the caller may use, by name and alias."""
        principal = await self._principal(request)
        if isinstance(principal, Response):
            return principal
        return JSONResponse(models.tags(self._listed(principal)))

    async def ps(self, request: Request) -> Response:
        """GET /api/ps (Ollama "List Running Models"): the same models, always loaded."""
        principal = await self._principal(request)
        if isinstance(principal, Response):
            return principal
        return JSONResponse(models.running(self._listed(principal)))

    async def version(self, request: Request) -> Response:
        """GET /api/version (no key, as in Ollama)."""
        return JSONResponse({"version": OLLAMA_VERSION})

    async def show(self, request: Request) -> Response:
        """POST /api/show {"model"} (Ollama "Show Model Information"); 400 for a body without a model name
        (invalid JSON, not an object, ``model`` missing or not a string), 404 for a name not served."""
        principal = await self._principal(request)
        if isinstance(principal, Response):
            return principal
        try:
            body = decode_json(await read_body(request, self.gw.config.max_body_bytes))
            if not isinstance(body, dict):
                raise InvalidRequest("request body must be a JSON object", code="invalid_type")
            name = model_name({"model": body.get("model") or body.get("name")})
            served = self.gw.catalog.resolve(name, principal)
            card, context_length = _shown(served) or (served.card, 0)  # 503 before a backend is ready
        except APIError as exc:
            get_record(request).set_error(exc.type, exc.code)
            return error_response(exc)
        return JSONResponse(models.show(name, card, context_length, native=served.pool is not None))


def _shown(model: ServedModel) -> tuple[ModelCard, int] | None:
    """The card and context length Ollama's listings show for ``model``: its backends' card (None before
    the first is ready) and its context length, or, for a model without backends (an upstream), a bare
    card with its name and the declared context length (0 when none is)."""
    if model.pool is not None:
        card = model.card_or_none
        return None if card is None else (card, model.context_length)
    try:
        context_length = model.context_length
    except APIError:
        context_length = 0
    return ModelCard(name=model.name, architecture=model.kind, context_length=context_length), context_length
