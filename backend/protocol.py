"""Messages between the gateway and the backend process, and their framing.

The backend is token-in, token-out: it never sees text. Every message is a
``msgspec.Struct`` in one of two tagged unions (``ToBackend``, ``FromBackend``),
encoded as msgpack and sent as a frame::

    +----------------------+------------------------------+
    | 4-byte big-endian N  | N bytes of msgpack (one msg) |
    +----------------------+------------------------------+

N is at most ``MAX_FRAME_BYTES`` (a larger frame is a protocol error; the
receiver closes the connection); during the handshake at most
``MAX_HANDSHAKE_FRAME_BYTES``. New fields get defaults so that an older
peer can still decode; the handshake carries ``PROTOCOL_VERSION`` and a peer
with another major version is refused. A change to the handshake itself
(messages, order, proofs) bumps ``PROTOCOL_VERSION``.

Handshake (version 2): mutual challenge-response with HMAC-SHA256 over both
sides' fresh nonces, the client's proof first and the server's after it, as
in SCRAM (RFC 5802, ``ClientProof`` then ``ServerSignature``) and in the
HMAC challenge of RFC 2195. ``K`` is the shared secret (``load_secret``), never
sent; ``Nc``/``Ns`` are ``NONCE_BYTES`` random bytes each (``secrets``) chosen per
connection by the gateway and the backend::

    gateway                                           backend
      Hello{version, features, nonce=Nc}      -->
                                              <--     Challenge{nonce=Ns}
      Proof{proof=HMAC(K, "gateway" 0 Nc Ns)} -->     compare_digest, else Fatal + close
                                              <--     Ready{..., proof=HMAC(K, "backend" 0 Nc Ns)}
      compare_digest, else close

``proof_of`` computes both proofs (the role label keeps one side's proof from
being replayed as the other's). The backend reads nothing but ``Hello`` and
``Proof`` before the gateway's proof checks out, and gives the whole exchange
``HANDSHAKE_TIMEOUT_S``; a missing, wrong or late proof, or any other frame,
closes the connection (one log line; ``Fatal`` names no detail). A backend
without a secret (a unix socket, protected by its file permissions) answers
``Hello`` with ``Ready`` at once and no proof; a gateway that holds a secret
for that backend refuses such an answer (``AuthenticationFailed``), so a fake
backend cannot collect prompts. The handshake authenticates the two ends; the
frames after it are protected only by TLS (``--tls-cert``/``--tls-key``, a
``tls://`` backend URL), which a link over an untrusted network needs.

This module imports no torch: the gateway and plain-Python tests use it.
Source followed: msgspec's tagged unions
(https://jcristharif.com/msgspec/structs.html#tagged-unions); RFC 5802 section 3
(the proofs), RFC 2104 (HMAC).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Mapping
from typing import Literal

import msgspec

PROTOCOL_VERSION = 2  # 2: the authenticated handshake (Challenge, Proof, Ready.proof)
MAX_FRAME_BYTES = 16 * 1024 * 1024  # bytes
MAX_HANDSHAKE_FRAME_BYTES = 4096  # bytes: the largest frame read before the peer is authenticated
NONCE_BYTES = 32  # random bytes of each side's handshake nonce
HANDSHAKE_TIMEOUT_S = 5.0  # seconds the backend gives a connection to complete the handshake
MIN_SECRET_BYTES = 16  # a shorter shared secret is refused
SECRET_ENV = "LLM_BACKEND_SECRET"  # environment variable holding the shared secret itself
_HEADER = struct.Struct(">I")

FinishReason = Literal["stop", "length", "abort", "error"]

# Capability flags exchanged in the handshake (``Hello.features`` / ``Ready.features``). A peer without a
# flag keeps working for every request that does not use the feature; the gateway refuses (400) a request
# needing a feature its backend did not announce.
FEATURE_GRAMMAR = "grammar"  # Submit.grammar: token masks from JSON Schema / Lark / regex


# Process start. A backend that cannot load its model (missing file, not a model file, tensors missing, bad
# engine options for it) writes ONE line to stderr, ``LOAD_ERROR_PREFIX + "<path>: <reason>"``, and exits with
# ``EXIT_MODEL_LOAD_FAILED``: the supervisor that spawned it reads that line and status as the reason, and
# does not retry the first start (gateway/backends/supervisor.py). Other statuses: 0 after Shutdown or
# SIGTERM/SIGINT, 2 on bad arguments, anything else is a crash.
EXIT_MODEL_LOAD_FAILED = 3
LOAD_ERROR_PREFIX = "error: cannot load model "


def load_error_line(model: str, reason: str) -> str:
    """The one stderr line of a failed model load: ``error: cannot load model PATH: REASON``.

    Whitespace runs in ``reason`` (newlines of a multi-line exception text included) become one space, so
    the line is always one line.
    """
    return f"{LOAD_ERROR_PREFIX}{model}: {' '.join(reason.split())}"


class ProtocolError(Exception):
    """A frame or message that breaks the protocol (too large, undecodable, wrong version)."""


class FrameTooLarge(ProtocolError):
    """A frame header announced more than ``MAX_FRAME_BYTES`` bytes."""


class AuthenticationFailed(ProtocolError):
    """The handshake's proof was missing or wrong (either side), or one side needs a secret the other lacks."""


