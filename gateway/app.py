"""The Starlette app: OpenAI-compatible routes, health probes, admin stats, error rendering.

Routes:
    POST /v1/chat/completions, POST /v1/completions   (stream or not; see docs/gateway.md)
    GET  /v1/models                                   model card (context length, quantization, device...)
    GET  /v1/models/{model_id}                        one model, the same object as its /v1/models entry; 404 if unknown
    GET  /health                                      liveness as in vLLM: 200, empty body, while the process runs
    GET  /healthz                                     200 while the process runs
    GET  /readyz                                      200 when a backend is ready and we are not draining, else 503
    GET  /admin/v1/stats                              engine counters (Bearer admin key)

Request handling order (each step's failure is an OpenAI error object):
auth (tenancy, when configured) -> body (413 over ``max_body_bytes``,
chunked bodies included, counted while reading) -> JSON/types (400) ->
model (404) -> ranges (400, ``param`` named) -> template + tokenize (400) ->
context length (400 ``context_length_exceeded`` for a prompt that fills it, 400 ``invalid_value`` naming
max_tokens for a limit that does not fit after the prompt) -> the ``CallResponse``
producer: admission (429), backend pick (503), generation.

Errors are rendered from ``gateway.errors`` (``APIError.body()``, status, headers);
unknown routes are 404 and wrong methods 405, in the same shape.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backend.protocol import ModelCard, SamplingParams
from gateway.errors import (
    APIError,
    ContextLengthExceeded,
    InternalError,
    InvalidRequest,
    NotFound,
    ServiceUnavailable,
)
from gateway.generation.run import Generation
from gateway.request_body import read_body
from gateway.schemas import (
    MAX_COMPLETION_LOGPROBS,
    MAX_TOP_LOGPROBS,
    decode_chat,
    decode_completion,
    seed_to_backend,
    validate_common,
)
from gateway.state import Gateway
from gateway.stops import normalize_stop
from gateway.streaming import CallResponse

log = logging.getLogger("gateway")


def _chars(messages: Any) -> int:
    """Rough size of a message list in characters (decides inline vs threaded tokenization)."""
    n = 0
    for m in messages if isinstance(messages, list) else ():
        n += 16  # per-message template text (role header, markers): many empty messages are work too
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            n += len(c)
        elif isinstance(c, list):
            for part in c:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    n += len(part["text"])
    return n


def _record(request: Request) -> Any:
    try:
        from gateway.request_log import SCOPE_KEY

        return request.scope.get(SCOPE_KEY)
    except Exception:  # noqa: BLE001
        return None


def resolve_max_tokens(
    prompt_len: int,
    requested: int | None,
    context_length: int,
    *,
    prompt_param: str = "messages",
    max_param: str = "max_tokens",
) -> int:
    """Tokens to generate: ``requested``, or what fits in the context when absent.

    Args:
        prompt_param: the field holding the prompt ("messages", or "prompt" on /v1/completions).
        max_param: the field the client set the limit with ("max_tokens" or "max_completion_tokens").

    Raises:
        ContextLengthExceeded: the prompt alone fills the context (param ``prompt_param``, code
            ``context_length_exceeded``).
        InvalidRequest: prompt + requested > context (param ``max_param``, code ``invalid_value``: the
            prompt fits, the limit is what is too large): never clamped (docs/gateway.md).
    """
    if prompt_len >= context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens. However, your prompt has {prompt_len} tokens "
            f"and leaves no room for a completion. Please shorten the prompt.",
            param=prompt_param,
        )
    if requested is None:
        return context_length - prompt_len
    if prompt_len + requested > context_length:
        raise InvalidRequest(
            f"'{max_param}' is too large: {requested}. This model's maximum context length is {context_length} tokens and "
            f"your prompt has {prompt_len} tokens, so '{max_param}' can be at most {context_length - prompt_len}.",
            param=max_param,
            code="invalid_value",
        )
    return requested


def _sampling(req: Any, max_tokens: int, *, logprobs: bool, top_logprobs: int) -> SamplingParams:
    kw: dict[str, Any] = {
        "n": req.n,
        "max_tokens": max_tokens,
        "min_tokens": min(req.min_tokens, max_tokens),
        "temperature": 1.0 if req.temperature is None else float(req.temperature),
        "top_p": 1.0 if req.top_p is None else float(req.top_p),
        "top_k": 0 if req.top_k is None or req.top_k == -1 else int(req.top_k),
        "min_p": 0.0 if req.min_p is None else float(req.min_p),
        "presence_penalty": float(req.presence_penalty or 0.0),
        "frequency_penalty": float(req.frequency_penalty or 0.0),
        "repetition_penalty": 1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
        "logit_bias": {int(k): float(v) for k, v in (req.logit_bias or {}).items()},
        "seed": seed_to_backend(req.seed),
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": bool(req.ignore_eos),
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
    }
    return SamplingParams(**kw)


def _tenant_id(principal: Any) -> str:
    for attr in ("tenant_id", "tenant"):
        v = getattr(principal, attr, None)
        if isinstance(v, str):
            return v
        if v is not None and isinstance(getattr(v, "id", None), str):
            return v.id
    return ""


# ----------------------------------------------------------------------------- handlers


async def chat_completions(request: Request) -> Any:
    """POST /v1/chat/completions (OpenAI "Create chat completion")."""
    t0 = time.perf_counter()
    gw: Gateway = request.app.state.gateway
    principal = await gw.authenticate(request)
    body = await read_body(request, gw.config.max_body_bytes)
    req = decode_chat(body)
    card = gw.card
    model = gw.check_model(req.model)
    max_param = "max_tokens"
    if req.max_completion_tokens is not None:
        max_param = "max_completion_tokens"
        if req.max_completion_tokens < 1:
            raise InvalidRequest(
                "Invalid value for 'max_completion_tokens': must be >= 1.",
                param="max_completion_tokens",
                code="invalid_value",
            )
        req.max_tokens = req.max_completion_tokens
    validate_common(req, vocab_size=card.vocab_size or gw.tokenizer.vocab_size)
    stops = normalize_stop(req.stop)
    top = req.top_logprobs
    if top is not None:
        if top < 0 or top > MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"Invalid value for 'top_logprobs': {top} (must be between 0 and {MAX_TOP_LOGPROBS}).",
                param="top_logprobs",
                code="invalid_value",
            )
        if top > 0 and not req.logprobs:
            raise InvalidRequest(
                "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs", code="invalid_value"
            )
    messages = req.messages
    if gw.filters is not None:
        messages = await gw.filters.check_prompt(principal, messages)
    ids = (
        await gw.tokenize(
            lambda: gw.template.render(
                messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
            ),
            _chars(messages),
        )
    ).ids
    max_tokens = resolve_max_tokens(len(ids), req.max_tokens, card.context_length, max_param=max_param)
    sampling = _sampling(req, max_tokens, logprobs=req.logprobs, top_logprobs=top or 0)
    rec = _record(request)
    if rec is not None:
        rec.model, rec.stream, rec.api = model, req.stream, "openai"
        rec.tenant = _tenant_id(principal) or None
        t0 = min(t0, getattr(rec, "t_arrival", t0))
        rec.set_prompt(messages)  # kept only with --log-content (observability)
    gen = Generation(
        gw,
        kind="chat",
        model=model,
        prompt_ids=ids,
        sampling=sampling,
        stops=stops,
        include_stop=req.include_stop_str_in_output,
        logprobs="chat" if req.logprobs else None,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        cache_salt=_tenant_id(principal),
        admission=gw.admission(principal, len(ids), max_tokens * req.n, model),
        record=rec,
        t_arrival=t0,
        output_filter=gw.output_filter(principal),
    )
    return CallResponse(gen.stream if req.stream else gen.complete)


async def completions(request: Request) -> Any:
    """POST /v1/completions (OpenAI legacy "Create completion"): one raw prompt, no chat template."""
    t0 = time.perf_counter()
    gw: Gateway = request.app.state.gateway
    principal = await gw.authenticate(request)
    body = await read_body(request, gw.config.max_body_bytes)
    req = decode_completion(body)
    card = gw.card
    model = gw.check_model(req.model)
    validate_common(req, vocab_size=card.vocab_size or gw.tokenizer.vocab_size)
    stops = normalize_stop(req.stop)
    if req.echo:
        raise InvalidRequest("'echo' is not supported.", param="echo", code="unsupported_parameter")
    if req.suffix:
        raise InvalidRequest("'suffix' is not supported.", param="suffix", code="unsupported_parameter")
    lp = req.logprobs
    if lp is not None and (lp < 0 or lp > MAX_COMPLETION_LOGPROBS):
        raise InvalidRequest(
            f"Invalid value for 'logprobs': {lp} (must be between 0 and {MAX_COMPLETION_LOGPROBS}).",
            param="logprobs",
            code="invalid_value",
        )
    p = req.prompt
    if gw.filters is not None and isinstance(p, str):  # prompt hooks see a raw prompt as one user message
        p = (await gw.filters.check_prompt(principal, [{"role": "user", "content": p}]))[0]["content"]
    if isinstance(p, str):
        text = p
        ids = await gw.tokenize(lambda: gw.tokenizer.encode_plain(text), len(text))
    elif p and all(isinstance(x, int) for x in p):
        ids = list(p)  # type: ignore[arg-type]
        vocab = card.vocab_size or gw.tokenizer.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise InvalidRequest(
                "'prompt' holds a token id outside the vocabulary.", param="prompt", code="invalid_value"
            )
    elif isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        text = p[0]
        ids = await gw.tokenize(lambda: gw.tokenizer.encode_plain(text), len(text))
    else:
        raise InvalidRequest(
            "'prompt' must be one string, a one-string array, or an array of token ids (batches are not supported).",
            param="prompt",
            code="invalid_value",
        )
    if not ids:
        raise InvalidRequest("'prompt' is empty.", param="prompt", code="invalid_value")
    max_tokens = resolve_max_tokens(
        len(ids), 16 if req.max_tokens is None else req.max_tokens, card.context_length, prompt_param="prompt"
    )
    sampling = _sampling(req, max_tokens, logprobs=lp is not None, top_logprobs=lp or 0)
    rec = _record(request)
    if rec is not None:
        rec.model, rec.stream, rec.api = model, req.stream, "openai"
        rec.tenant = _tenant_id(principal) or None
        rec.set_prompt(p)  # kept only with --log-content (observability)
    gen = Generation(
        gw,
        kind="completion",
        model=model,
        prompt_ids=ids,
        sampling=sampling,
        stops=stops,
        include_stop=req.include_stop_str_in_output,
        logprobs="completion" if lp is not None else None,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        cache_salt=_tenant_id(principal),
        admission=gw.admission(principal, len(ids), max_tokens * req.n, model),
        record=rec,
        t_arrival=t0,
        output_filter=gw.output_filter(principal),
    )
    return CallResponse(gen.stream if req.stream else gen.complete)


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
    like /v1/models (the tenancy middleware answers 401 first). ``model_id`` is a ``path`` parameter: a
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


async def health(request: Request) -> Response:
    """GET /health (HEAD too): liveness, 200 with an empty body while the process runs, as vLLM's /health.
    Public (no key) and answered during a drain; readiness (a backend up, not draining) is /readyz."""
    return Response(status_code=200)


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    if gw.pool.is_ready():
        return JSONResponse({"status": "ready"})
    body = ServiceUnavailable("draining" if gw.pool.draining else "no backend ready").body()
    return JSONResponse(body, status_code=503)


async def admin_stats(request: Request) -> Response:
    """GET /admin/v1/stats: summed backend ``Stats`` + per-backend supervisor state (Bearer admin key)."""
    gw: Gateway = request.app.state.gateway
    await gw.check_admin(request)
    fields = (
        "running",
        "waiting",
        "kv_blocks_used",
        "kv_blocks_total",
        "kv_blocks_cached",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "preemptions",
        "aborts",
        "requests_finished",
        "prompt_tokens",
        "generation_tokens",
        "steps",
    )
    total: dict[str, Any] = {f: 0 for f in fields}
    device = attention = None
    backends = []
    for sup in gw.pool.supervisors:
        info = sup.info()
        c = sup.client
        if c is not None and c.alive:
            try:
                st = await c.get_stats()
                for f in fields:
                    total[f] += getattr(st, f)
                device = device or st.device
                attention = attention or st.attention_backend
                info["stats"] = msgspec.to_builtins(st)
            except APIError as exc:
                info["error"] = exc.message
        backends.append(info)
    if device is None and gw.pool.card is not None:
        device, attention = gw.pool.card.device, gw.pool.card.attention_backend
    total.update(device=device, attention_backend=attention, backends=backends, draining=gw.pool.draining)
    return JSONResponse(total)


# ----------------------------------------------------------------------------- error rendering


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    rec = _record(request)
    if rec is not None:
        try:
            rec.set_error(exc.type, exc.code)
        except Exception:  # noqa: BLE001
            pass
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err: APIError = NotFound(f"Unknown route: {request.method} {request.url.path}", code="unknown_route")
    else:
        err = APIError(str(exc.detail), status=exc.status_code, type="invalid_request_error")
    return JSONResponse(err.body(), status_code=err.status, headers=dict(exc.headers or {}) or None)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    err = InternalError("The server had an error while processing your request.")
    return JSONResponse(err.body(), status_code=500)


def build_app(gw: Gateway, *, extra_routes: list | None = None, middleware: list | None = None) -> Starlette:
    """The Starlette app for ``gw`` (``app.state.gateway``). ``extra_routes`` (e.g. tenancy admin routes) are appended."""
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/admin/v1/stats", admin_stats, methods=["GET"]),
        *(extra_routes or []),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.gateway = gw
    app.router.redirect_slashes = False  # a 307 built from the Host header would be an open redirect
    # observability: /metrics, Ollama API routes, x-request-id, access log (outermost wrapper, forwards attributes)
    from gateway.metrics import instrument

    return instrument(
        app,
        gw,
        tenant_label=gw.config.metrics_tenant_label,
        log_content=gw.config.log_content,
        access_log=gw.config.access_log,
    )
