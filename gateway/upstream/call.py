"""``UpstreamCall``: one client request turned into the request the upstream gets, and its token estimate.

``chat_call`` serves /v1/chat/completions and every API translated into a ``ChatRequest`` (Ollama's
/api/chat and /api/generate); ``completion_call`` serves /v1/completions. Each returns the
``GenerationRequest`` the renderers and observers read (``prompt_ids`` empty: the upstream tokenizes) and
the ``UpstreamCall`` the run sends.

What passes through: every field the client set (``msgspec`` defaults left out), ``tools``,
``tool_choice``, ``response_format``, ``structured_outputs`` and the sampling fields included, with
``model`` replaced by the upstream's name and ``stream: true`` + ``stream_options.include_usage`` always
(the gateway streams from the upstream and answers the client in the form it asked); an Ollama ``format``
(a JSON Schema) as ``response_format``. Checked here (400 naming the parameter): ``n``, ``max_tokens`` /
``max_completion_tokens``, ``stream_options`` without ``stream``; refused (``unsupported_parameter``):
``logprobs`` (the events carry logprobs as this gateway's token ids) and the gateway's own ``inspect``
(an inspection record is the engine's timeline); the rest is the upstream's to refuse (its 4xx comes back
with its message). Not sent and not refused: ``speculative`` (a hint to this gateway's own engine, not an
OpenAI or vLLM field; speculative decoding is lossless, so the answer is the same whether the upstream
speculates or not, and how it does is its operator's setting).

``send = "prompt"``: the chat template of the model's tokenizer renders the conversation here and the
upstream gets ``/completions`` with that ``prompt``: its token ids (``prompt_as = "ids"``, the default: the
count is exact and a control-token string is never re-read as text or as a special token), or its text;
``tools`` are refused there (the text that comes back is not parsed for calls).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeVar

import msgspec

from auth.principal import Principal
from backend.protocol import Grammar, SamplingParams
from backend.sampling_rules import Violation, check_max_tokens, check_n
from gateway.errors import InvalidRequest
from gateway.generation.request import GenerationRequest
from gateway.openai.schemas import ChatRequest, CompletionRequest, SamplingFields
from gateway.upstream.config import UpstreamConfig
from gateway.upstream.usage import message_texts, prompt_tokens, text_tokens
from templating import ChatTemplate, TemplateError, TextTokenizer

Api = Literal["openai", "ollama"]
T = TypeVar("T")
_NOT_SENT = frozenset(
    {"inspect", "model", "stream", "stream_options", "max_completion_tokens", "speculative"}
)


class Services(Protocol):
    """What a call uses of the gateway (``gateway.state.Gateway``): the prompt hooks and the tokenizing
    runner (inline for short texts, a worker thread for long ones)."""

    filters: PromptFilters | None

    async def tokenize(self, fn: Callable[[], T], chars: int) -> T: ...


class PromptFilters(Protocol):
    """The prompt-stage content filters (``gateway.filters.TenantFilters``)."""

    async def check_prompt(
        self, principal: Principal | None, messages: list[dict[str, Any]]
    ) -> list[dict[str, Any]]: ...


class Upstream(Protocol):
    """What a call reads of its model (``gateway.upstream.model.OpenAIUpstream``)."""

    name: str
    config: UpstreamConfig
    tokenizer: TextTokenizer | None
    template: ChatTemplate | None
    context_length: int

    @property
    def upstream_name(self) -> str: ...


class UpstreamCall(msgspec.Struct, kw_only=True):
    """One request to the upstream.

    Attributes:
        path: ``/chat/completions`` or ``/completions`` (under each base URL).
        body: the JSON object sent.
        chat: the answer's choices carry ``delta`` (chat) rather than ``text`` (completions).
        prompt_tokens: reserved for the prompt: exact (``prompt_exact``) when the gateway rendered and
            tokenized it, else counted by the model's tokenizer over the message texts or estimated
            (``gateway.upstream.usage.prompt_tokens``).
        max_tokens: the completion limit reserved per choice (the client's, else what the context leaves).
    """

    path: str
    chat: bool
    prompt_tokens: int
    prompt_exact: bool = False
    max_tokens: int
    body: dict[str, Any] = {}


def _raise(v: Violation | None) -> None:
    if v is not None:
        raise InvalidRequest(v.message, param=v.param, code="invalid_value")


def _unsupported(param: str) -> InvalidRequest:
    return InvalidRequest(
        f"'{param}' is not supported for this upstream model.", param=param, code="unsupported_parameter"
    )


def _checked(req: SamplingFields, max_tokens: int | None, max_param: str, *, logprobs: bool) -> None:
    """The checks made here (see the module docstring). Raises ``InvalidRequest`` naming the parameter."""
    if logprobs:
        raise _unsupported("logprobs")
    if req.inspect:
        raise _unsupported("inspect")
    _raise(check_n(req.n))
    _raise(check_max_tokens(max_tokens, param=max_param))
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest(
            "The 'stream_options' parameter is only allowed when 'stream' is true.",
            param="stream_options",
            code="invalid_value",
        )


def passed_fields(req: msgspec.Struct) -> dict[str, Any]:
    """The fields of ``req`` the client set (different from their defaults), as JSON values, less those the
    gateway owns (``model``, ``stream``, ``stream_options``, ``inspect``, ``max_completion_tokens``,
    ``speculative``)."""
    out: dict[str, Any] = {}
    for f in msgspec.structs.fields(req):
        if f.name in _NOT_SENT:
            continue
        value = getattr(req, f.name)
        if f.default is not msgspec.NODEFAULT and value == f.default:
            continue
        out[f.name] = msgspec.to_builtins(value)
    return out


def _grammar_field(constraint: tuple[Grammar, str] | None) -> dict[str, Any]:
    """A translated API's constraint (Ollama ``format``) as ``response_format``; only JSON Schemas pass."""
    if constraint is None:
        return {}
    grammar, param = constraint
    if grammar.kind != "json_schema":
        raise _unsupported(param)
    schema = msgspec.json.decode(grammar.source)
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}}


