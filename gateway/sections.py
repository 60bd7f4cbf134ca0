"""The option tables of ``gateway.settings.Settings``: one ``Section`` per TOML table (``[http]``, ``[backend]``,
``[tenancy]``, ``[observability]``), each field an option with its type, range and ``--help`` text.

Loading, precedence and the command line are in :mod:`gateway.settings`; this module only declares.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from auth.store import check_location
from gateway.backends.address import link_credentials, parse_backend_url
from ratelimit.redis_client import redis_connection

_MODEL_NAME = re.compile(r"\S(.*\S)?")  # a served name or alias: no line break, no outer white space


def _opt(description: str, **constraints: float) -> msgspec.Meta:
    return msgspec.Meta(description=description, **constraints)


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of the option tables (an unknown key is an error)."""


class HTTPSettings(Section):
    """``[http]``: the listener and the HTTP-side limits."""

    host: Annotated[str, _opt("address to listen on")] = "127.0.0.1"
    port: Annotated[int, _opt("port to listen on", ge=0, le=65535)] = 8000
    max_body_bytes: Annotated[int, _opt("largest request body in bytes (413 beyond)", ge=1)] = 4 * 1024 * 1024
    sse_heartbeat: Annotated[float, _opt("seconds between ': ping' comments while waiting", gt=0)] = 5.0
    drain_timeout: Annotated[float, _opt("seconds in-flight requests get on shutdown", ge=0)] = 30.0
    thread_tokenize_chars: Annotated[
        int, _opt("prompts longer than this (characters) are tokenized in a worker thread; 0: never", ge=0)
    ] = 8192
    served_model_name: Annotated[
        list[str], _opt("alias of the one model without [[models]] (listed after its name)")
    ] = []
    grammar_max_bytes: Annotated[int, _opt("largest grammar or JSON Schema in bytes (400 beyond)", ge=1)] = (
        128 * 1024
    )
    grammar_timeout: Annotated[
        float, _opt("seconds a grammar may take to compile and check (400 beyond)", gt=0)
    ] = 2.0
    body_timeout: Annotated[
        float, _opt("seconds a request body may take to arrive (408 beyond; 0: none)", ge=0)
    ] = 30.0
    send_timeout: Annotated[
        float, _opt("seconds a client may leave a response unread (then: dropped)", ge=0)
    ] = 60.0
    keep_alive_timeout: Annotated[
        float, _opt("seconds an idle kept-alive connection (or one sending its headers) stays open", gt=0)
    ] = 30.0
    max_connections: Annotated[
        int, _opt("connections open at once (503 beyond; 0: the open-file limit less 128)", ge=0)
    ] = 0
    max_connections_per_client: Annotated[
        int,
        _opt("connections one client address may hold open (429 beyond; 0: no cap, behind a proxy)", ge=0),
    ] = 256
    filter_budget: Annotated[float, _opt("seconds of content-filter matching per request stage", gt=0)] = 1.0
    cors_origins: Annotated[list[str], _opt("origins allowed by CORS ('*': any)")] = msgspec.field(
        default_factory=lambda: ["*"]
    )


class BackendSettings(Section):
    """``[backend]``: which backends serve, and how the gateway talks to them."""

    model: Annotated[
        str | None,
        _opt(
            "model path (GGUF file or HF dir) of the one model without [[models]]; default: the default model"
        ),
    ] = None
    tokenizer: Annotated[
        str | None, _opt("tokenizer/template source of the one model without [[models]] (default: the model)")
    ] = None
    backend_url: Annotated[
        list[str],
        _opt("unix:PATH, tcp://HOST:PORT or tls://HOST:PORT of a running backend; none is spawned then"),
    ] = []
    backend_secret_file: Annotated[
        str | None,
        _opt(
            "file holding the shared secret of tcp:// and tls:// backend links (default: $LLM_BACKEND_SECRET)"
        ),
    ] = None
    backend_tls_ca_file: Annotated[
        str | None,
        _opt("CA certificates (PEM) that tls:// backends are verified with (default: the system's)"),
    ] = None
    backends: Annotated[
        int, _opt("backend processes to spawn (without --backend-url or [[models]])", ge=1)
    ] = 1
    backend_wait: Annotated[float, _opt("seconds a request waits for a restarting backend", ge=0)] = 30.0
    backend_startup_timeout: Annotated[float, _opt("seconds a spawned backend gets to be ready", gt=0)] = (
        600.0
    )
    request_buffer: Annotated[int, _opt("backend outputs queued per request (a memory cap)", ge=1)] = 4096
    max_failures: Annotated[
        int, _opt("backend failures in a row (with backoff) before the model is unavailable (503)", ge=1)
    ] = 5
    max_backlog_tokens: Annotated[
        int,
        _opt(
            "tokens generated but not yet read by the client, per choice, before the request is stopped", ge=1
        ),
    ] = 256
    routing: Annotated[
        Literal["prefix", "least-loaded"],
        _opt("how a request picks a backend: prefix (same prompt start, same backend) or least-loaded"),
    ] = "prefix"
    route_prefix_blocks: Annotated[
        int, _opt("leading full KV blocks of the prompt that choose its backend (routing = prefix)", ge=1)
    ] = 8
    route_max_waiting: Annotated[
        int,
        _opt(
            "requests the preferred backend may hold beyond the least-loaded one's before it is skipped", ge=0
        ),
    ] = 4

    def __post_init__(self) -> None:
        for url in self.backend_url:
            parse_backend_url(url)  # ValueError: a clear message naming the URL
        # ValueError: an unreadable or short secret file, a CA file that does not load
        link_credentials(self.backend_secret_file, self.backend_tls_ca_file, {})


