"""Tenants: the gateway's tenant services, opened and closed together.

Parts (each owns its state): the tenancy store (``auth.store.TenantStore``: SQLite or PostgreSQL) and its change
feed, key lookup and the admin key check (``auth.authenticator.Authenticator``), admission over the rate limits
(``ratelimit.admission.Admission``) and the usage ledger actor (``auth.ledger.UsageLedger``). This module wires
them, runs their lifecycle, and hands the gateway their errors as :class:`~gateway.errors.APIError`
(:mod:`gateway.error_map`; the store unreachable: 503 ``store_unavailable``)::

    async with Tenants("./data/gateway.db", redis_url=None, admin_key="...").running() as tenants:
        principal = await tenants.authenticate(scope["headers"], scope["query_string"])   # 401
        async with tenants.admit(principal, prompt_tokens=n, max_tokens=m, model=name, request_id=rid) as res:
            ...                                                                             # 429, 503
    # or: tenants = Tenants(...); await tenants.start(nursery); ...; await tenants.aclose()

Keys are never logged: the one place a key is printed is the announcement of the ``default`` tenant's first key
(stderr, once, when the database is created).
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from auth.authenticator import Authenticator
from auth.credentials import Headers
from auth.errors import AuthError, StoreUnavailable
from auth.ledger import UsageLedger
from auth.principal import Principal
from auth.store import ChangeFeed, TenantStore, is_postgres, open_store
from gateway.error_map import api_error, error_status
from gateway.middleware.asgi import Scope
from ratelimit.admission import Admission
from ratelimit.errors import AdmissionError
from ratelimit.local import LocalLimiter
from ratelimit.redis_limiter import RedisLimiter
from ratelimit.reservation import RequestCount, Reservation

DEFAULT_DB_PATH = "./data/gateway.db"


def default_spool_dir(db_path: str) -> str | None:
    """The ledger spool's folder for a store: the SQLite file's, ``./data`` for PostgreSQL, None for
    ``:memory:`` (no spool)."""
    if is_postgres(db_path):
        return "./data"
    return None if db_path == ":memory:" else os.path.dirname(os.path.abspath(db_path))


def _to_stderr(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class Tenants:
    """Tenants, keys, limits and usage of one gateway process.

    Args:
        db_path: SQLite file (created with its directory; WAL), ``":memory:"`` for throwaway use, or a
            ``postgresql://`` URL (shared by several gateways; with a change feed).
        redis_url: ``redis://host:port[/db]`` to share rate-limit state between processes; None: in-process.
        admin_key: the admin API key (Bearer); None disables the admin API (every admin call: 401).
        cache_ttl_s: seconds a key lookup is trusted without a change feed (see :mod:`auth.authenticator`).
        feed_ttl_s: seconds a key lookup is trusted while the change feed listens.
        stale_s: seconds after its last check a cached key is still served while the store is down.
        ledger_flush_s, ledger_batch: the ledger's batching (see :mod:`auth.ledger`; the crash-loss bound).
        spool_dir: the ledger spool's folder; None: the SQLite file's folder, ``./data`` for PostgreSQL, no
            spool for ``:memory:``.
        spool_rows: rows the spool may hold.
        limits_fail_open: while Redis does not answer, admit without shared limits instead of a 503
            (``ratelimit.admission``; off by default).
        create_default: on an empty database create tenant ``default`` with one key, announced once.
        redis_prefix: key prefix in Redis.
        announce: where the default key is announced (default: stderr).
    """

    def __init__(
        self,
        db_path: str = DEFAULT_DB_PATH,
        *,
        redis_url: str | None = None,
        admin_key: str | None = None,
        cache_ttl_s: float = 1.0,
        feed_ttl_s: float = 10.0,
        stale_s: float = 60.0,
        ledger_flush_s: float = 0.5,
        ledger_batch: int = 512,
        spool_dir: str | None = None,
        spool_rows: int = 100_000,
        limits_fail_open: bool = False,
        create_default: bool = True,
        redis_prefix: str = "gw:rl:",
        announce: Callable[[str], None] = _to_stderr,
    ) -> None:
        self.store: TenantStore = open_store(db_path)
        self.ledger = UsageLedger(
            self.store,
            batch=ledger_batch,
            flush_s=ledger_flush_s,
            spool_dir=spool_dir or default_spool_dir(db_path),
            spool_max_rows=spool_rows,
        )
        self.authenticator = Authenticator(
            self.store, admin_key=admin_key, cache_ttl_s=cache_ttl_s, feed_ttl_s=feed_ttl_s, stale_s=stale_s
        )
        limiter = RedisLimiter(redis_url, prefix=redis_prefix) if redis_url else LocalLimiter()
        self.admission = Admission(
            limiter, self.ledger, error_status=error_status, fail_open=limits_fail_open
        )
        self.create_default = create_default
        self.default_key: str | None = None  # set (in memory only) when this start created it
        self._announce = announce
        self._started = False
        self._feed_scope: trio.CancelScope | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Tenants]:
        """``async with Tenants(path, ...).running() as t:``: :meth:`start` in a nursery of its own, and on exit
        :meth:`aclose` (the queued ledger rows are written)."""
        async with trio.open_nursery() as nursery:
            await self.start(nursery)
            try:
                yield self
            finally:
                with trio.CancelScope(shield=True):
                    await self.aclose()

    async def start(self, nursery: trio.Nursery) -> None:
        """Open (create, migrate) the store, check the limiter, create the default tenant if the store is empty
        (after both answered, so its key is not announced by a start that then fails), start the change feed
        (PostgreSQL), the ledger writer and the limiter's task (Redis: the lease heartbeat) in ``nursery``.
        Raises ``auth.errors.StoreUnavailable`` when PostgreSQL cannot be reached, ``ratelimit.errors.StoreError``
        when Redis cannot."""
        await self.store.open()
        await self.admission.start()
        if self.create_default:
            await self.create_default_tenant()
        await nursery.start(self.admission.run)
        await nursery.start(self.ledger.run)
        if self.store.feed is not None:
            self._feed_scope = trio.CancelScope()
            await nursery.start(self._listen, self.store.feed)
        self._started = True

    async def create_default_tenant(self) -> None:
        """On an empty store, create tenant ``default`` with one key and announce the key (once: it is not stored
        in clear). The server calls this only once the model has loaded (``create_default=False`` to
        :class:`Tenants`), so a first start that fails does not spend the one showing of the key."""
        if await self.store.count_tenants() != 0:
            return
        try:
            t = await self.store.create_tenant("default")
        except ValueError:  # another gateway on the same store created it first: it announced the key
            return
        key, _ = await self.store.create_key(t.id, name="default")
        self.default_key = key
        self._announce(
            f"gateway: created tenant 'default' ({t.id}) with API key {key} -- shown once, store it now"
        )

    async def _listen(self, feed: ChangeFeed, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self._feed_scope:
            await feed.run(self.invalidate, task_status=task_status)

    async def aclose(self) -> None:
        """Write the queued ledger rows, close Redis and SQLite. Idempotent."""
        if not self._started:
            return
        self._started = False
        if self._feed_scope is not None:
            self._feed_scope.cancel()
        with trio.CancelScope(shield=True):
            await self.ledger.aclose()
            await self.admission.aclose()
            await self.store.aclose()

    def invalidate(self) -> None:
        """Forget cached key lookups: a change to keys, tenants or limits applies to the next request."""
        self.authenticator.invalidate()

    async def authenticate(self, headers: Headers, query_string: bytes = b"") -> Principal:
        """The principal of a tenant key (see ``Authenticator.authenticate``). Raises
        :class:`~gateway.errors.AuthenticationError` (401)."""
        try:
            return await self.authenticator.authenticate(headers, query_string)
        except AuthError as e:
            raise api_error(e) from None

    async def check_admin(self, headers: Headers, query_string: bytes = b"") -> None:
        """Pass only the admin key. Raises :class:`~gateway.errors.AuthenticationError` (401) or
        :class:`~gateway.errors.PermissionDenied` (403, a tenant key)."""
        try:
            await self.authenticator.check_admin(headers, query_string)
        except AuthError as e:
            raise api_error(e) from None

    async def require_admin(self, scope: Scope) -> None:
        """Pass a request the auth middleware let through as admin, else check its key here (an app without
        the middleware stays closed). Raises as :meth:`check_admin`."""
        if scope.get("state", {}).get("admin") is not True:
            await self.check_admin(scope.get("headers") or [], scope.get("query_string") or b"")

    async def principal(self, scope: Scope) -> Principal:
        """The principal the auth middleware found for this request, else authenticate it here. Raises as
        :meth:`authenticate`."""
        found = scope.get("state", {}).get("principal")
        if isinstance(found, Principal):
            return found
        return await self.authenticate(scope.get("headers") or [], scope.get("query_string") or b"")

    @asynccontextmanager
    async def admit(
        self,
        principal: Principal,
        *,
        prompt_tokens: int,
        max_tokens: int,
        model: str | None = None,
        request_id: str | None = None,
        counted: RequestCount | None = None,
    ) -> AsyncIterator[Reservation]:
        """``Admission.admit`` (see :mod:`ratelimit.admission`) raising :class:`~gateway.errors.RateLimited`
        (429) or :class:`~gateway.errors.ServiceUnavailable` (503: Redis, or the store for a daily quota's
        seed) on entry. ``model`` is the served name the request resolved to (canonical, not an alias): the
        tenant's ``model_limits`` for it are taken besides its own and its key's limits, and it is billed.
        ``counted``: the headers of :meth:`count_request` for a request counted already (no second rpm)."""
        try:
            async with self.admission.admit(
                principal,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                model=model,
                request_id=request_id,
                counted=counted,
            ) as res:
                yield res
        except (AdmissionError, StoreUnavailable) as e:
            raise api_error(e) from None

    async def count_request(self, principal: Principal, model: str | None = None) -> RequestCount:
        """Charge the request to the rpm of ``principal`` (tenant, key, the tenant's for served name
        ``model``) before its prompt is rendered (``Admission.count_request``): the ``x-ratelimit-*-requests``
        headers, for :meth:`admit`'s ``counted``. Raises :class:`~gateway.errors.RateLimited` (429) or
        :class:`~gateway.errors.ServiceUnavailable` (503, Redis did not answer)."""
        try:
            return await self.admission.count_request(principal, model=model)
        except (AdmissionError, StoreUnavailable) as e:
            raise api_error(e) from None

    async def clear_leases(self, tenant_id: str, models: list[str] | None = None) -> tuple[int, int, int]:
        """Free the concurrency slots of tenant ``tenant_id``, of its keys and of its limits for the served
        names ``models`` (the tenant's ``model_limits``), in every gateway sharing the limiter: (slots of the
        tenant scope, slots of its keys, slots of its model scopes). Raises
        :class:`~gateway.errors.ServiceUnavailable` (503, Redis or the store did not answer)."""
        try:
            keys = await self.store.list_keys(tenant_id)
            return await self.admission.clear_leases(tenant_id, [k.id for k in keys], models or [])
        except (AdmissionError, StoreUnavailable) as e:
            raise api_error(e) from None

    async def peek_headers(self, principal: Principal, model: str | None = None) -> dict[str, str]:
        """Current ``x-ratelimit-*`` headers of ``principal`` (with its limits for served name ``model``)
        without reserving anything."""
        return await self.admission.peek_headers(principal, model)
