"""Models of kind ``openai``: an OpenAI-compatible server (vLLM, SGLang, llama-server, Ollama's /v1, a hosted
API) served behind this gateway's tenants, limits, content filters, metrics and usage ledger.

Layout (one noun a file)::

    config.py   UpstreamConfig: URLs, key source, upstream model name, send mode, timeouts, estimate factor
    model.py    OpenAIUpstream (the catalog's UpstreamModel): one httpx client, tokenizer; open_upstream()
    client.py   UpstreamClient: POST with failover over the URLs before the first byte; status mapping
    sse.py      an upstream answer (SSE or JSON) as OpenAI chunk objects; their finish reasons, tool calls
    call.py     UpstreamCall: the client's request -> the upstream's body and the prompt's token count
    usage.py    the tokens billed: the upstream's usage, else counted here (estimated)
    run.py      run_upstream: the call as the events of gateway.generation.events
    entry.py    upstream_chat / upstream_completion: what the request path calls

Errors (``gateway.errors`` tree; docs/upstream.md)::

    ValueError
    └── UpstreamConfigError        a [[models]] table of kind openai that cannot be used (start-up: one line)
    APIError
    ├── RateLimited (429)          the tenant's limits here, or the upstream's 429 with its retry-after
    ├── APIError (4xx)             the upstream's 4xx: the same status, type, param, code and message
    ├── UpstreamError (502)        upstream_error: a 5xx, a timeout, a broken or malformed answer, an
    │                              upstream refusing the gateway's own key (401/403); mid-stream: an SSE
    │                              error event, then the end of the stream
    └── UpstreamUnavailable (503)  upstream_unavailable: no URL reachable

Source followed: OpenAI API reference ("Create chat completion", "The chat completion chunk object",
"Completions (legacy)", ``stream_options.include_usage``).
"""

from gateway.upstream.config import UpstreamConfig, UpstreamConfigError
from gateway.upstream.entry import upstream_chat, upstream_completion
from gateway.upstream.errors import UpstreamError, UpstreamUnavailable
from gateway.upstream.model import OpenAIUpstream, open_upstream

__all__ = [
    "OpenAIUpstream",
    "UpstreamConfig",
    "UpstreamConfigError",
    "UpstreamError",
    "UpstreamUnavailable",
    "open_upstream",
    "upstream_chat",
    "upstream_completion",
]
