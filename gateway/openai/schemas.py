"""Request and response shapes of the OpenAI-compatible API, as ``msgspec`` structs.

Requests are decoded straight into typed structs: a wrong JSON type becomes
``InvalidRequest`` (400) whose ``param`` is the JSON path msgspec reports
(e.g. ``messages[0].role``); range checks follow in ``validate_*`` and name
the parameter too. Unknown fields are ignored (as OpenAI does).

Responses (chunks, completions) are structs as well so that encoding a chunk
is one ``msgspec.json`` call. ``ChunkChoice`` never omits ``finish_reason`` or
``logprobs`` (they are ``null`` until set, never ``""`` or missing); ``Delta`` omits absent
members (``{"content": "..."}``).

Sources: OpenAI API reference, "Create chat completion" and "The chat
completion chunk object" (https://platform.openai.com/docs/api-reference/chat),
"Completions (legacy)"; vLLM's extra sampling parameters (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, include_stop_str_in_output,
continue_final_message, add_generation_prompt).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from gateway.errors import InvalidRequest

# ----------------------------------------------------------------------------- limits (documented in docs/gateway.md)

MAX_N = 16
MAX_STOPS = 16
MAX_STOP_LEN = 512  # characters
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


# ----------------------------------------------------------------------------- requests


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
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
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None


class ChatRequest(SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[int | str]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


_PATH_RE = re.compile(r"at `\$\.?(.*)`")
_MISSING_RE = re.compile(r"missing required field `([^`]*)`")


def _decode(body: bytes, typ: type) -> Any:
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        m = _PATH_RE.search(msg)
        param = m.group(1).replace("[...]", "") if m else None  # "logit_bias[...]": a value of that map
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


def _range(value: float | int | None, name: str, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if value is None:
        return
    if value != value or (value <= lo if lo_open else value < lo) or value > hi:  # NaN fails too
        lo_s = f"> {lo}" if lo_open else f">= {lo}"
        raise InvalidRequest(
            f"Invalid value for '{name}': {value} (must be {lo_s} and <= {hi}).",
            param=name,
            code="invalid_value",
        )


def validate_common(req: SamplingFields, *, vocab_size: int) -> None:
    """Range checks shared by both endpoints (each error names its parameter).

    Raises:
        InvalidRequest: n outside [1, 16]; temperature outside [0, 2]; top_p outside (0, 1];
            top_k < -1; min_p outside [0, 1]; presence/frequency penalty outside [-2, 2];
            repetition_penalty outside (0, 2]; logit_bias key not an id in [0, vocab) or value outside
            [-100, 100]; seed outside [-2**63, 2**64-1]; max_tokens < 1; min_tokens < 0 or > max_tokens; stream_options without stream.
    """
    if req.n < 1 or req.n > MAX_N:
        raise InvalidRequest(
            f"Invalid value for 'n': {req.n} (must be between 1 and {MAX_N}).",
            param="n",
            code="invalid_value",
        )
    _range(req.temperature, "temperature", 0.0, 2.0)
    _range(req.top_p, "top_p", 0.0, 1.0, lo_open=True)
    if req.top_k is not None and req.top_k < -1:
        raise InvalidRequest(
            f"Invalid value for 'top_k': {req.top_k} (must be -1, 0 (disabled) or positive).",
            param="top_k",
            code="invalid_value",
        )
    _range(req.min_p, "min_p", 0.0, 1.0)
    _range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _range(req.repetition_penalty, "repetition_penalty", 0.0, 2.0, lo_open=True)
    if req.logit_bias:
        for key, val in req.logit_bias.items():
            try:
                tid = int(key)
            except ValueError:
                tid = -1
            if tid < 0 or tid >= vocab_size or not key.strip().lstrip("-").isdigit():
                raise InvalidRequest(
                    f"Invalid key in 'logit_bias': {key!r} is not a token id in [0, {vocab_size}).",
                    param="logit_bias",
                    code="invalid_value",
                )
            if val != val or val < -100 or val > 100:
                raise InvalidRequest(
                    f"Invalid value in 'logit_bias' for token {key}: {val} (must be between -100 and 100).",
                    param="logit_bias",
                    code="invalid_value",
                )
    if req.seed is not None and not (SEED_MIN <= req.seed <= SEED_MAX):
        raise InvalidRequest(
            f"Invalid value for 'seed': must be an integer in [{SEED_MIN}, {SEED_MAX}].",
            param="seed",
            code="invalid_value",
        )
    if req.max_tokens is not None and req.max_tokens < 1:
        raise InvalidRequest(
            f"Invalid value for 'max_tokens': {req.max_tokens} (must be >= 1).",
            param="max_tokens",
            code="invalid_value",
        )
    if req.min_tokens < 0:
        raise InvalidRequest(
            "Invalid value for 'min_tokens': must be >= 0.", param="min_tokens", code="invalid_value"
        )
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise InvalidRequest(
            f"Invalid value for 'min_tokens': {req.min_tokens} is larger than max_tokens ({req.max_tokens}).",
            param="min_tokens",
            code="invalid_value",
        )
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest(
            "The 'stream_options' parameter is only allowed when 'stream' is true.",
            param="stream_options",
            code="invalid_value",
        )
    if req.stop_token_ids:
        for t in req.stop_token_ids:
            if t < 0 or t >= vocab_size:
                raise InvalidRequest(
                    f"Invalid token id in 'stop_token_ids': {t}.",
                    param="stop_token_ids",
                    code="invalid_value",
                )


def seed_to_backend(seed: int | None) -> int | None:
    """Map an accepted seed in [-2**63, 2**64-1] to a backend seed in [0, 2**63): ``seed mod 2**63``.

    Negative seeds are therefore valid and deterministic (-2 -> 2**63 - 2); documented in docs/gateway.md.
    """
    if seed is None:
        return None
    return seed % (2**63)


# ----------------------------------------------------------------------------- responses


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


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


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str | None
    refusal: None = None


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