class TenancySettings(Section):
    """``[tenancy]``: API keys, tenants and shared rate limits."""

    db: Annotated[
        str, _opt("tenancy store: a SQLite file path, or a postgresql:// URL shared by several gateways")
    ] = "./data/gateway.db"
    key_cache_s: Annotated[
        float, _opt("seconds a key lookup is trusted without a change feed (SQLite)", gt=0)
    ] = 1.0
    key_cache_feed_s: Annotated[
        float, _opt("seconds a key lookup is trusted while PostgreSQL's change feed listens", gt=0)
    ] = 10.0
    key_stale_s: Annotated[
        float, _opt("seconds after its last check a cached key is still served while the store is down", ge=0)
    ] = 60.0
    ledger_flush_s: Annotated[
        float, _opt("seconds a usage row may wait for its batch (the crash-loss window)", gt=0)
    ] = 0.5
    ledger_batch: Annotated[int, _opt("most usage rows per write (the crash-loss bound in rows)", ge=1)] = 512
    ledger_spool_dir: Annotated[
        str | None, _opt("folder of the usage spool (default: the SQLite file's folder, else ./data)")
    ] = None
    ledger_spool_rows: Annotated[
        int, _opt("usage rows the spool holds while the store is down (beyond: dropped, logged)", ge=0)
    ] = 100_000
    redis_url: Annotated[str | None, _opt("Redis URL for rate limits shared by several gateways")] = None
    limits_fail_open: Annotated[
        bool, _opt("while Redis does not answer, admit requests without rate limits (default: 503)")
    ] = False
    admin_key: Annotated[str | None, _opt("admin bearer key (admin API off without one)")] = None

    def __post_init__(self) -> None:
        check_location(self.db)  # ValueError: a URL that is not PostgreSQL's (not taken as a file path)
        if self.redis_url:
            redis_connection(self.redis_url)  # ValueError: a clear message naming what is wrong (no password)


class ObservabilitySettings(Section):
    """``[observability]``: logs and metrics (docs/observability.md)."""

    log_level: Annotated[str, _opt("DEBUG, INFO, WARNING or ERROR")] = "INFO"
    access_log: Annotated[str, _opt("JSON access-log lines: '-' (stderr), a file path, or 'off'")] = "-"
    log_content: Annotated[bool, _opt("DEBUG ONLY: prompt and output text in access-log lines")] = False
    metrics_tenant_label: Annotated[
        bool, _opt("tenant label on /metrics request counters (for a bounded set of tenants)")
    ] = False

    def __post_init__(self) -> None:
        self.log_level = self.log_level.upper()
        if self.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, not {self.log_level!r}")


