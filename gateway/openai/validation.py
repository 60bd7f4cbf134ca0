"""Range checks of the OpenAI requests: 400 ``invalid_value`` (``unsupported_parameter`` for echo/suffix
and the OpenAI fields not served) naming the parameter, before any prompt hook, template or byte sent.

The sampling ranges are the backend's (``backend.sampling_rules``: the engine applies the same rules to
every frame). What only the API has is checked here too: the ``seed`` range before its reduction mod 2**63,
``logit_bias`` keys given as strings, ``max_completion_tokens``, ``top_logprobs`` needing ``logprobs``,
the legacy ``logprobs`` limit (5, as OpenAI), ``stream_options`` only with ``stream``.
"""

from __future__ import annotations

from backend.sampling_rules import (
    FLOAT_RANGES,
    Violation,
    check_float,
    check_logit_bias,
    check_max_tokens,
    check_min_tokens,
    check_n,
    check_token_ids,
    check_top_k,
    check_top_logprobs,
)
from gateway.errors import InvalidRequest
from gateway.openai.schemas import ChatRequest, CompletionRequest, SamplingFields

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_COMPLETION_LOGPROBS = 5


def _raise(v: Violation | None) -> None:
    if v is not None:
        raise InvalidRequest(v.message, param=v.param, code="invalid_value")


def _bias(raw: dict[str, float], vocab_size: int) -> dict[int, float]:
    """``logit_bias`` with its keys as token ids; a key that is not a decimal integer is outside the vocab."""
    out: dict[int, float] = {}
    for key, val in raw.items():
        try:
            tid = int(key) if key.strip().lstrip("-").isdigit() else -1
        except ValueError:
            tid = -1
        if tid < 0:
            raise InvalidRequest(
                f"Invalid key in 'logit_bias': {key!r} is not a token id in [0, {vocab_size}).",
                param="logit_bias",
                code="invalid_value",
            )
        out[tid] = val
    return out


def validate_sampling(req: SamplingFields, *, vocab_size: int) -> None:
    """The checks both endpoints share (each error names its parameter).

    Raises:
        InvalidRequest: n, a float parameter, top_k, logit_bias, seed, max_tokens, min_tokens or
            stop_token_ids out of range; stream_options without stream.
    """
    _raise(check_n(req.n))
    for name in FLOAT_RANGES:
        _raise(check_float(name, getattr(req, name)))
    _raise(check_top_k(req.top_k))
    if req.logit_bias:
        _raise(check_logit_bias(_bias(req.logit_bias, vocab_size), vocab_size))
    if req.seed is not None and not (SEED_MIN <= req.seed <= SEED_MAX):
        raise InvalidRequest(
            f"Invalid value for 'seed': must be an integer in [{SEED_MIN}, {SEED_MAX}].",
            param="seed",
            code="invalid_value",
        )
    _raise(check_max_tokens(req.max_tokens))
    _raise(check_min_tokens(req.min_tokens, req.max_tokens))
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest(
            "The 'stream_options' parameter is only allowed when 'stream' is true.",
            param="stream_options",
            code="invalid_value",
        )
    _raise(check_token_ids(req.stop_token_ids or [], vocab_size))


def validate_chat(req: ChatRequest, *, vocab_size: int) -> str:
    """Checks of /v1/chat/completions; ``max_completion_tokens`` (when given) becomes ``max_tokens``.
    Returns the name the client set the limit with ("max_tokens" or "max_completion_tokens").

    Raises:
        InvalidRequest: as ``validate_sampling``; top_logprobs outside [0, 20] or without logprobs.
    """
    _refuse_unserved(req)
    max_param = "max_tokens"
    if req.max_completion_tokens is not None:
        max_param = "max_completion_tokens"
        _raise(check_max_tokens(req.max_completion_tokens, param=max_param))
        req.max_tokens = req.max_completion_tokens
    validate_sampling(req, vocab_size=vocab_size)
    _raise(check_top_logprobs(req.top_logprobs))
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest(
            "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs", code="invalid_value"
        )
    return max_param


def _unsupported(param: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"'{param}' is not supported: {what}.", param=param, code="unsupported_parameter")


_UNSERVED = {
    "functions": "use 'tools'",
    "function_call": "use 'tool_choice'",
    "audio": "this server generates text only",
    "prediction": "predicted outputs are not served",
    "web_search_options": "this server does not search the web",
    "reasoning_effort": "the model does not reason in hidden tokens",
    "verbosity": "not served",
}


def _refuse_unserved(req: ChatRequest) -> None:
    """Known OpenAI fields that are not served are a 400 ``unsupported_parameter`` naming the field, never
    answered as if absent. Values that ask for nothing pass: ``function_call`` "none", ``modalities``
    ``["text"]``."""
    for name, why in _UNSERVED.items():
        value = getattr(req, name)
        if value is None or (name == "function_call" and value == "none"):
            continue
        raise _unsupported(name, why)
    if req.modalities is not None and req.modalities != ["text"]:
        raise _unsupported("modalities", "this server generates text only (['text'])")


def validate_completion(req: CompletionRequest, *, vocab_size: int) -> None:
    """Checks of /v1/completions (legacy).

    Raises:
        InvalidRequest: as ``validate_sampling``; ``echo`` or ``suffix`` (unsupported); ``logprobs``
            outside [0, 5].
    """
    validate_sampling(req, vocab_size=vocab_size)
    if req.echo:
        raise InvalidRequest("'echo' is not supported.", param="echo", code="unsupported_parameter")
    if req.suffix:
        raise InvalidRequest("'suffix' is not supported.", param="suffix", code="unsupported_parameter")
    if req.best_of is not None and req.best_of != 1:
        raise _unsupported("best_of", "only 1 is served (use n for several choices)")
    _raise(check_top_logprobs(req.logprobs, param="logprobs", most=MAX_COMPLETION_LOGPROBS))
