"""Process-wide gateway state: ``Gateway``, the settings (``gateway.settings.Settings``) and the collaborators
read by the handlers: backend pool, tokenizer, chat template, tenancy, filters, metrics."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

import trio
from starlette.requests import Request

from auth.authenticator import Authenticator
from auth.errors import AuthError
from auth.principal import Principal
from backend.protocol import ModelCard
from gateway.backends.pool import BackendPool
from gateway.error_map import api_error
from gateway.errors import NotFound, ServiceUnavailable
from gateway.filters import OutputFilter, TenantFilters
from gateway.observability.metrics import GatewayMetrics
from gateway.settings import Settings
from gateway.structured.checker import GrammarChecker
from gateway.tenants import Tenants
from ratelimit.reservation import Reservation
from templating import ChatTemplate, TextTokenizer

T = TypeVar("T")


class Gateway:
    """Process-wide state, read-only for handlers: config, backend pool, tokenizer/template, plug-ins."""

    def __init__(
        self,
        settings: Settings,
        pool: BackendPool,
        tokenizer: TextTokenizer,
        template: ChatTemplate,
        *,
        tenancy: Tenants | None = None,
        filters: TenantFilters | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.config = settings.http  # the HTTP-side section, read on every request
        self.pool = pool
        self.tokenizer = tokenizer
        self.template = template
        self.tenancy = tenancy
        self.filters = filters
        self.metrics = metrics
        self.started = int(time.time())
        self._token_str: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}
        self._tok_limiter = trio.CapacityLimiter(max(2, os.cpu_count() or 2))
        self._grammars: GrammarChecker | None = None

    @property
    def grammars(self) -> GrammarChecker:
        """The grammar checker over the model's vocabulary (made on first use)."""
        if self._grammars is None:
            tok = self.tokenizer
            self._grammars = GrammarChecker(
                tok.tokenizer.to_str,
                tok.vocab_size,
                sorted(tok.stop_token_ids),
                max_bytes=self.config.grammar_max_bytes,
                timeout=self.config.grammar_timeout,
            )
        return self._grammars

    async def tokenize(self, fn: Callable[[], T], chars: int) -> T:
        """Run ``fn`` (templating/tokenizing, CPU-bound) inline for short prompts, else in a worker thread
        (at most ``cpu_count`` at once). Exceptions (``InvalidRequest``...) propagate unchanged."""
        limit = self.config.thread_tokenize_chars
        if limit <= 0 or chars <= limit:
            return fn()
        return await trio.to_thread.run_sync(fn, limiter=self._tok_limiter)

    def token_str(self, tid: int) -> str:
        """Printable text of one token (its bytes decoded with U+FFFD for partial UTF-8), cached."""
        s = self._token_str.get(tid)
        if s is None:
            s = self.tokenizer.id_to_bytes[tid].decode("utf-8", errors="replace")
            self._token_str[tid] = s
        return s

    def token_bytes(self, tid: int) -> list[int]:
        """The raw bytes of one token, as a list of ints (OpenAI logprobs ``bytes``), cached (callers only
        encode it)."""
        b = self._token_bytes.get(tid)
        if b is None:
            b = self._token_bytes[tid] = list(self.tokenizer.id_to_bytes[tid])
        return b

    @property
    def card(self) -> ModelCard:
        """The backends' model card. Raises ``ServiceUnavailable`` (503) while no backend is ready."""
        card = self.pool.card
        if card is None:
            raise ServiceUnavailable("No inference backend is ready yet.")
        return card

    def model_names(self) -> list[str]:
        card = self.pool.card
        names = [card.name] if card is not None else []
        return names + [n for n in self.config.served_model_name if n not in names]

    def check_model(self, model: str) -> str:
        """The served name for ``model``. Raises ``NotFound`` (404, param model) for an unknown model."""
        names = self.model_names()
        if model in names:
            return model
        raise NotFound(
            f"The model '{model}' does not exist. Available: {', '.join(names)}.",
            param="model",
            code="model_not_found",
        )

    async def authenticate(self, request: Request) -> Principal | None:
        """The request's principal: the auth middleware's, else (an app without it) authenticated here; None
        without tenancy. Raises ``AuthenticationError`` (401)."""
        if self.tenancy is None:
            return None
        return await self.tenancy.principal(request.scope)

    def admission(
        self, principal: Principal | None, prompt_tokens: int, max_tokens: int, model: str
    ) -> Callable[[str], AbstractAsyncContextManager[Reservation]] | None:
        """``factory(request_id)`` -> the admission context (429 ``RateLimited``, 503 on enter; see
        ``Tenants.admit``), or None without tenancy."""
        if self.tenancy is None or principal is None:
            return None
        tenants = self.tenancy
        return lambda rid: tenants.admit(
            principal, prompt_tokens=prompt_tokens, max_tokens=max_tokens, model=model, request_id=rid
        )

    def output_filter(self, principal: Principal | None) -> Callable[[], OutputFilter | None] | None:
        """``factory()`` -> a fresh output filter for one choice of this tenant, or None when the tenant has
        no output-stage hook (nothing held back)."""
        filters = self.filters
        if filters is None or not filters.pipeline(principal).filters_output:
            return None
        return lambda: filters.output_filter(principal)

    async def check_admin(self, request: Request) -> None:
        """Pass only the admin key (the auth middleware's verdict when it ran). Raises ``AuthenticationError``
        (401) or ``PermissionDenied`` (403, a tenant key)."""
        if self.tenancy is not None:
            await self.tenancy.require_admin(request.scope)
            return
        try:  # no tenancy: no tenant keys, only the configured admin key passes
            await Authenticator(None, admin_key=self.settings.tenancy.admin_key).check_admin(
                request.scope.get("headers") or [], request.scope.get("query_string") or b""
            )
        except AuthError as e:
            raise api_error(e) from None
