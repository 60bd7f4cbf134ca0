"""A decoded OpenAI request -> ``GenerationRequest``, parsed once (validation, prompt hooks, template and
tokenizer, max_tokens against the context, sampling parameters).

``prepare_chat`` serves /v1/chat/completions and every API translated into a ``ChatRequest`` (the Ollama
API); ``prepare_completion`` serves /v1/completions (a raw prompt, no chat template).

Order of checks (each failure is an ``APIError`` raised before anything is sent): model (404) -> ranges
(400, ``param`` named) -> prompt hooks (400 ``content_filter``) -> the request counted against the
tenant's rpm (429; ``Gateway.count_request``: whatever is refused after this still counts) -> the cheap
context bound (400 ``context_length_exceeded`` for a prompt whose characters alone cannot fit:
``check_fits``, before any rendering or tokenizing) -> template + tokenize (400; in a worker thread when
``rendered_chars``, everything the template renders, tools and tool calls included, passes
``http.thread_tokenize_chars``) -> context length (400 ``context_length_exceeded`` for a prompt that
fills it, 400 ``invalid_value`` naming max_tokens for a limit that does not fit after the prompt; never
clamped, docs/gateway.md). The reservation of tokens and the concurrency slot follows in the run
(``gateway.generation.run``), which does not count the request a second time.

Sources: OpenAI API reference, "Create chat completion" and "Create completion" (legacy); vLLM's extra
sampling parameters.
"""

from __future__ import annotations

import uuid
from typing import Literal

from auth.principal import Principal
from backend.protocol import Grammar, SamplingParams
from gateway.catalog import ServedModel
from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.generation.request import GenerationRequest
from gateway.openai.constraints import chat_constraints
from gateway.openai.prompt_size import check_fits, prompt_floor, rendered_chars
from gateway.openai.schemas import ChatRequest, CompletionRequest, SamplingFields
from gateway.openai.validation import validate_chat, validate_completion
from gateway.state import Gateway
from gateway.stops import normalize_stop
from gateway.structured import formats
from gateway.structured.checker import GrammarCheck
from gateway.upstream.entry import upstream_chat, upstream_completion
from templating.errors import TemplateError

Api = Literal["openai", "ollama"]


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
            f"This model's maximum context length is {context_length} tokens. However, your prompt has "
            f"{prompt_len} tokens and leaves no room for a completion. Please shorten the prompt.",
            param=prompt_param,
        )
    if requested is None:
        return context_length - prompt_len
    if prompt_len + requested > context_length:
        raise InvalidRequest(
            f"'{max_param}' is too large: {requested}. This model's maximum context length is "
            f"{context_length} tokens and your prompt has {prompt_len} tokens, so '{max_param}' can be at "
            f"most {context_length - prompt_len}.",
            param=max_param,
            code="invalid_value",
        )
    return requested


def sampling_params(
    req: SamplingFields, max_tokens: int, *, logprobs: bool, top_logprobs: int
) -> SamplingParams:
    """The backend's sampling parameters for a validated request (OpenAI/vLLM defaults for absent fields;
    ``top_k`` -1 and 0 both disable it; the seed reduced mod 2**63)."""
    return SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=min(req.min_tokens, max_tokens),
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=0 if req.top_k is None or req.top_k == -1 else int(req.top_k),
        min_p=0.0 if req.min_p is None else float(req.min_p),
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
        logit_bias={int(k): float(v) for k, v in (req.logit_bias or {}).items()},
        seed=seed_to_backend(req.seed),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        speculative=req.speculative,
    )


def seed_to_backend(seed: int | None) -> int | None:
    """Map an accepted seed in [-2**63, 2**64-1] to a backend seed in [0, 2**63): ``seed mod 2**63``.

    Negative seeds are therefore valid and deterministic (-2 -> 2**63 - 2); documented in docs/gateway.md.
    """
    if seed is None:
        return None
    return seed % (2**63)


def _generation(
    req: SamplingFields,
    *,
    prefix: str,
    request_id: str | None,
    api: Api,
    model: str,
    served: ServedModel,
    ids: list[int],
    sampling: SamplingParams,
    stops: list[str],
    principal: Principal | None,
    prompt_log: object,
    t_arrival: float,
) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id or prefix + uuid.uuid4().hex,
        api=api,
        model=model,
        served=served,
        prompt_ids=ids,
        sampling=sampling,
        stops=stops,
        include_stop=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        principal=principal,
        prompt_log=prompt_log,
        t_arrival=t_arrival,
    )