# ----------------------------------------------------------------------------- the shared secret


def load_secret(path: str | None, environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The shared secret: the contents of ``path`` (surrounding whitespace removed), else the environment
    variable ``SECRET_ENV``, else None.

    Raises:
        ValueError: the file cannot be read, or the secret is shorter than ``MIN_SECRET_BYTES`` (one line
            naming the file or the variable).
    """
    if path:
        try:
            with open(path, "rb") as f:
                secret, source = f.read().strip(), f"secret file {path}"
        except OSError as exc:
            raise ValueError(f"cannot read the secret file {path}: {exc.strerror or exc}") from None
    elif environ.get(SECRET_ENV):
        secret, source = environ[SECRET_ENV].strip().encode(), f"environment variable {SECRET_ENV}"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the {source} holds {len(secret)} bytes; a secret needs at least {MIN_SECRET_BYTES}"
        )
    return secret


def keepalive_options(idle_s: int, interval_s: int, count: int) -> list[tuple[int, int, int]]:
    """``(level, option, value)`` triples for ``setsockopt`` that turn on TCP keepalive: a probe after
    ``idle_s`` seconds of silence, then every ``interval_s`` seconds, the peer dead after ``count`` unanswered
    (tcp(7); the ``TCP_KEEP*`` options this platform has)."""
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return opts


def new_nonce() -> bytes:
    """``NONCE_BYTES`` fresh random bytes (``os.urandom``, what ``secrets.token_bytes`` reads)."""
    return os.urandom(NONCE_BYTES)


def proof_of(
    role: Literal["gateway", "backend"], secret: bytes, client_nonce: bytes, server_nonce: bytes
) -> bytes:
    """``HMAC-SHA256(secret, role || 0x00 || client_nonce || server_nonce)``: 32 bytes.

    Raises:
        AuthenticationFailed: a nonce is not ``NONCE_BYTES`` long (fixed lengths keep the concatenation
            unambiguous).
    """
    if len(client_nonce) != NONCE_BYTES or len(server_nonce) != NONCE_BYTES:
        raise AuthenticationFailed(f"handshake nonces must be {NONCE_BYTES} bytes")
    return hmac.new(secret, role.encode() + b"\0" + client_nonce + server_nonce, hashlib.sha256).digest()


def proof_matches(
    proof: bytes, role: Literal["gateway", "backend"], secret: bytes, client_nonce: bytes, server_nonce: bytes
) -> bool:
    """Whether ``proof`` is ``proof_of(role, ...)``, compared in constant time (``hmac.compare_digest``);
    False for bad nonces."""
    try:
        expected = proof_of(role, secret, client_nonce, server_nonce)
    except AuthenticationFailed:
        return False
    return hmac.compare_digest(proof, expected)


# ----------------------------------------------------------------------------- shared structs


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request sampling parameters (OpenAI / vLLM semantics).

    temperature 0 is greedy and never touches a random generator.
    presence/frequency penalties count generated tokens only (OpenAI);
    repetition_penalty (HF/CTRL style, divides positive logits) covers prompt
    and generated tokens, as in vLLM. logit_bias maps token id -> bias in
    [-100, 100] added to the logits before any filtering.
    seed None means a fresh random seed per request; the same seed and
    request give the same tokens whatever else is in the batch.
    logprobs: return the chosen token's logprob; top_logprobs (0..20): that
    many alternatives, taken from the raw distribution before any filtering.
    n > 1 forks the request after prefill: the n sequences share prompt blocks.
    speculative: let the engine draft tokens for this request and verify them in one pass (n-gram
    speculative decoding, lossless: the tokens are the same with it on or off); False opts out.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    speculative: bool = True


class ModelCard(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the backend serves, read from the model file's metadata."""

    name: str
    architecture: str = "llama"
    context_length: int = 2048  # tokens
    vocab_size: int = 0
    bos_token_id: int | None = None
    eos_token_ids: list[int] = []
    chat_template: str | None = None
    quantization: str | None = None  # e.g. "Q4_1" (of the file; weights are dequantized)
    dtype: str = "float32"  # compute dtype
    #: "int4" (every row through the row-invariant int4 kernel, no dense copy), "mixed" (generated rows int4,
    #: prompt rows dense) or "dense"
    weights: str = "dense"
    device: str = "cpu"
    attention_backend: str = "torch"
    model_path: str = ""


class TokenLogprob(msgspec.Struct, array_like=True):
    """One sampled token's log-probability and its top alternatives ``[(id, logprob), ...]``."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class Usage(msgspec.Struct, kw_only=True):
    """Token counts of one choice (tokens)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Timings(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Backend-side timings of one request, seconds (monotonic clock differences).

    queue: arrival -> first scheduled; prefill: first scheduled -> first token;
    decode: first token -> finish. ``ttft`` = queue + prefill.
    draft_tokens / accepted_tokens: speculative tokens proposed for this choice and accepted by
    verification (tokens; accepted <= drafted).
    """

    queue: float = 0.0
    prefill: float = 0.0
    decode: float = 0.0
    ttft: float = 0.0
    preemptions: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


MAX_TIMELINE_EVENTS = 1024  # entries kept per list of a ``Timeline`` (the rest only counted)


class Timeline(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the engine did for one choice, asked by ``Submit.inspect``; every time is seconds since the
    request's arrival at the backend (``time.monotonic()`` differences, the clock of ``Timings``).

    ``chunks``: the prompt chunks computed, ``(start, end, tokens)``: the step that computed them began at
    ``start`` and its model pass ended at ``end``; recompute chunks after a preemption are listed too (an
    ``n > 1`` choice shares its parent's prompt chunks). ``first_token``: this choice's first sampled token
    (equals ``Timings.ttft`` for choice 0). ``decode``: when each later token was sampled, one entry per
    decode step. ``preemptions``: when the choice was preempted. ``finish``: when it ended. Each list keeps
    its first ``MAX_TIMELINE_EVENTS`` entries; ``dropped`` counts the entries left out (all lists).
    """

    chunks: list[tuple[float, float, int]] = []
    first_token: float | None = None
    decode: list[float] = []
    preemptions: list[float] = []
    finish: float = 0.0
    dropped: int = 0


class Grammar(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the generated text, enforced by per-step token masks in the backend's sampler.

    ``kind``:

    * ``"json_schema"``: ``source`` is a JSON Schema document as JSON text (OpenAI ``response_format``
      ``json_schema``; ``{"type": "object"}`` is ``json_object``);
    * ``"lark"``: ``source`` is a Lark grammar in llguidance's dialect (``%json {...}`` embeds a schema;
      vLLM ``guided_grammar``, tool calls);
    * ``"regex"``: ``source`` is a regular expression the whole output must match.

    ``key``: hex digest of ``kind`` and ``source`` (``grammar_key``), the backend's compile-cache key; the
    text itself is never a cache key. The gateway has validated the grammar (size, compile time) before it
    sends it; the backend compiles it again against its own copy of the vocabulary.
    Source followed: llguidance (https://github.com/guidance-ai/llguidance, docs/syntax.md).
    """

    kind: Literal["json_schema", "lark", "regex"]
    source: str
    key: str = ""


def grammar_key(kind: str, source: str) -> str:
    """The compile-cache key of a grammar: sha256 of ``kind``, a NUL byte and ``source`` (64 hex chars)."""
    return hashlib.sha256(kind.encode() + b"\0" + source.encode()).hexdigest()


# ----------------------------------------------------------------------------- to the backend


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    """First message of a connection; the backend answers ``Challenge`` (it has a secret), ``Ready`` or
    ``Fatal``. ``nonce``: the gateway's ``NONCE_BYTES`` random bytes (``Nc`` of the module docstring)."""

    version: int = PROTOCOL_VERSION
    client: str = "gateway"
    features: list[str] = []  # capability flags the gateway uses (FEATURE_*)
    nonce: bytes = b""


class Proof(msgspec.Struct, tag="proof", kw_only=True):
    """The gateway's answer to ``Challenge``: ``proof_of("gateway", K, Nc, Ns)`` (32 bytes)."""

    proof: bytes


class Submit(msgspec.Struct, tag="submit", kw_only=True):
    """Start a request. ``cache_salt`` separates prefix-cache namespaces (tenant id by default).

    ``grammar``: constrain every choice's output (None: unconstrained, no cost). Needs the backend's
    ``FEATURE_GRAMMAR``; a backend without it answers ``RequestError`` code ``unsupported_feature``.
    ``inspect``: the last output of each choice carries its ``Timeline`` (an older backend ignores the
    flag and sends none).
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    cache_salt: str = ""
    grammar: Grammar | None = None
    arrival_time: float = 0.0  # sender's time.time(), seconds; informational
    inspect: bool = False  # record each choice's ``Timeline`` and send it with its last output


class Abort(msgspec.Struct, tag="abort", kw_only=True):
    """Stop a request and free everything it holds; unknown ids are ignored.

    ``index``: stop only that choice of an ``n > 1`` request (e.g. the gateway matched a stop string in
    it) and free its blocks; the other choices go on. ``None``: the whole request. A choice that has
    already ended, or one that is still computing the prompt shared by all choices, is left alone.
    """

    request_id: str
    index: int | None = None


class GetStats(msgspec.Struct, tag="get_stats", kw_only=True):
    """Ask for a ``Stats`` message."""

    nonce: int = 0


class Shutdown(msgspec.Struct, tag="shutdown", kw_only=True):
    """Stop the backend process after aborting everything in flight."""


ToBackend = Hello | Proof | Submit | Abort | GetStats | Shutdown
Handshake = Hello | Proof  # what the backend decodes before the gateway is authenticated

# ----------------------------------------------------------------------------- from the backend


class Challenge(msgspec.Struct, tag="challenge", kw_only=True):
    """The backend's answer to ``Hello`` when it has a secret: its ``NONCE_BYTES`` random bytes (``Ns``)."""

    nonce: bytes


class Ready(msgspec.Struct, tag="ready", kw_only=True):
    """Handshake answer: protocol version, model card and KV capacity. ``proof``: after a ``Challenge``,
    ``proof_of("backend", K, Nc, Ns)``; empty from a backend without a secret."""

    version: int
    model_card: ModelCard
    kv_blocks_total: int
    block_size: int  # tokens per KV block
    max_num_seqs: int
    max_num_batched_tokens: int
    features: list[str] = []  # capability flags the backend serves (FEATURE_*)
    proof: bytes = b""


class RequestOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New tokens of one choice of one request in one engine step.

    ``finish_reason`` is None until the choice's last output; the last output
    carries ``usage`` and ``timings`` (and ``timeline`` when the Submit asked to
    inspect). ``stop_token_id`` is set when an EOS or
    stop token ended it (that token is NOT in ``new_token_ids``).
    """

    request_id: str
    index: int = 0  # choice index (n > 1)
    new_token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    timeline: Timeline | None = None


class StepOutputs(msgspec.Struct, tag="step", kw_only=True):
    """Everything one engine step produced, batched into one frame."""

    outputs: list[RequestOutput]
    step: int = 0


class RequestError(msgspec.Struct, tag="request_error", kw_only=True):
    """A request failed (bad input or engine fault); only that request ends.

    code is an OpenAI-style code: "invalid_request_error", "context_length_exceeded",
    "invalid_token_id", "invalid_parameter", "unsupported_feature", "grammar_error" (the grammar failed
    to compile, or the output left it mid-generation), "internal_error".
    """

    request_id: str
    code: str
    message: str
    param: str | None = None


class Stats(msgspec.Struct, tag="stats", kw_only=True):
    """Engine counters (monotonic since start) and gauges (now)."""

    nonce: int = 0
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0  # free but holding reusable prefix-cache content
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens served from cache
    preemptions: int = 0
    aborts: int = 0
    requests_finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    device: str = "cpu"
    attention_backend: str = "torch"
    # speculative decoding (vLLM's spec_decode counters): verify chunks run, draft tokens proposed,
    # draft tokens accepted, and accepted drafts per draft position (index 0 = first draft token)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []


class Fatal(msgspec.Struct, tag="fatal", kw_only=True):
    """Connection-level error (bad frame, version mismatch); the backend closes the connection."""

    message: str


FromBackend = Challenge | Ready | StepOutputs | RequestError | Stats | Fatal


# ----------------------------------------------------------------------------- framing

_encoder = msgspec.msgpack.Encoder()


def encode_frame(msg: msgspec.Struct) -> bytes:
    """Encode one message as a length-prefixed frame.

    Raises:
        FrameTooLarge: the encoded body exceeds ``MAX_FRAME_BYTES``.
    """
    body = _encoder.encode(msg)
    if len(body) > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body length a frame's 4-byte header announces (bytes)."""
    return _HEADER.unpack(header)[0]


class FrameDecoder:
    """Incremental decoder of length-prefixed frames into messages of one union.

    ``feed(data)`` returns the complete messages seen so far. A frame body
    that fails to decode raises ``ProtocolError`` carrying the raw body's
    ``request_id`` when one can be recovered (so a bad Submit fails only its
    request); a header over ``max_frame`` raises ``FrameTooLarge``.
    """

    def __init__(self, union: object, max_frame: int = MAX_FRAME_BYTES) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)
        self._raw = msgspec.msgpack.Decoder()
        self._buf = bytearray()
        self._max = max_frame

    def feed(self, data: bytes) -> list:
        self._buf += data
        out = []
        while len(self._buf) >= 4:
            (n,) = _HEADER.unpack_from(self._buf, 0)
            if n > self._max:
                raise FrameTooLarge(f"frame of {n} bytes exceeds {self._max}")
            if len(self._buf) < 4 + n:
                break
            body = bytes(self._buf[4 : 4 + n])
            del self._buf[: 4 + n]
            try:
                out.append(self._decoder.decode(body))
            except msgspec.DecodeError as exc:
                err = ProtocolError(str(exc))
                err.request_id = _recover_request_id(self._raw, body)  # type: ignore[attr-defined]
                err.decoded = out  # type: ignore[attr-defined]  # messages before the bad one
                raise err from None
        return out


def _recover_request_id(raw: msgspec.msgpack.Decoder, body: bytes) -> str | None:
    try:
        obj = raw.decode(body)
    except msgspec.DecodeError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("request_id"), str):
        return obj["request_id"]
    return None


def to_backend_decoder() -> FrameDecoder:
    """Decoder for frames the backend receives."""
    return FrameDecoder(ToBackend)


def from_backend_decoder() -> FrameDecoder:
    """Decoder for frames the gateway receives."""
    return FrameDecoder(FromBackend)
