"""Ollama request bodies -> the OpenAI ``ChatRequest`` the generation path prepares (``prepare_chat``).

Sources: Ollama's docs/api.md (https://github.com/ollama/ollama/blob/main/docs/api.md), "Generate a chat
completion" (/api/chat; "Chat request (with tools)", "Chat request (Structured outputs)"), "Generate a
completion" (/api/generate; "Request (Structured outputs)", "Request (JSON mode)") and "Valid Parameters
and Values" of the Modelfile docs (``options``); the OpenAI API reference and vLLM's extra sampling
parameters on the other side.

/api/chat: ``messages`` ({role, content}, assistant ``tool_calls``, ``tool`` results with ``tool_name``)
in OpenAI shape (``gateway.ollama.tools``); ``tools`` as they are (OpenAI's shape already). /api/generate:
an optional ``system`` message, then the ``prompt`` as one user message (the model's chat template
applies, as Ollama's non-raw mode does). ``stream`` defaults to true, as in Ollama; a stream always counts
usage (``stream_options.include_usage``).

``format`` (both routes): ``"json"`` (any JSON object) or a JSON Schema object constrains the output
(``format_constraint``: the grammar goes to ``prepare_chat`` as its ``constraint``, checked there); ``""``
or null: none. Anything else, or a schema that does not compile (a ``$ref`` cycle...), is a 400 naming
``format``. A ``tool_choice`` "required" or naming a function takes precedence over ``format``
(``gateway.openai.constraints``).

``tool_choice`` (extension, not in Ollama): ``options.tool_choice`` or a top-level ``tool_choice``, one of
"auto" (default), "none", "required" or a function name; see ``gateway.ollama.tools``.

``options`` mapping: temperature, top_p, top_k, min_p, seed, stop, presence_penalty, frequency_penalty as
in OpenAI/vLLM; num_predict -> max_tokens (negative: no limit given); repeat_penalty -> repetition_penalty
(vLLM semantics); ``speculative`` (extension, not in Ollama: a boolean, false opts the request out of the
engine's speculative decoding, as the /v1 field). Other options (num_ctx, num_thread, mirostat, ...) are
accepted and ignored; Ollama's own defaults (e.g. temperature 0.8) are not applied: unset options take the
/v1 defaults.

Refused with 400 (``InvalidRequest``, ``param`` named): a body that is not an object, a missing ``model``,
wrong types, images, malformed tools or tool calls, and the features this gateway does not implement:
``think`` (chat) and ``raw``, ``template``, ``suffix``, ``images``, ``context`` (a previous answer's token
context: not returned, so not accepted), ``think`` (generate). ``keep_alive`` is ignored (it only names
the answer to a load-only request: see ``load_only``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from backend.protocol import Grammar
from gateway.errors import InvalidRequest
from gateway.ollama.tools import History, tool_choice
from gateway.openai.schemas import ChatRequest, StreamOptions
from gateway.structured.formats import from_ollama_format

Kind = Literal["chat", "generate"]

_FLOAT_OPTIONS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty")
_INT_OPTIONS = ("top_k", "seed", "num_predict")
_UNSUPPORTED: dict[Kind, tuple[str, ...]] = {
    "chat": ("think",),
    "generate": ("raw", "template", "suffix", "images", "context", "think"),
}


class Options(msgspec.Struct, frozen=True, kw_only=True):
    """The Ollama ``options`` this gateway maps (None: not given)."""

    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    top_k: int | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: list[str] | None = None
    speculative: bool | None = None


def _number(options: dict[str, Any], key: str, integer: bool) -> float | int | None:
    v = options.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidRequest(f"options.{key} must be a number", param=f"options.{key}", code="invalid_type")
    if not integer:
        return float(v)
    if not float(v).is_integer():
        raise InvalidRequest(f"options.{key} must be an integer", param=f"options.{key}", code="invalid_type")
    return int(v)


def parse_options(options: object) -> Options:
    """The mapped members of an Ollama ``options`` object (unknown members ignored).

    Raises:
        InvalidRequest: ``options`` is not an object, or a mapped option has the wrong type
            (param ``options.<name>``).
    """
    if options is None:
        return Options()
    if not isinstance(options, dict):
        raise InvalidRequest("options must be an object", param="options", code="invalid_type")
    fields: dict[str, Any] = {k: _number(options, k, False) for k in _FLOAT_OPTIONS}
    fields.update({k: _number(options, k, True) for k in _INT_OPTIONS})
    stop = options.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise InvalidRequest(
            "options.stop must be a list of strings", param="options.stop", code="invalid_type"
        )
    fields["stop"] = stop or None
    speculative = options.get("speculative")
    if speculative is not None and not isinstance(speculative, bool):
        raise InvalidRequest(
            "options.speculative must be a boolean", param="options.speculative", code="invalid_type"
        )
    fields["speculative"] = speculative
    return Options(**fields)


def model_name(body: dict[str, Any]) -> str:
    """The ``model`` member. Raises ``InvalidRequest`` (param model): ``missing_required_parameter`` when
    missing, null or empty, ``invalid_type`` when not a string."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(
            f"model must be a string, got {type(model).__name__}", param="model", code="invalid_type"
        )
    if not model:
        raise InvalidRequest("model is required", param="model", code="missing_required_parameter")
    return model


