"""The OpenAI model routes: GET /v1/models and GET /v1/models/{model_id} (OpenAI API reference, "Models")."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.catalog import ServedModel
from gateway.errors import ServiceUnavailable
from gateway.state import Gateway


def model_object(gw: Gateway, name: str, model: ServedModel) -> dict[str, Any]:
    """The model object of name ``name`` (a served name or an alias) of ``model``: OpenAI's Model
    (id/object/created/owned_by) plus ``root`` (the served name, as vLLM lists an alias), ``kind`` and,
    for a native model, its card's extension members (context length, quantization, dtype, device...).
    One entry of ``GET /v1/models`` and the body of ``GET /v1/models/{model_id}``. Raises
    ``ServiceUnavailable`` (503) for a native model none of whose backends is ready yet."""
    obj: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": gw.started,
        "owned_by": "gateway",
        "root": model.name,
        "kind": model.kind,
    }
    if model.kind != "native":
        return obj
    card = model.card
    return obj | {
        "context_length": model.context_length,
        "max_model_len": model.context_length,
        "quantization": card.quantization,
        "dtype": card.dtype,
        "weights": card.weights,
        "device": card.device,
        "attention_backend": card.attention_backend,
        "architecture": card.architecture,
        "vocab_size": card.vocab_size,
    }


def _names_known(gw: Gateway) -> None:
    """Raises ``ServiceUnavailable`` (503) while the default model has no name yet (declared by the
    single-model flags, it is named by its backends' card, which has not arrived)."""
    if not gw.catalog.default.names:
        raise ServiceUnavailable("No inference backend is ready yet.")


async def list_models(request: Request) -> Response:
    """GET /v1/models (OpenAI "List models"): every model the caller may use (``Principal.allows_model``),
    by its served name and each alias, each with the model's card (extension members beyond OpenAI's
    id/object/created/owned_by, see :func:`model_object`). Raises ``ServiceUnavailable`` (503) while a
    listed native model has no ready backend."""
    gw: Gateway = request.app.state.gateway
    principal = await gw.authenticate(request)
    _names_known(gw)
    data = [model_object(gw, name, m) for m, name in gw.catalog.listing(principal)]
    return JSONResponse({"object": "list", "data": data})


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{model_id} (OpenAI API reference "Retrieve model"; ``client.models.retrieve(model_id)``
    in the official SDK): the same object as that model's entry of ``GET /v1/models``. Needs a tenant key,
    like /v1/models (the auth middleware answers 401 first). ``model_id`` is a ``path`` parameter: a
    served name may hold ``/`` (``org/model``; the SDK sends it as ``org%2Fmodel``, which the server decodes)
    or ``.``.

    Raises:
        NotFound: 404 ``model_not_found`` (param ``model``) for a name that is not served or that the
            tenant may not use, as the chat handlers answer it (:meth:`Gateway.resolve`).
        ServiceUnavailable: 503 while no backend of the model is ready.
    """
    gw: Gateway = request.app.state.gateway
    principal = await gw.authenticate(request)
    name = request.path_params["model_id"]
    _names_known(gw)
    return JSONResponse(model_object(gw, name, gw.resolve(name, principal)))
