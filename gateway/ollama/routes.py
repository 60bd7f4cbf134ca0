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

from gateway.errors import APIError, InvalidRequest, NotFound
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
                return self._load(body, kind)
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

    def _load(self, body: dict[str, Any], kind: Kind) -> Response:
        """Ollama's answer to a load-only request (``translate.load_only``): done, nothing generated."""
        model = model_name(body)
        self._check_model(model)
        obj = piece(kind, model, "", True)
        obj["done_reason"] = "unload" if unloads(body) else "load"
        return JSONResponse(obj)

    def _check_model(self, name: str) -> None:
        """Raises ``NotFound`` (404 model_not_found) unless ``name`` is served (when any name is known)."""
        names = self.gw.model_names()
        if names and name not in names:
            raise NotFound(f"model '{name}' not found", param="model", code="model_not_found")

    async def _refused(self, request: Request) -> Response | None:
        """The error response when ``request`` fails authentication, else None."""
        try:
            await self.gw.authenticate(request)
        except APIError as exc:
            get_record(request).set_error(exc.type, exc.code)
            return error_response(exc)
        return None

    async def tags(self, request: Request) -> Response:
        """GET /api/tags (Ollama "List Local Models"): the served model."""
        return await self._refused(request) or JSONResponse(models.tags(self.gw.pool.card))

    async def ps(self, request: Request) -> Response:
        """GET /api/ps (Ollama "List Running Models"): the served model, always loaded."""
        return await self._refused(request) or JSONResponse(models.running(self.gw.pool.card))

    async def version(self, request: Request) -> Response:
        """GET /api/version (no key, as in Ollama)."""
        return JSONResponse({"version": OLLAMA_VERSION})

    async def show(self, request: Request) -> Response:
        """POST /api/show {"model"} (Ollama "Show Model Information"); 400 for a body without a model name
        (invalid JSON, not an object, ``model`` missing or not a string), 404 for a name not served."""
        if (refused := await self._refused(request)) is not None:
            return refused
        try:
            body = decode_json(await read_body(request, self.gw.config.max_body_bytes))
            name = (body.get("model") or body.get("name")) if isinstance(body, dict) else None
            if not isinstance(name, str) or not name:
                raise InvalidRequest(
                    "model is required (a non-empty string)", param="model", code="missing_required_parameter"
                )
        except APIError as exc:
            get_record(request).set_error(exc.type, exc.code)
            return error_response(exc)
        card = self.gw.pool.card
        if card is None or name != card.name:
            exc = NotFound(f"model '{name[:200]}' not found", code="model_not_found")
            return error_response(exc)
        return JSONResponse(models.show(card))
