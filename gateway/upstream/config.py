"""``UpstreamConfig``: how the gateway reaches one model of kind ``openai`` (an OpenAI-compatible server).

Built from a ``[[models]]`` table (``gateway.sections.ModelSettings``): the kind's own keys
(``ModelSettings.upstream``) with the table's ``tokenizer`` and ``context_length`` (``gateway.launch``)::

    [[models]]
    name = "big"                          # the served name (ModelSettings)
    kind = "openai"                       # (ModelSettings)
    tokenizer = "/models/llama.gguf"      # optional: counts here; send = "prompt" renders its template
    context_length = 8192                 # optional: reserved when a request gives no max_tokens
    urls = ["http://10.0.0.5:8000/v1", "http://10.0.0.6:8000/v1"]   # the kind's own keys from here on
    upstream_model = "meta-llama/Llama-3.1-8B-Instruct"              # default: the served name
    api_key_env = "BIG_API_KEY"           # or api_key_file = "/run/secrets/big"; never logged
    send = "messages"                     # or "prompt": the gateway templates, /v1/completions
    ca_file = "/etc/ssl/internal-ca.pem"  # optional: https URLs verified with it (default: system CAs)
    prompt_as = "ids"                     # send = "prompt": token ids (default) or "text"

Timeouts (seconds): ``connect_timeout`` per URL; ``read_timeout``, the longest wait for any byte (httpx's);
``event_timeout``, the longest wait for the next event of the answer, where SSE comments (``: ping``) and blank
lines do not count, so an upstream that only pings cannot hold a request; ``deadline``, the whole upstream
request from its first connection to its last byte (LiteLLM's default request timeout, 600 s). Past either of
the last two the request ends with 504 ``upstream_timeout`` (an SSE error event once streaming) and its
upstream connection is closed.

Units: seconds for timeouts, tokens for ``context_length``, tokens per character for ``tokens_per_char``. Errors: ``UpstreamConfigError``
(a ``ValueError``) names the field, never the key (``gateway.launch`` puts the model's name first).
"""

from __future__ import annotations

import os
import ssl
from typing import Annotated, Literal

import httpx
import msgspec

#: Tokens reserved per prompt character when the model has no tokenizer here. BPE tokenizers of the
#: llama family write English at about 0.25 tokens a character and code or digits at up to 0.5; 0.5 is the
#: safety factor: an estimate that rarely falls short. The true-up at the end bills the upstream's count.
TOKENS_PER_CHAR = 0.5
#: Tokens of template text (role headers, markers) reserved per message on top of its characters.
TOKENS_PER_MESSAGE = 8
#: Tokens of template text reserved once per request: a default system prompt some templates add when the
#: conversation has none (SmolLM2's is about 30 tokens, Llama 3's date header about 25).
TOKENS_PER_REQUEST = 32


class UpstreamConfigError(ValueError):
    """A model of kind ``openai`` that cannot be used: no URL, a URL that is not http(s), an API key source
    that cannot be read. ``str()`` is one line naming the field (never the key)."""


def _meta(description: str, **constraints: float) -> msgspec.Meta:
    return msgspec.Meta(description=description, **constraints)


class UpstreamConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """One upstream model's connection (the ``kind = "openai"`` fields of a ``[[models]]`` table)."""

    urls: Annotated[list[str], _meta("base URLs of one model, tried in order (…/v1)")]
    upstream_model: Annotated[
        str | None, _meta("the model name the upstream knows (default: served name)")
    ] = None
    api_key_env: Annotated[str | None, _meta("environment variable holding the upstream's API key")] = None
    api_key_file: Annotated[str | None, _meta("file holding the upstream's API key")] = None
    send: Annotated[
        Literal["messages", "prompt"],
        _meta("messages: the upstream templates; prompt: the gateway templates and calls /v1/completions"),
    ] = "messages"
    prompt_as: Annotated[
        Literal["ids", "text"],
        _meta("send = prompt: the rendered prompt as token ids (exact) or as text (the upstream tokenizes)"),
    ] = "ids"
    tokenizer: Annotated[str | None, _meta("tokenizer (GGUF or HF dir) counting tokens here")] = None
    context_length: Annotated[
        int, _meta("tokens a request may use (reserved when max_tokens is absent)", ge=1)
    ] = 8192
    connect_timeout: Annotated[float, _meta("seconds to connect to one URL", gt=0)] = 3.0
    read_timeout: Annotated[float, _meta("seconds the upstream may send no byte at all", gt=0)] = 120.0
    event_timeout: Annotated[
        float, _meta("seconds the upstream may send no event (SSE comments count as silence)", gt=0)
    ] = 120.0
    deadline: Annotated[float, _meta("seconds one upstream request may take in all", gt=0)] = 600.0
    tokens_per_char: Annotated[
        float, _meta("tokens reserved per prompt character without a tokenizer", gt=0)
    ] = TOKENS_PER_CHAR
    ca_file: Annotated[str | None, _meta("CA certificates (PEM) https URLs are verified with")] = None

    def tls(self) -> ssl.SSLContext:
        """The TLS context of https URLs: the system's CAs, or ``ca_file``'s. Raises ``UpstreamConfigError``
        when ``ca_file`` cannot be read or holds no certificate."""
        try:
            return ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamConfigError(f"cannot load ca_file {self.ca_file}: {exc}") from None

    def check(self) -> None:
        """Raises ``UpstreamConfigError`` unless every URL is an absolute http(s) URL and the key source
        (if any) can be read."""
        if not self.urls:
            raise UpstreamConfigError("'urls' lists no URL")
        for u in self.urls:
            try:
                url = httpx.URL(u)
            except Exception:  # noqa: BLE001 - httpx.InvalidURL and its relatives
                url = None
            if url is None or url.scheme not in ("http", "https") or not url.host:
                raise UpstreamConfigError(f"'urls' holds {u[:200]!r}, not an http(s) URL")
        if self.send == "prompt" and self.tokenizer is None:
            raise UpstreamConfigError('send = "prompt" needs a tokenizer (its chat template)')
        self.api_key()
        self.tls()

    def api_key(self) -> str | None:
        """The upstream's API key: from ``api_key_env``, else ``api_key_file`` (stripped), else None.

        Raises:
            UpstreamConfigError: the variable is unset or empty, or the file cannot be read or is empty.
        """
        if self.api_key_env is not None:
            key = os.environ.get(self.api_key_env, "").strip()
            if not key:
                raise UpstreamConfigError(f"the variable {self.api_key_env} is unset or empty")
            return key
        if self.api_key_file is not None:
            try:
                with open(self.api_key_file, encoding="utf-8") as f:
                    key = f.read().strip()
            except OSError as exc:
                raise UpstreamConfigError(
                    f"cannot read api_key_file {self.api_key_file}: {exc.strerror}"
                ) from None
            if not key:
                raise UpstreamConfigError(f"api_key_file {self.api_key_file} is empty")
            return key
        return None