class Origin(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request came from: its API, its principal (None without tenancy), its arrival
    (``time.perf_counter()``) and the id it must keep (None: a new one)."""

    api: Api
    principal: Principal | None
    t_arrival: float
    request_id: str | None = None


def _prepared(
    req: SamplingFields,
    model: Upstream,
    origin: Origin,
    fields: dict[str, Any],
    call: UpstreamCall,
    *,
    prefix: str,
    prompt_log: object,
) -> tuple[GenerationRequest, UpstreamCall]:
    """The ``GenerationRequest`` of ``req`` and ``call`` with its body: ``fields`` under the upstream's model
    name, streamed with usage."""
    gen = GenerationRequest(
        request_id=origin.request_id or prefix + uuid.uuid4().hex,
        api=origin.api,
        model=req.model,
        prompt_ids=[],
        sampling=SamplingParams(n=req.n, max_tokens=call.max_tokens),
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        principal=origin.principal,
        prompt_log=prompt_log,
        t_arrival=origin.t_arrival,
    )
    call.body = {
        "model": model.upstream_name,
        **fields,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return gen, call


def _reserve(model: Upstream, prompt_tokens: int, requested: int | None) -> int:
    """The completion limit reserved: ``requested``, else what ``model.context_length`` leaves (at least 1)."""
    if requested is not None:
        return requested
    return max(1, model.context_length - prompt_tokens)


async def chat_call(
    model: Upstream,
    req: ChatRequest,
    *,
    gw: Services,
    origin: Origin,
    constraint: tuple[Grammar, str] | None = None,
) -> tuple[GenerationRequest, UpstreamCall]:
    """A chat request for upstream ``model``: checked, through the prompt hooks, its body built.

    Raises:
        InvalidRequest: 400 naming ``n``, ``max_tokens``/``max_completion_tokens``, ``stream_options``,
            ``logprobs``, ``tools`` (send = "prompt"), a template error, a ``constraint`` that is not a JSON
            Schema. ContentFiltered: 400, a prompt hook.
    """
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    _checked(req, requested, max_param, logprobs=req.logprobs or bool(req.top_logprobs))
    messages = req.messages
    if gw.filters is not None:
        messages = await gw.filters.check_prompt(origin.principal, messages)
    cfg = model.config
    fields = passed_fields(req) | _grammar_field(constraint)
    if requested is not None:
        fields["max_tokens"] = requested
    fields.pop("messages", None)
    tok = model.tokenizer
    chars = sum(len(t) for t in message_texts(messages))
    if cfg.send == "prompt":
        if req.tools:
            raise _unsupported("tools")  # the rendered prompt's answer is not parsed for calls
        if model.template is None:
            raise InvalidRequest(
                "This model has no chat template here.", param="messages", code="invalid_value"
            )
        for k in ("add_generation_prompt", "continue_final_message", "tool_choice", "parallel_tool_calls"):
            fields.pop(k, None)
        template = model.template
        try:
            rendered = await gw.tokenize(
                lambda: template.render(
                    messages,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                ),
                chars,
            )
        except TemplateError as exc:
            raise InvalidRequest(exc.message, param=exc.param, code=exc.code or "invalid_value") from None
        prompt, exact, path, chat = len(rendered.ids), True, "/completions", False
        fields["prompt"] = rendered.ids if cfg.prompt_as == "ids" else rendered.text
    else:
        fields["messages"] = messages
        prompt = await gw.tokenize(lambda: prompt_tokens(messages, tok, cfg), chars if tok is not None else 0)
        exact, path, chat = False, "/chat/completions", True
    call = UpstreamCall(
        path=path,
        chat=chat,
        prompt_tokens=prompt,
        prompt_exact=exact,
        max_tokens=_reserve(model, prompt, requested),
    )
    return _prepared(req, model, origin, fields, call, prefix="chatcmpl-", prompt_log=messages)


async def completion_call(
    model: Upstream,
    req: CompletionRequest,
    *,
    gw: Services,
    origin: Origin,
) -> tuple[GenerationRequest, UpstreamCall]:
    """A /v1/completions request for upstream ``model`` (its ``prompt`` passed as given; a text prompt goes
    through the prompt hooks as one user message). ``max_tokens`` defaults to 16 (OpenAI).

    Raises:
        InvalidRequest: as ``chat_call`` (``logprobs``); ContentFiltered: 400, a prompt hook.
    """
    requested = 16 if req.max_tokens is None else req.max_tokens
    _checked(req, requested, "max_tokens", logprobs=req.logprobs is not None)
    fields = passed_fields(req)
    p: Any = req.prompt
    if gw.filters is not None and isinstance(p, str):
        p = (await gw.filters.check_prompt(origin.principal, [{"role": "user", "content": p}]))[0]["content"]
    fields["prompt"], fields["max_tokens"] = p, requested
    tok, cfg = model.tokenizer, model.config
    if isinstance(p, list) and all(isinstance(x, int) for x in p):
        prompt, exact = len(p), True
    else:
        text = p if isinstance(p, str) else "".join(x for x in p if isinstance(x, str))
        prompt = await gw.tokenize(lambda: text_tokens(text, tok, cfg), len(text) if tok is not None else 0)
        prompt, exact = max(1, prompt), tok is not None
    call = UpstreamCall(
        path="/completions", chat=False, prompt_tokens=prompt, prompt_exact=exact, max_tokens=requested
    )
    return _prepared(req, model, origin, fields, call, prefix="cmpl-", prompt_log=p)
