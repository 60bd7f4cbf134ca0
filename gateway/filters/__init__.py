"""Content filters: per-tenant hooks before scheduling and on the output stream.

Public API (everything a caller needs; see docs/filters.md for the config schema and semantics):

- ``parse_config(obj) -> FilterConfig``: validate a tenant's filter JSON; raises ``ValueError``.
- ``build_pipeline(config, *, http_client=None) -> FilterPipeline``.
- ``pipeline_for(obj) -> FilterPipeline``: parse + build, cached by normalized config (per request).
- ``await pipeline.check_prompt(tenant_id, messages) -> messages``: may rewrite (redact); raises
  ``gateway.errors.ContentFiltered`` (400, code ``content_filter``, param ``messages``).
- ``pipeline.output_filter(tenant_id=None) -> OutputFilter``: ``await feed(text) -> str``,
  ``await flush() -> str``, ``.cut``, ``.result``, ``.window``, ``.held``.
- ``TenantFilters()``: the adapter for ``Gateway(filters=...)``: ``await check_prompt(principal,
  messages)``, ``output_filter(principal) -> OutputFilter | None``.
- Extending: subclass ``Hook`` (``check_prompt`` and/or ``output_scanner`` returning an
  ``OutputScanner``), then ``register_hook_type(MyHook)``.

Semantics follow Azure OpenAI content filtering
(https://learn.microsoft.com/azure/ai-services/openai/concepts/content-filter).
"""

from __future__ import annotations

from .base import ALL_ROLES, STAGES, Hook, OutputChunk, OutputCut, OutputScanner, PromptBlocked
from .blocklist import BlocklistHook
from .config import DEFAULT_WINDOW, HOOK_TYPES, FilterConfig, HookSpec, parse_config, register_hook_type
from .pii import PIIHook, find_pii, luhn_ok
from .pipeline import (
    NO_FILTERS,
    FilterPipeline,
    OutputFilter,
    build_pipeline,
    content_filter_result,
    pipeline_for,
)
from .plugin import TenantFilters
from .webhook import WebhookHook

for _cls in (BlocklistHook, PIIHook, WebhookHook):
    register_hook_type(_cls)

__all__ = [
    "ALL_ROLES",
    "STAGES",
    "DEFAULT_WINDOW",
    "HOOK_TYPES",
    "NO_FILTERS",
    "Hook",
    "OutputChunk",
    "OutputCut",
    "OutputScanner",
    "PromptBlocked",
    "BlocklistHook",
    "PIIHook",
    "WebhookHook",
    "FilterConfig",
    "HookSpec",
    "FilterPipeline",
    "OutputFilter",
    "parse_config",
    "build_pipeline",
    "pipeline_for",
    "register_hook_type",
    "content_filter_result",
    "find_pii",
    "luhn_ok",
    "TenantFilters",
]