def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_type")
    return body


def _refuse_unsupported(body: dict[str, Any], kind: Kind) -> None:
    for key in _UNSUPPORTED[kind]:
        if body.get(key) not in (None, "", [], {}, False):
            raise InvalidRequest(
                f"'{key}' is not supported by this gateway's Ollama API",
                param=key,
                code="unsupported_parameter",
            )


def load_only(body: dict[str, Any], kind: Kind) -> bool:
    """Whether ``body`` asks for no generation: Ollama only loads the model for an empty prompt (and no
    system) or an empty message list, and unloads it with ``keep_alive`` 0."""
    if kind == "chat":
        return not body.get("messages")
    return not body.get("prompt") and not body.get("system")


def unloads(body: dict[str, Any]) -> bool:
    """``keep_alive`` 0 (number or string): the load-only answer's done_reason is "unload"."""
    return body.get("keep_alive") in (0, "0", "0s")


def _chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages") or []
    if not isinstance(msgs, list):
        raise InvalidRequest("messages must be a list", param="messages", code="invalid_type")
    out: list[dict[str, Any]] = []
    history = History()
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(
                f"messages[{i}] must be an object with a role", param=f"messages[{i}]", code="invalid_value"
            )
        if m.get("images"):
            raise InvalidRequest(
                "images are not supported", param=f"messages[{i}].images", code="unsupported_parameter"
            )
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a string", param=f"messages[{i}].content", code="invalid_type"
            )
        out.append(history.message(i, m, content))
    return out


def _generate_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    prompt = body.get("prompt") or ""
    system = body.get("system")
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt must be a string", param="prompt", code="invalid_type")
    msgs: list[dict[str, Any]] = []
    if system:
        if not isinstance(system, str):
            raise InvalidRequest("system must be a string", param="system", code="invalid_type")
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": prompt})
    return msgs


def format_constraint(body: dict[str, Any]) -> tuple[Grammar, str] | None:
    """The grammar of ``format`` and its parameter name (None: no ``format``), for ``prepare_chat``'s
    ``constraint``. Raises ``InvalidRequest`` (param ``format``)."""
    grammar = from_ollama_format(body.get("format"))
    return None if grammar is None else (grammar, "format")


def to_chat_request(body: object, kind: Kind) -> ChatRequest:
    """An Ollama /api/chat (``kind`` "chat") or /api/generate ("generate") body as a ``ChatRequest``.

    Raises:
        InvalidRequest: see the module docstring.
    """
    body = _object(body)
    _refuse_unsupported(body, kind)
    messages = _chat_messages(body) if kind == "chat" else _generate_messages(body)
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", param="stream", code="invalid_type")
    model = model_name(body)
    o = parse_options(body.get("options"))
    tools = body.get("tools") if kind == "chat" else None
    return ChatRequest(
        model=model,
        messages=messages,
        stream=stream,
        stream_options=StreamOptions(include_usage=True) if stream else None,
        temperature=o.temperature,
        top_p=o.top_p,
        min_p=o.min_p,
        presence_penalty=o.presence_penalty,
        frequency_penalty=o.frequency_penalty,
        repetition_penalty=o.repeat_penalty,
        top_k=o.top_k,
        seed=o.seed,
        max_tokens=o.num_predict if o.num_predict is not None and o.num_predict >= 0 else None,
        stop=o.stop,
        tools=tools if tools != [] else None,
        tool_choice=tool_choice(body) if kind == "chat" else None,
        speculative=o.speculative is not False,
    )
