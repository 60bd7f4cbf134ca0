"""The OpenAI model routes: GET /v1/models and GET /v1/models/{model_id} (OpenAI API reference, "Models")."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backend.protocol import ModelCard
from gateway.state import Gateway


def model_object(gw: Gateway, name: str, card: ModelCard) -> dict[str, Any]:
    """The model object of served name ``name`` with ``card`` (``gw.card``): OpenAI's Model
    (id/object/created/owned_by) plus the card's extension members (context length, quantization, dtype,
    device...). One entry of ``GET /v1/models`` and the body of ``GET /v1/models/{model_id}``."""
    return {
        "id": name,
        "object": "model",
        "created": gw.started,
        "owned_by": "gateway",
        "context_length": card.context_length,
        "max_model_len": card.context_length,
        "quantization": card.quantization,
        "dtype": card.dtype,
        "device": card.device,
        "attention_backend": card.attention_backend,
        "architecture": card.architecture,
        "vocab_size": card.vocab_size,
    }


async def list_models(request: Request) -> Response:
    """GET /v1/models (OpenAI "List models"): the served model and its aliases, each with the card
    (extension members beyond OpenAI's id/object/created/owned_by, see :func:`model_object`).
    Raises ``ServiceUnavailable`` (503) while no backend is ready."""
    gw: Gateway = request.app.state.gateway
    await gw.authenticate(request)
    card = gw.card
    return JSONResponse(
        {"object": "list", "data": [model_object(gw, name, card) for name in gw.model_names()]}
    )


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{model_id} (OpenAI API reference "Retrieve model"; ``client.models.retrieve(model_id)``
    in the official SDK): the same object as that model's entry of ``GET /v1/models``. Needs a tenant key,
    like /v1/models (the auth middleware answers 401 first). ``model_id`` is a ``path`` parameter: a
    served name may hold ``/`` (``org/model``; the SDK sends it as ``org%2Fmodel``, which the server decodes)
    or ``.``.

    Raises:
        NotFound: 404 ``model_not_found`` (param ``model``) for a name that is not served, as the chat
            handlers answer an unknown ``model`` (:meth:`Gateway.check_model`).
        ServiceUnavailable: 503 while no backend is ready.
    """
    gw: Gateway = request.app.state.gateway
    await gw.authenticate(request)
    name = gw.check_model(request.path_params["model_id"])
    return JSONResponse(model_object(gw, name, gw.card))
