"""Request and response shapes of the OpenAI-compatible API, as ``msgspec`` structs.

Requests are decoded straight into typed structs: a wrong JSON type becomes
``InvalidRequest`` (400) whose ``param`` is the JSON path msgspec reports
(e.g. ``messages[0].role``); range checks follow in ``validate_*`` and name
the parameter too (``gateway.openai.validation``).

Unknown fields, as OpenAI and not as vLLM: the structs below are the allow-list. A top-level field not
in them is a 400 ``unknown_parameter`` naming it ("Unrecognized request argument supplied: x"). The
list holds every field served (OpenAI's, and the vLLM extras implemented: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, continue_final_message, add_generation_prompt, structured_outputs), the engine's
``speculative`` (n-gram speculative decoding for this request, default true), the OpenAI fields that change
nothing here (``user``, ``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``), the gateway's own extension ``inspect`` (keep the request's inspection record for
``GET /v1/inspect/{id}``, docs/inspector.md), and the OpenAI fields not served (``audio``, ``modalities`` other than
``["text"]``, ``prediction``, ``web_search_options``, ``reasoning_effort``, ``verbosity``, legacy
``functions``/``function_call``): those are a 400 ``unsupported_parameter`` when given
(``gateway.openai.validation``). Members of ``messages`` are the chat template's business.

Responses (chunks, completions) are structs as well so that encoding a chunk
is one ``msgspec.json`` call. ``ChunkChoice`` never omits ``finish_reason`` or
``logprobs`` (they are ``null`` until set, never ``""`` or missing); ``Delta`` omits absent
members (``{"content": "..."}``).

Sources: OpenAI API reference, "Create chat completion" and "The chat
completion chunk object" (https://platform.openai.com/docs/api-reference/chat),
"Completions (legacy)"; vLLM's extra sampling parameters (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, include_stop_str_in_output, skip_special_tokens,
continue_final_message, add_generation_prompt).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from gateway.errors import InvalidRequest
from gateway.request_body import check_depth

# ----------------------------------------------------------------------------- requests


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool = False  # OpenAI: padding against side channels; chunks here carry none


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # accepted, change nothing here (OpenAI bookkeeping and routing hints)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # vLLM extra: False puts special tokens' text in the output
    speculative: bool = True  # engine extra: False opts out of speculative decoding (same tokens either way)
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    inspect: bool = False  # gateway extension: keep an inspection record (GET /v1/inspect/{id})


class ChatRequest(SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    tools: list[Any] | None = None  # checked by gateway.tools.spec.parse_tools
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None  # gateway.structured.formats
    structured_outputs: dict[str, Any] | None = None  # vLLM extra
    # known OpenAI fields that are not served: a 400 unsupported_parameter when given (validate_chat)
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[int | str]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM extra (gateway.structured.formats)


_PATH_RE = re.compile(r"at `\$\.?(.*)`")
_UNKNOWN_RE = re.compile(r"unknown field `([^`]*)`")
_MISSING_RE = re.compile(r"missing required field `([^`]*)`")


def _decode(body: bytes, typ: type) -> Any:
    try:
        value = msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        m = _PATH_RE.search(msg)
        param = m.group(1).replace("[...]", "") if m else None  # "logit_bias[...]": a value of that map
        unknown = _UNKNOWN_RE.search(msg)
        if unknown:  # OpenAI: "Unrecognized request argument supplied: x"
            field = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
            raise InvalidRequest(
                f"Unrecognized request argument supplied: {field}", param=field, code="unknown_parameter"
            ) from None
        missing = _MISSING_RE.search(msg)
        if missing:  # OpenAI: "Missing required parameter: 'messages'." param = the missing field
            field = missing.group(1)
            param = f"{param}.{field}" if param else field
            raise InvalidRequest(
                f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
            ) from None
        if param == "":
            param = None
        raise InvalidRequest(
            f"Invalid request body: {msg}",
            param=param,
            code="invalid_type" if "Expected" in msg else "invalid_value",
        ) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(
            f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None
    except RecursionError:
        raise InvalidRequest(
            "We could not parse the JSON body of your request: nested too deeply.", code="invalid_json"
        ) from None
    check_depth(body)  # 400 beyond MAX_DEPTH: the template and tool code walk values recursively
    return value


def decode_chat(body: bytes) -> ChatRequest:
    """Decode a chat request body. Raises ``InvalidRequest`` (400) for bad JSON or wrong types."""
    if not body.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.", code="invalid_json")
    return _decode(body, ChatRequest)


def decode_completion(body: bytes) -> CompletionRequest:
    """Decode a /v1/completions body. Raises ``InvalidRequest`` (400) for bad JSON or wrong types."""
    if not body.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.", code="invalid_json")
    return _decode(body, CompletionRequest)


# ----------------------------------------------------------------------------- responses


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(msgspec.Struct, omit_defaults=True):
    """``delta.tool_calls[]``: the first chunk of a call has ``id``, ``type`` and ``function.name``
    (``arguments`` ""), the next ones ``function.arguments`` fragments only."""

    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class ChunkChoice(msgspec.Struct):
    """A choice of a stream chunk: ``finish_reason`` and ``logprobs`` are always present (null until set)."""

    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageOut(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatChunk(msgspec.Struct, omit_defaults=True, kw_only=True):
    """``chat.completion.chunk``. ``usage`` only on the final usage chunk; ``timings`` (extension, ns) on each
    choice's finish chunk and on the usage chunk."""

    id: str
    object: str  # "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    system_fingerprint: str | None = None
    usage: UsageOut | None = None
    timings: dict[str, Any] | None = None


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct):
    id: str
    type: str  # "function"
    function: FunctionCallOut


class ChatMessageOut(msgspec.Struct, omit_defaults=True):
    """``message``: ``tool_calls`` only when the choice called tools (``content`` is then null unless the
    model also wrote text)."""

    role: str
    content: str | None
    refusal: None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoiceOut(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, omit_defaults=True, kw_only=True):
    id: str
    object: str  # "chat.completion"
    created: int
    model: str
    choices: list[ChatChoiceOut]
    usage: UsageOut
    system_fingerprint: str | None = None
    timings: dict[str, Any] | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(msgspec.Struct, omit_defaults=True, kw_only=True):
    """``text_completion`` (both the full response and stream chunks)."""

    id: str
    object: str  # "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageOut | None = None
    timings: dict[str, Any] | None = None


json_encoder = msgspec.json.Encoder()
encode = json_encoder.encode
