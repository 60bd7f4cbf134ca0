"""Ollama-compatible API on top of the gateway's OpenAI chat pipeline.

Routes: ``POST /api/chat``, ``POST /api/generate`` (NDJSON streaming by
default, one JSON object with ``"stream": false``), ``GET /api/tags``,
``GET /api/version``, ``POST /api/show``, ``GET /api/ps``. Shapes follow
Ollama's docs/api.md (https://github.com/ollama/ollama/blob/main/docs/api.md)
and what the official ``ollama`` Python client (0.6) parses.

This layer only translates shapes: an Ollama request becomes an OpenAI
``/v1/chat/completions`` body handed to the same pipeline function as
``/v1`` (so auth, rate limits, filters, templating and metrics are the
same), and the pipeline's OpenAI response (JSON, or SSE chunks with
``stream_options.include_usage``) becomes Ollama's.

Timing fields are integers in nanoseconds:
    total_duration        gateway arrival -> final object (ns)
    load_duration         0: the model is always loaded
    prompt_eval_count     prompt tokens (== OpenAI usage.prompt_tokens)
    prompt_eval_duration  backend prefill time (ns)
    eval_count            generated tokens (== usage.completion_tokens)
    eval_duration         backend decode time (ns)
  extensions (not in Ollama):
    prompt_eval_cached_count  prompt tokens served from the prefix cache
    queue_duration            backend queue time (ns)
prompt_eval_duration + eval_duration <= total_duration always holds.

options mapping: temperature, top_p, top_k, min_p, seed, stop,
presence_penalty, frequency_penalty as in OpenAI/vLLM; num_predict ->
max_tokens (negative: no limit given); repeat_penalty ->
repetition_penalty (vLLM semantics). Other options (num_ctx, num_thread,
mirostat, ...) are accepted and ignored; Ollama's own defaults (e.g.
temperature 0.8) are not applied: unset options take the /v1 defaults.
Images, tools, ``format``, ``raw``, ``template`` and ``suffix`` are refused
with 400; ``context`` is ignored. An empty prompt / message list answers at
once with done_reason "load" ("unload" with ``keep_alive: 0``), as Ollama does.
Errors are ``{"error": message, "type": ..., "code": ...}`` with the /v1
status code (the client raises ``ollama.ResponseError(error, status_code)``);
an error after streaming began is one final ``{"error": ...}`` line.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.errors import APIError, InvalidRequest, NotFound
from gateway.request_body import decode_json, read_body
from gateway.request_log import get_record

NDJSON = "application/x-ndjson"
OLLAMA_VERSION = "0.6.3-gateway"  # what /api/version reports (the client API level we follow)


# ---------------------------------------------------------------------------- request translation


def _num(options: dict, key: str, typ: type) -> Any:
    v = options.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidRequest(f"options.{key} must be a number", param=f"options.{key}")
    return typ(v) if typ is float or float(v).is_integer() else _bad_int(key)


def _bad_int(key: str) -> Any:
    raise InvalidRequest(f"options.{key} must be an integer", param=f"options.{key}")


def options_to_openai(options: dict | None) -> dict:
    """Translate Ollama ``options`` into OpenAI/vLLM sampling fields of a chat body.

    Raises:
        InvalidRequest: a known option has the wrong type.
    """
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InvalidRequest("options must be an object", param="options")
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
        v = _num(options, key, float)
        if v is not None:
            out[key] = v
    v = _num(options, "repeat_penalty", float)
    if v is not None:
        out["repetition_penalty"] = v
    v = _num(options, "top_k", int)
    if v is not None:
        out["top_k"] = v
    v = _num(options, "seed", int)
    if v is not None:
        out["seed"] = v
    v = _num(options, "num_predict", int)
    if v is not None and v >= 0:
        out["max_tokens"] = v
    stop = options.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequest("options.stop must be a list of strings", param="options.stop")
        if stop:
            out["stop"] = stop
    return out


def _refuse_unsupported(body: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        v = body.get(key)
        if v not in (None, "", [], {}, False):
            raise InvalidRequest(f"'{key}' is not supported by this gateway's Ollama API", param=key)


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required", param="model")
    return model


def chat_to_openai(body: dict) -> dict:
    """An Ollama /api/chat body -> an OpenAI chat-completions body (``stream`` as requested, usage on).

    Raises:
        InvalidRequest: malformed messages or an unsupported feature.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    _refuse_unsupported(body, ("tools", "format"))
    msgs = body.get("messages") or []
    if not isinstance(msgs, list):
        raise InvalidRequest("messages must be a list", param="messages")
    out_msgs = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a role", param=f"messages[{i}]")
        if m.get("images"):
            raise InvalidRequest("images are not supported", param=f"messages[{i}].images")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        out_msgs.append({"role": m["role"], "content": content})
    return _openai_body(body, out_msgs)