class ModelSettings(Section):
    """``[[models]]``: one served model (a TOML array of tables, or ``--serve-model``; gateway/catalog.py).

    ``dtype``, ``kv_cache_memory`` and ``num_kv_blocks`` are ``python -m backend`` options of this model's
    spawned backends, as is every entry of ``engine`` (``max_num_seqs = 8``); they override ``[engine]``.
    ``upstream`` holds the settings of a model of another kind (``kind = "openai"``: read by that kind's
    module), left unread for a native model.
    """

    name: Annotated[str, msgspec.Meta(description="the served name (the request's model)", min_length=1)]
    aliases: Annotated[list[str], _opt("other names that resolve to this model")] = []
    kind: Annotated[
        str, _opt("native (this gateway's backends) or openai (an OpenAI-compatible upstream)")
    ] = "native"
    path: Annotated[str | None, _opt("model file (GGUF) or HF dir; default: the default model")] = None
    backend_url: Annotated[
        list[str],
        _opt("unix:PATH, tcp:// or tls://HOST:PORT of a running backend of this model (none spawned)"),
    ] = []
    replicas: Annotated[int, _opt("backend processes to spawn (without backend_url)", ge=1)] = 1
    dtype: Annotated[str | None, _opt("compute + KV dtype of the spawned backends")] = None
    kv_cache_memory: Annotated[str | None, _opt("KV pool budget of each spawned backend (256MiB)")] = None
    num_kv_blocks: Annotated[int, _opt("KV pool size in blocks of each spawned backend", ge=1)] | None = None
    engine: Annotated[dict[str, str | int | float | bool], _opt("other python -m backend options")] = {}
    tokenizer: Annotated[str | None, _opt("tokenizer source (GGUF file or HF dir); default: path")] = None
    chat_template: Annotated[
        str | None, _opt("Jinja chat template file; default: the tokenizer's (or the model file's)")
    ] = None
    context_length: (
        Annotated[int, _opt("tokens a request may use (at most the backend's); default: the backend's", ge=1)]
        | None
    ) = None
    upstream: Annotated[
        dict[str, str | int | float | bool | list[str]], _opt("settings of another kind")
    ] = {}

    def __post_init__(self) -> None:
        for n in (self.name, *self.aliases):  # the rule of a tenant's models (gateway/admin/schemas.py)
            if len(n) > 256 or not _MODEL_NAME.fullmatch(n):
                raise ValueError(
                    f"model name {n!r}: 1-256 characters, no line break, no leading or trailing white space"
                )
        if self.kind not in ("native", "openai"):
            raise ValueError(f"kind must be native or openai, not {self.kind!r}")
        if self.kind == "native" and self.upstream:
            raise ValueError(f"upstream: the keys of another kind (kind = {self.kind!r}: a native model)")
        if self.kind != "native":  # what only this gateway's backends read would be ignored silently
            given = [k for k in _NATIVE_KEYS if getattr(self, k) not in (None, [], {})]
            given += ["replicas"] if self.replicas != 1 else []
            if given:
                raise ValueError(
                    f"{', '.join(given)}: a native model's keys (a {self.kind} model takes name, aliases, "
                    "tokenizer, context_length and its kind's own keys)"
                )
        if self.kv_cache_memory is not None and self.num_kv_blocks is not None:
            raise ValueError("give kv_cache_memory or num_kv_blocks, not both")
        if self.backend_url and self.replicas != 1:  # one replica per URL: a count would be ignored
            raise ValueError("replicas: spawned backends only (with backend_url, each URL is one replica)")
        for url in self.backend_url:  # this model's own backends (the link's credentials: [backend])
            parse_backend_url(url)  # ValueError: a clear message naming the URL


_NATIVE_KEYS = ("path", "backend_url", "dtype", "kv_cache_memory", "num_kv_blocks", "engine", "chat_template")


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every option of the gateway. ``engine`` maps ``python -m backend`` option names (``num_kv_blocks``) to
    their command-line text, or True for a flag; only the options set are there (the backend's defaults
    apply to the rest). ``models``: the served models (``[[models]]``); empty: one model, the default,
    declared by ``[backend]`` (``model``, ``backend_url``, ``backends``, ``tokenizer``) and ``[http]
    served_model_name``."""

    http: HTTPSettings = msgspec.field(default_factory=HTTPSettings)
    backend: BackendSettings = msgspec.field(default_factory=BackendSettings)
    engine: dict[str, str | bool] = {}
    tenancy: TenancySettings = msgspec.field(default_factory=TenancySettings)
    observability: ObservabilitySettings = msgspec.field(default_factory=ObservabilitySettings)
    models: list[ModelSettings] = []


SECTIONS: dict[str, type[Section]] = {
    "http": HTTPSettings,
    "backend": BackendSettings,
    "tenancy": TenancySettings,
    "observability": ObservabilitySettings,
}
