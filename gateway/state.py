"""Process-wide gateway state: ``Gateway``, the settings (``gateway.settings.Settings``) and the collaborators
read by the handlers: the model catalog (``gateway.catalog``: each model's backend pool, tokenizer, chat
template and context length), tenancy, filters, metrics.

``Gateway.pool``, ``.tokenizer`` and ``.template`` are the default model's (the catalog's first); the request
path reads the model it resolved (``Gateway.resolve``) instead."""

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
from gateway.catalog import ModelCatalog, ServedModel
from gateway.error_map import api_error
from gateway.filters import OutputFilter, TenantFilters
from gateway.observability.metrics import GatewayMetrics
from gateway.settings import Settings
from gateway.tenants import Tenants
from ratelimit.reservation import RequestCount, Reservation
from templating import ChatTemplate, TextTokenizer

T = TypeVar("T")


class Gateway:
    """Process-wide state, read-only for handlers: config, the model catalog, plug-ins.

    Args:
        pool, tokenizer, template: the default model's (the catalog's first when ``catalog`` is given).
        catalog: every served model; None: one model, the default, from ``pool``/``tokenizer``/``template``
            (named by its backend card, ``[http] served_model_name`` as aliases).
    """

    def __init__(
        self,
        settings: Settings,
        pool: BackendPool,
        tokenizer: TextTokenizer,
        template: ChatTemplate,
        *,
        catalog: ModelCatalog | None = None,
        tenancy: Tenants | None = None,
        filters: TenantFilters | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.config = settings.http  # the HTTP-side section, read on every request
        if catalog is None:
            catalog = ModelCatalog(
                [
                    ServedModel(
                        None,
                        pool=pool,
                        aliases=settings.http.served_model_name,
                        tokenizer=tokenizer,
                        template=template,
                        grammar_max_bytes=settings.http.grammar_max_bytes,
                        grammar_timeout=settings.http.grammar_timeout,
                    )
                ]
            )
        self.catalog = catalog
        self.pool = pool
        self.tokenizer = tokenizer
        self.template = template
        self.tenancy = tenancy
        self.filters = filters
        self.metrics = metrics
        self.started = int(time.time())
        self._tok_limiter = trio.CapacityLimiter(max(2, os.cpu_count() or 2))

    def resolve(self, model: str, principal: Principal | None) -> ServedModel:
        """The served model ``model`` names for ``principal`` (``ModelCatalog.resolve``). Raises ``NotFound``
        (404 ``model_not_found``) for an unknown model or one the tenant may not use."""
        return self.catalog.resolve(model, principal)

    async def tokenize(self, fn: Callable[[], T], chars: int) -> T:
        """Run ``fn`` (templating/tokenizing, CPU-bound) inline for short prompts, else in a worker thread
        (at most ``cpu_count`` at once). Exceptions (``InvalidRequest``...) propagate unchanged."""
        limit = self.config.thread_tokenize_chars
        if limit <= 0 or chars <= limit:
            return fn()
        return await trio.to_thread.run_sync(fn, limiter=self._tok_limiter)

    @property
    def card(self) -> ModelCard:
        """The default model's card. Raises ``ServiceUnavailable`` (503) while no backend is ready."""
        return self.catalog.default.card

    def model_names(self) -> list[str]:
        """Every name of every served model (served names, then aliases, model by model)."""
        return [n for _, n in self.catalog.listing(None)]

    async def authenticate(self, request: Request) -> Principal | None:
        """The request's principal: the auth middleware's, else (an app without it) authenticated here; None
        without tenancy. Raises ``AuthenticationError`` (401)."""
        if self.tenancy is None:
            return None
        return await self.tenancy.principal(request.scope)

    async def count_request(self, principal: Principal | None, model: str) -> RequestCount | None:
        """Count the request against ``principal``'s rpm before any work proportional to its prompt
        (``Tenants.count_request``): the rpm headers, to pass to :meth:`admission` as ``counted``; None
        without tenancy. Raises ``RateLimited`` (429) or ``ServiceUnavailable`` (503)."""
        if self.tenancy is None or principal is None:
            return None
        return await self.tenancy.count_request(principal, model)

    def admission(
        self,
        principal: Principal | None,
        prompt_tokens: int,
        max_tokens: int,
        model: str,
        counted: RequestCount | None = None,
    ) -> Callable[[str], AbstractAsyncContextManager[Reservation]] | None:
        """``factory(request_id)`` -> the admission context (429 ``RateLimited``, 503 on enter; see
        ``Tenants.admit``), or None without tenancy. ``counted``: what :meth:`count_request` returned for a
        request counted already (its rpm is not charged again)."""
        if self.tenancy is None or principal is None:
            return None
        tenants = self.tenancy
        return lambda rid: tenants.admit(
            principal,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            model=model,
            request_id=rid,
            counted=counted,
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