def generate_to_openai(body: dict) -> dict:
    """An Ollama /api/generate body -> an OpenAI chat-completions body (system + user prompt).

    Raises:
        InvalidRequest: a non-string prompt/system or an unsupported feature (raw, template, suffix, images, format).
    """
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    _refuse_unsupported(body, ("raw", "template", "suffix", "images", "format"))
    prompt = body.get("prompt") or ""
    system = body.get("system")
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt must be a string", param="prompt")
    msgs = []
    if system:
        if not isinstance(system, str):
            raise InvalidRequest("system must be a string", param="system")
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": prompt})
    return _openai_body(body, msgs)


def _openai_body(body: dict, messages: list[dict]) -> dict:
    stream = body.get("stream", True)  # Ollama streams unless told not to
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", param="stream")
    out = {"model": _model(body), "messages": messages, "stream": stream}
    out.update(options_to_openai(body.get("options")))
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


# ---------------------------------------------------------------------------- response translation


def now_rfc3339() -> str:
    """Current UTC time as Ollama writes ``created_at`` (RFC 3339, microseconds, ``Z``)."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _ns(seconds: float | None) -> int:
    return max(0, int(round((seconds or 0.0) * 1e9)))


def final_stats(request: Request, usage: dict | None) -> dict:
    """Ollama's final-object statistics for this request (ns durations, token counts)."""
    rec = get_record(request)
    total = _ns(time.perf_counter() - rec.t_arrival)
    prompt_eval = min(_ns(rec.prefill_s), total)
    evald = min(_ns(rec.decode_s), total - prompt_eval)
    usage = usage or {}
    prompt_count = usage.get("prompt_tokens", rec.prompt_tokens or 0)
    eval_count = usage.get("completion_tokens", rec.completion_tokens)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = rec.cached_tokens or 0
    return {
        "total_duration": total,
        "load_duration": 0,
        "prompt_eval_count": prompt_count,
        "prompt_eval_duration": prompt_eval,
        "eval_count": eval_count,
        "eval_duration": evald,
        "prompt_eval_cached_count": cached,
        "queue_duration": _ns(rec.queue_s),
    }


def _done_reason(finish_reason: str | None) -> str:
    return finish_reason or "stop"


def error_response(exc: APIError) -> JSONResponse:
    """An ``APIError`` in Ollama's shape ``{"error": message}`` (+ type/code), same status and headers."""
    return JSONResponse(
        {"error": exc.message, "type": exc.type, "code": exc.code},
        status_code=exc.status,
        headers=exc.headers,
    )


def _openai_error_body(raw: bytes) -> dict:
    try:
        err = json.loads(raw).get("error") or {}
    except (ValueError, AttributeError, UnicodeDecodeError):
        err = {}
    if not isinstance(err, dict):
        err = {"message": str(err)}
    return {"error": err.get("message", "error"), "type": err.get("type"), "code": err.get("code")}