async def prepare_chat(
    gw: Gateway,
    req: ChatRequest,
    *,
    principal: Principal | None,
    api: Api,
    t_arrival: float,
    request_id: str | None = None,
    constraint: tuple[Grammar, str] | None = None,
) -> GenerationRequest:
    """A chat request, validated, filtered, templated and tokenized (``request_id`` defaults to
    ``chatcmpl-`` + 32 hex digits). ``constraint``: a grammar and the parameter it came from, given by an
    API translated into a ``ChatRequest`` (Ollama's ``format``); tools and ``response_format`` are resolved
    by ``gateway.openai.constraints``.

    The model is resolved for ``principal`` (``Gateway.resolve``); its tokenizer, chat template, context
    length and vocabulary are used, and the run goes to its backends (``GenerationRequest.served``).

    Raises:
        NotFound: 404 unknown model, or one the tenant may not use. ServiceUnavailable: 503 no backend of
            the model ready (no model card).
        InvalidRequest: 400 naming the parameter (ranges, top_logprobs, template errors, max_tokens).
        ContextLengthExceeded: 400, the prompt fills the context. ContentFiltered: 400, a prompt hook.
    """
    served = gw.resolve(req.model, principal)
    if served.kind == "openai":
        return await upstream_chat(
            gw,
            served,
            req,
            principal=principal,
            api=api,
            t_arrival=t_arrival,
            request_id=request_id,
            constraint=constraint,
        )
    context_length = served.context_length  # 503 before any backend of the model is ready
    tokenizer, template = served.text()
    max_param = validate_chat(req, vocab_size=served.vocab_size)
    stops = normalize_stop(req.stop)
    messages = req.messages
    if gw.filters is not None:
        messages = await gw.filters.check_prompt(principal, messages)
    cons = chat_constraints(served, req, messages, constraint)
    counted = await gw.count_request(principal, served.name)  # rpm first: a refusal below still counts

    def render():  # in a worker thread when large (``Gateway.tokenize``)
        check_fits(prompt_floor(cons.messages, cons.tools), tokenizer.max_token_bytes, context_length)
        return template.render(
            cons.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=cons.tools,
        )

    limit = gw.config.thread_tokenize_chars
    try:
        rendered = await gw.tokenize(render, rendered_chars(cons.messages, cons.tools, stop_after=limit))
    except TemplateError as exc:  # the conversation is the client's fault: 400 with the same members
        raise InvalidRequest(exc.message, param=exc.param, code=exc.code or "invalid_value") from None
    ids = rendered.ids
    max_tokens = resolve_max_tokens(len(ids), req.max_tokens, context_length, max_param=max_param)
    gen = _generation(
        req,
        prefix="chatcmpl-",
        request_id=request_id,
        api=api,
        model=req.model,
        served=served,
        ids=ids,
        sampling=sampling_params(req, max_tokens, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0),
        stops=stops,
        principal=principal,
        prompt_log=messages,
        t_arrival=t_arrival,
    )
    gen.counted = counted
    gen.grammar, gen.grammar_param, gen.grammar_checks = cons.grammar, cons.grammar_param, cons.checks
    gen.tools, gen.tool_parser = cons.plan, cons.parser
    return gen


async def _completion_prompt(
    gw: Gateway, served: ServedModel, req: CompletionRequest, principal: Principal | None
) -> tuple[list[int], object]:
    """(prompt token ids, the prompt for the log). Prompt hooks see a text prompt (a string or a
    one-string array) as one user message. A text prompt is tokenized as llama.cpp's server tokenizes one
    (``TextTokenizer.encode_prompt``): control-token strings as text, BOS/EOS added as the model's metadata
    says (Llama 2/3, Gemma, Phi-3 add BOS; SmolLM2 adds nothing); token ids are taken as given."""
    p = req.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if gw.filters is not None and isinstance(p, str):
        p = (await gw.filters.check_prompt(principal, [{"role": "user", "content": p}]))[0]["content"]
    if isinstance(p, str):
        text = p
        tokenizer, _ = served.text()
        check_fits(len(text), tokenizer.max_token_bytes, served.context_length, param="prompt")
        ids = await gw.tokenize(lambda: tokenizer.encode_prompt(text), len(text))
    elif p and all(isinstance(x, int) for x in p):
        ids = [int(x) for x in p]
        vocab = served.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise InvalidRequest(
                "'prompt' holds a token id outside the vocabulary.", param="prompt", code="invalid_value"
            )
    else:
        raise InvalidRequest(
            "'prompt' must be one string, a one-string array, or an array of token ids (batches are not "
            "supported).",
            param="prompt",
            code="invalid_value",
        )
    if not ids:
        raise InvalidRequest("'prompt' is empty.", param="prompt", code="invalid_value")
    return ids, p


async def prepare_completion(
    gw: Gateway,
    req: CompletionRequest,
    *,
    principal: Principal | None,
    api: Api,
    t_arrival: float,
    request_id: str | None = None,
    constraint: tuple[Grammar, str] | None = None,
) -> GenerationRequest:
    """A legacy completion request, validated, filtered and tokenized (``request_id`` defaults to
    ``cmpl-`` + 32 hex digits). ``max_tokens`` defaults to 16 (OpenAI). The output is constrained by
    vLLM's ``structured_outputs``, or by ``constraint`` (a grammar and its parameter, from a translated API).

    Raises:
        NotFound, ServiceUnavailable, InvalidRequest, ContextLengthExceeded, ContentFiltered: as
        ``prepare_chat`` (``param`` "prompt" for the prompt).
    """
    served = gw.resolve(req.model, principal)
    if served.kind == "openai":
        return await upstream_completion(
            gw, served, req, principal=principal, api=api, t_arrival=t_arrival, request_id=request_id
        )
    context_length = served.context_length
    validate_completion(req, vocab_size=served.vocab_size)
    stops = normalize_stop(req.stop)
    lp = req.logprobs
    so = formats.from_structured_outputs(req.structured_outputs)
    if constraint is None and so is not None:
        constraint = (so, "structured_outputs")
    counted = await gw.count_request(principal, served.name)  # rpm first: a refusal below still counts
    ids, prompt_log = await _completion_prompt(gw, served, req, principal)
    requested = 16 if req.max_tokens is None else req.max_tokens
    max_tokens = resolve_max_tokens(len(ids), requested, context_length, prompt_param="prompt")
    gen = _generation(
        req,
        prefix="cmpl-",
        request_id=request_id,
        api=api,
        model=req.model,
        served=served,
        ids=ids,
        sampling=sampling_params(req, max_tokens, logprobs=lp is not None, top_logprobs=lp or 0),
        stops=stops,
        principal=principal,
        prompt_log=prompt_log,
        t_arrival=t_arrival,
    )
    gen.counted = counted
    if constraint is not None:
        gen.grammar, gen.grammar_param = constraint
        gen.grammar_checks = [GrammarCheck(grammar=constraint[0], param=constraint[1])]
    return gen