class SSEParser:
    """Incremental parser of an SSE byte stream into the JSON payloads of its ``data:`` events.

    ``feed(bytes)`` returns the payloads completed so far; comments (``: ping``)
    are skipped; ``[DONE]`` is returned as the string ``"[DONE]"``.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[Any]:
        self._buf += chunk
        out: list[Any] = []
        while True:
            cands = [i for i in (self._buf.find(b"\n\n"), self._buf.find(b"\r\n\r\n")) if i >= 0]
            if not cands:
                return out
            sep = min(cands)
            event, self._buf = self._buf[:sep], self._buf[sep:].lstrip(b"\r\n")
            data = b"\n".join(line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:"))
            if not data:
                continue
            if data.strip() == b"[DONE]":
                out.append("[DONE]")
            else:
                try:
                    out.append(json.loads(data))
                except ValueError:
                    continue


def subrequest(request: Request, body: dict) -> Request:
    """A copy of ``request`` (same scope values, headers minus content-length) whose body is ``body`` as JSON.

    The copy shares the ``RequestRecord`` (scope values are shared) and reads
    disconnects from the original ``receive`` once its body is consumed.
    """
    data = json.dumps(body).encode()
    scope = dict(request.scope)
    scope["headers"] = [
        (k, v)
        for k, v in scope.get("headers", [])
        if k.lower() not in (b"content-length", b"transfer-encoding", b"content-type")
    ] + [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
    ]
    scope["path"] = "/v1/chat/completions"
    sent = False
    outer_receive = request.receive

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        return await outer_receive()

    return Request(scope, receive)


class TranslatedResponse:
    """ASGI response running the /v1 pipeline's response and rewriting what it sends into Ollama's shapes.

    JSON answers (and any status >= 400) are buffered and translated whole;
    an SSE answer becomes NDJSON line by line as its events arrive.
    Disconnects reach the inner response through ``receive`` unchanged.
    """

    def __init__(self, inner: Any, request: Request, kind: str, model: str) -> None:
        self.inner = inner
        self.request = request
        self.kind = kind
        self.model = model

    def _piece(self, text: str, done: bool) -> dict:
        obj: dict[str, Any] = {"model": self.model, "created_at": now_rfc3339()}
        if self.kind == "chat":
            obj["message"] = {"role": "assistant", "content": text}
        else:
            obj["response"] = text
        obj["done"] = done
        return obj

    def _final(self, finish_reason: str | None, usage: dict | None, text: str = "") -> dict:
        obj = self._piece(text, True)
        obj["done_reason"] = _done_reason(finish_reason)
        obj.update(final_stats(self.request, usage))
        return obj

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        status = 200
        headers: list[tuple[bytes, bytes]] = []
        mode = ""  # "sse" | "buffer"
        buf = bytearray()
        parser = SSEParser()
        finish_reason: str | None = None
        usage: dict | None = None
        started = False
        finished = False

        async def start(st: int, ctype: bytes, extra: list[tuple[bytes, bytes]]) -> None:
            nonlocal started
            started = True
            await send(
                {"type": "http.response.start", "status": st, "headers": [(b"content-type", ctype)] + extra}
            )

        async def line(obj: dict, more: bool) -> None:
            await send({"type": "http.response.body", "body": _line(obj), "more_body": more})

        async def inner_send(msg: dict) -> None:
            nonlocal status, headers, mode, finish_reason, usage, finished
            if finished:
                return
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
                headers = [
                    (k, v)
                    for k, v in msg.get("headers") or []
                    if k.lower().decode("latin-1") not in _HOP_HEADERS
                ]
                ctype = dict((k.lower(), v) for k, v in msg.get("headers") or []).get(b"content-type", b"")
                if status < 400 and ctype.startswith(b"text/event-stream"):
                    mode = "sse"
                    await start(200, NDJSON.encode(), headers + [(b"cache-control", b"no-cache")])
                else:
                    mode = "buffer"
                return
            if msg["type"] != "http.response.body":
                return
            more = bool(msg.get("more_body", False))
            if mode == "buffer":
                buf.extend(msg.get("body", b""))
                if more:
                    return
                finished = True
                if status >= 400:
                    err = _openai_error_body(bytes(buf))
                    get_record(self.request).set_error(err["type"], err["code"])
                    body = _line(err)
                    ctype = b"application/json"
                else:
                    data = json.loads(bytes(buf))
                    choice = (data.get("choices") or [{}])[0]
                    text = (choice.get("message") or {}).get("content") or ""
                    body = _line(self._final(choice.get("finish_reason"), data.get("usage"), text))
                    ctype = b"application/json"
                await start(status, ctype, headers + [(b"content-length", str(len(body)).encode())])
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            for ev in parser.feed(bytes(msg.get("body", b""))):
                if ev == "[DONE]":
                    finished = True
                    await line(self._final(finish_reason, usage), False)
                    return
                if not isinstance(ev, dict):
                    continue
                if "error" in ev:
                    err = ev["error"] if isinstance(ev["error"], dict) else {"message": str(ev["error"])}
                    get_record(self.request).set_error(err.get("type"), err.get("code"))
                    finished = True
                    await line(
                        {
                            "error": err.get("message", "error"),
                            "type": err.get("type"),
                            "code": err.get("code"),
                        },
                        False,
                    )
                    return
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices") or []:
                    if ch.get("index", 0) != 0:
                        continue
                    text = (ch.get("delta") or {}).get("content") or ""
                    if text:
                        await line(self._piece(text, False), True)
                    if ch.get("finish_reason"):
                        finish_reason = ch["finish_reason"]
            if not more and not finished:
                finished = True
                await line(self._final(finish_reason, usage), False)

        await self.inner(scope, receive, inner_send)


class OllamaAPI:
    """The Ollama routes, built on the /v1 chat-completions endpoint.

    Args:
        chat_endpoint: the /v1/chat/completions Starlette endpoint, ``async (request) -> ASGI response``;
            it may raise ``APIError`` (auth, limits, validation) or answer with an error status.
        model_card: returns the served ``ModelCard`` (or a dict with its fields), or None before the backend is ready.
        authenticate: ``async (request) -> Any`` raising ``APIError``; guards /api/tags, /api/show, /api/ps
            (chat/generate are authenticated by the pipeline). None: those routes are open.
        model_names: served model names (aliases included); default: the card's name.
        max_body_bytes: the largest body /api/chat, /api/generate and /api/show read (413 beyond, as /v1).
    """

    def __init__(
        self,
        chat_endpoint: Callable[[Request], Awaitable[Any]],
        model_card: Callable[[], Any],
        authenticate: Callable[[Request], Awaitable[Any]] | None = None,
        model_names: Callable[[], list[str]] | None = None,
        max_body_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.chat_endpoint = chat_endpoint
        self.model_card = model_card
        self.authenticate = authenticate
        self.model_names = model_names

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

    # ------------------------------------------------------------------ chat / generate

    async def chat(self, request: Request) -> Any:
        """POST /api/chat."""
        return await self._run(request, "chat")

    async def generate(self, request: Request) -> Any:
        """POST /api/generate."""
        return await self._run(request, "generate")

    async def _run(self, request: Request, kind: str) -> Any:
        rec = get_record(request)
        rec.api = "ollama"
        try:
            body = decode_json(await read_body(request, self.max_body_bytes))
            empty = isinstance(body, dict) and (
                (kind == "generate" and not body.get("prompt") and not body.get("system"))
                or (kind == "chat" and not body.get("messages"))
            )
            if empty:
                # Ollama: an empty prompt / message list only loads (keep_alive 0: unloads) the model.
                if self.authenticate is not None:
                    await self.authenticate(request)
                self._check_model(_model(body))
                obj: dict[str, Any] = {"model": body["model"], "created_at": now_rfc3339()}
                if kind == "chat":
                    obj["message"] = {"role": "assistant", "content": ""}
                else:
                    obj["response"] = ""
                obj.update(
                    done=True, done_reason="unload" if body.get("keep_alive") in (0, "0", "0s") else "load"
                )
                return JSONResponse(obj)
            oa = chat_to_openai(body) if kind == "chat" else generate_to_openai(body)
            inner = await self.chat_endpoint(subrequest(request, oa))
            rec.api = "ollama"  # the /v1 endpoint labels the record "openai"
        except APIError as exc:
            rec.set_error(exc.type, exc.code)
            return error_response(exc)
        return TranslatedResponse(inner, request, kind, oa["model"])

    # ------------------------------------------------------------------ model listing

    def _check_model(self, name: str) -> None:
        """Raises ``NotFound`` (404) unless ``name`` is the served model (when the card is known)."""
        names = list(self.model_names()) if self.model_names is not None else [self._card().get("name")]
        if any(names) and name not in names:
            raise NotFound(f"model '{name}' not found", param="model", code="model_not_found")

    def _card(self) -> dict:
        card = self.model_card()
        if card is None:
            return {}
        if isinstance(card, dict):
            return card
        return {f: getattr(card, f) for f in getattr(card, "__struct_fields__", ())}

    def _details(self, card: dict) -> dict:
        return {
            "parent_model": "",
            "format": "gguf" if str(card.get("model_path", "")).endswith(".gguf") else "safetensors",
            "family": card.get("architecture", "llama"),
            "families": [card.get("architecture", "llama")],
            "parameter_size": "",
            "quantization_level": card.get("quantization") or card.get("dtype", ""),
        }

    def _model_entry(self, card: dict) -> dict:
        path = card.get("model_path") or ""
        try:
            st = os.stat(path)
            size, mtime = st.st_size, st.st_mtime
        except OSError:
            size, mtime = 0, time.time()
        name = card.get("name", "")
        # Not the file's hash (too slow to compute per call): a stable id of (name, path, size, mtime).
        digest = hashlib.sha256(f"{name}\0{path}\0{size}\0{mtime}".encode()).hexdigest()
        return {
            "name": name,
            "model": name,
            "modified_at": datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z"),
            "size": size,
            "digest": digest,
            "details": self._details(card),
        }

    async def _auth(self, request: Request) -> JSONResponse | None:
        if self.authenticate is None:
            return None
        try:
            await self.authenticate(request)
        except APIError as exc:
            get_record(request).set_error(exc.type, exc.code)
            return error_response(exc)
        return None

    async def tags(self, request: Request) -> JSONResponse:
        """GET /api/tags: the served model."""
        if (err := await self._auth(request)) is not None:
            return err
        card = self._card()
        return JSONResponse({"models": [self._model_entry(card)] if card else []})

    async def ps(self, request: Request) -> JSONResponse:
        """GET /api/ps: the served model, always loaded."""
        if (err := await self._auth(request)) is not None:
            return err
        card = self._card()
        if not card:
            return JSONResponse({"models": []})
        e = self._model_entry(card)
        e.update(
            {
                "expires_at": "9999-12-31T23:59:59Z",
                "size_vram": 0 if card.get("device", "cpu") == "cpu" else e["size"],
                "context_length": card.get("context_length"),
            }
        )
        return JSONResponse({"models": [e]})

    async def version(self, request: Request) -> JSONResponse:
        """GET /api/version (no auth, as in Ollama: public in ``gateway.tenancy.PUBLIC_PATHS``)."""
        return JSONResponse({"version": OLLAMA_VERSION})

    async def show(self, request: Request) -> JSONResponse:
        """POST /api/show {"model"}: details, model_info (context length...), template, capabilities."""
        if (err := await self._auth(request)) is not None:
            return err
        try:
            body = decode_json(await read_body(request, self.max_body_bytes))
        except InvalidRequest:
            body = None
        except APIError as exc:
            get_record(request).set_error(exc.type, exc.code)
            return error_response(exc)
        name = (body.get("model") or body.get("name")) if isinstance(body, dict) else None
        card = self._card()
        if not name or not card or name != card.get("name"):
            return JSONResponse(
                {
                    "error": f"model '{name}' not found",
                    "type": "invalid_request_error",
                    "code": "model_not_found",
                },
                status_code=404,
            )
        arch = card.get("architecture", "llama")
        e = self._model_entry(card)
        return JSONResponse(
            {
                "modified_at": e["modified_at"],
                "details": e["details"],
                "model_info": {
                    "general.architecture": arch,
                    f"{arch}.context_length": card.get("context_length"),
                    "general.quantization": card.get("quantization"),
                    "gateway.device": card.get("device"),
                    "gateway.attention_backend": card.get("attention_backend"),
                    "gateway.dtype": card.get("dtype"),
                },
                "template": card.get("chat_template") or "",
                "parameters": "",
                "license": "",
                "capabilities": ["completion"],
            }
        )


_HOP_HEADERS = {"content-length", "content-type", "transfer-encoding", "connection", "x-request-id"}


def _line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
