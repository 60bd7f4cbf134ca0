"""Tenancy: authentication of tenant keys, admission (rate limits + quotas), usage ledger, admin API.

Integration API for the gateway (see docs/tenancy.md for the full story)::

    from gateway.tenancy import Tenancy, TenancyMiddleware

    async with Tenancy.open("./data/gateway.db", redis_url=None, admin_key="...") as tenancy:
        app = Starlette(routes=[..., Mount("/admin/v1", routes=tenancy.routes()), *tenancy.openapi_routes()],
                        middleware=[Middleware(TenancyMiddleware, tenancy=tenancy)])
        ...
    # or: tenancy = Tenancy(...); await tenancy.start(nursery); ...; await tenancy.aclose()

    # in the chat handler (the middleware already authenticated: request.state.principal)
    principal = request.state.principal                  # or: await tenancy.authenticate(request)
    async with tenancy.admit(principal, prompt_tokens=n, max_tokens=m, model=name, request_id=rid) as res:
        headers = res.headers                            # x-ratelimit-* for the response
        ...                                              # res.update(completion_tokens=k) while streaming
        res.finish(completion_tokens=k, cached_tokens=c, finish_reason="stop", status=200, timings={...})
    # RateLimited (429) carries retry-after, retry-after-ms, x-ratelimit-* (and x-should-retry: false
    # for insufficient_quota) in exc.headers; other responses: headers = await tenancy.peek_headers(principal)

Errors raised: :class:`gateway.errors.AuthenticationError` (401), :class:`PermissionDenied` (403),
:class:`RateLimited` (429), :class:`InvalidRequest` (400). Keys are never logged: the only place a key is
ever printed is the one-time announcement of the ``default`` tenant's first key on stderr.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import sys
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import trio

from auth.keys import digest_equal, hash_key
from auth.ledger import UsageLedger
from auth.principal import Principal
from auth.store import AsyncStore, KeyRecord, Store, TenantRecord, utc_day
from gateway.errors import APIError, AuthenticationError, PermissionDenied, RateLimited, ServiceUnavailable
from ratelimit.core import Dim, DimResult, build_dims, headers_for
from ratelimit.local import LocalLimiter
from ratelimit.resp import RedisError

log = logging.getLogger("gateway.tenancy")

DEFAULT_DB_PATH = "./data/gateway.db"
# query parameters that could carry a credential: rejected (401) and redacted from the scope (access logs)
QUERY_KEY_PARAMS = frozenset(
    {
        "api_key",
        "api-key",
        "apikey",
        "key",
        "access_token",
        "token",
        "auth",
        "authorization",
        "bearer",
        "secret",
        "password",
    }
)
# Exactly what the gateway serves without a key (gateway/server.py: the playground is GET / and /static/*;
# /metrics: docs/observability.md; /health: liveness as vLLM's /health; /api/version: no auth, as in Ollama).
# Matched exactly (see classify_path): any other path, unknown ones, aliases and ``..`` forms included, needs
# a key first, so that an unauthenticated client learns nothing, not even a 404.
PUBLIC_PATHS = frozenset({"/", "/health", "/healthz", "/readyz", "/metrics", "/openapi.json", "/api/version"})
PUBLIC_PREFIXES = ("/static/",)


# ---------------------------------------------------------------------------------------------------------
def _headers_of(request: Any) -> list[tuple[bytes, bytes]]:
    scope = request if isinstance(request, Mapping) else request.scope
    return scope.get("headers") or []


def _scope_of(request: Any) -> Mapping[str, Any]:
    return request if isinstance(request, Mapping) else request.scope


def bearer_token(request: Any) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (scheme case-insensitive), else None."""
    for k, v in _headers_of(request):
        if k.lower() == b"authorization":
            try:
                text = v.decode("latin-1").strip()
            except Exception:
                return None
            scheme, _, tok = text.partition(" ")
            if scheme.lower() != "bearer" or not tok.strip():
                return ""
            return tok.strip()
    return None


def query_has_key(scope: Mapping[str, Any]) -> bool:
    from urllib.parse import parse_qsl

    qs = scope.get("query_string") or b""
    if not qs:
        return False
    try:
        pairs = parse_qsl(qs.decode("latin-1"), keep_blank_values=True)
    except Exception:
        return False
    return any(k.lower() in QUERY_KEY_PARAMS or v.startswith("sk-") for k, v in pairs)


def redact_query(scope: dict[str, Any]) -> bool:
    """Replace credential-like query parameters by ``REDACTED`` *in place* (the server's access log reads
    the same scope dict), returns True if something was redacted."""
    from urllib.parse import parse_qsl, urlencode

    qs = scope.get("query_string") or b""
    if not qs or not query_has_key(scope):
        return False
    pairs = parse_qsl(qs.decode("latin-1"), keep_blank_values=True)
    clean = [
        (k, "REDACTED" if (k.lower() in QUERY_KEY_PARAMS or v.startswith("sk-")) else v) for k, v in pairs
    ]
    scope["query_string"] = urlencode(clean).encode("latin-1")
    return True


def normalize_path(path: str) -> str:
    """Resolve ``.``, ``..`` and empty segments (``//``): ``/v1/../admin//x/`` -> ``/admin/x/``."""
    segs: list[str] = []
    for s in path.replace("\\", "/").split("/"):
        if s in ("", "."):
            continue
        if s == "..":
            if segs:
                segs.pop()
            continue
        segs.append(s)
    out = "/" + "/".join(segs)
    if path.endswith("/") and segs:
        out += "/"
    return out


def classify_path(
    path: str,
    method: str = "GET",
    *,
    public_paths: frozenset[str] = PUBLIC_PATHS,
    public_prefixes: tuple[str, ...] = PUBLIC_PREFIXES,
) -> str:
    """``"public"``, ``"admin"`` or ``"tenant"`` for a request path (the strictest of the raw and the
    normalized path wins: a path is public only if both forms are; admin if either form is under /admin).
    Public means an exact member of ``public_paths`` (``/health/`` or ``/health/../admin`` is not) or a
    ``..``/``//``-free path under ``public_prefixes``. OPTIONS (CORS preflight) is public. Unknown paths are
    ``tenant`` so a 404 never leaks before auth."""
    if method.upper() == "OPTIONS":
        return "public"
    norm = normalize_path(path)
    for p in (path, norm):
        pl = p.lower()
        if pl == "/admin" or pl.startswith("/admin/"):
            return "admin"

    def public(p: str) -> bool:
        return p in public_paths or (p.startswith(public_prefixes) and ".." not in p and "//" not in p)

    if public(path) and public(norm):
        return "public"
    return "tenant"


# ---------------------------------------------------------------------------------------------------------
class Reservation:
    """An admitted request's reservation: ``prompt_tokens + max_tokens`` tokens, one request, one
    concurrency slot. Trued up when the ``admit`` block exits (however it exits) and billed to the ledger.

    Attributes:
        headers: ``x-ratelimit-*`` headers as of admission (put them on the response).
        final_headers: the same after the true-up (available after exit).
        request_id, model, prompt_tokens, max_tokens, reserved_tokens (tokens), started_at (UNIX seconds).
    """

    def __init__(
        self,
        tenancy: Tenancy,
        principal: Principal,
        dims: list[Dim],
        member: str,
        prompt_tokens: int,
        max_tokens: int,
        model: str | None,
        request_id: str | None,
        results: list[DimResult],
    ) -> None:
        self._tenancy = tenancy
        self.principal = principal
        self._dims = dims
        self._member = member
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.reserved_tokens = prompt_tokens + max_tokens
        self.model = model
        self.request_id = request_id
        self.started_at = time.time()
        self.headers: dict[str, str] = headers_for(results)
        self._final_headers: dict[str, str] | None = None
        self._final_results: list[DimResult] | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.status: int | str | None = None
        self.timings: dict[str, Any] = {}
        self.finished = False
        self.closed = False

    def update(
        self,
        *,
        completion_tokens: int | None = None,
        cached_tokens: int | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        """Record progress (tokens so far): what is billed if the request ends without :meth:`finish`."""
        if completion_tokens is not None:
            self.completion_tokens = int(completion_tokens)
        if cached_tokens is not None:
            self.cached_tokens = int(cached_tokens)
        if prompt_tokens is not None:
            self.prompt_tokens = int(prompt_tokens)

    def finish(
        self,
        *,
        completion_tokens: int,
        cached_tokens: int = 0,
        finish_reason: str | None = None,
        status: int | str = 200,
        timings: dict[str, Any] | None = None,
        prompt_tokens: int | None = None,
        model: str | None = None,
    ) -> None:
        """Mark the request complete (tokens; ``timings`` in seconds, e.g. ``{"ttft_s":..,"total_s":..}``).
        Pass ``prompt_tokens=0`` for a request rejected before the backend saw it (nothing billed)."""
        self.update(
            completion_tokens=completion_tokens, cached_tokens=cached_tokens, prompt_tokens=prompt_tokens
        )
        self.finish_reason = finish_reason
        self.status = status
        if timings:
            self.timings.update(timings)
        if model is not None:
            self.model = model
        self.finished = True

    @property
    def used_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def final_headers(self) -> dict[str, str]:
        """``x-ratelimit-*`` after the true-up (computed on first access; before exit: the admission's)."""
        if not self.closed:
            return dict(self.headers)
        if self._final_headers is None:
            if self._final_results is not None:
                results = self._final_results
            else:  # in-process: the state now
                results = self._tenancy.limiter.peek_now([d for d in self._dims if d.kind == "bucket"])
            self._final_headers = headers_for([r for r in results if r.dim.kind == "bucket"])
        return self._final_headers

    async def aclose(self, exc: BaseException | None = None) -> dict[str, str]:
        """True up the reservation and write the ledger row; idempotent; cancel-shielded (bounded to 5 s
        with Redis). Returns the headers after the true-up."""
        if self.closed:
            return self.final_headers
        self.closed = True
        if not self.finished:
            if isinstance(exc, trio.Cancelled) or exc is None:
                self.status, self.finish_reason = 499, "abort"  # client went away / aborted
            elif isinstance(exc, APIError):
                self.status, self.finish_reason = exc.status, "error"
            else:
                self.status, self.finish_reason = 500, "error"
        self.timings.setdefault("total_s", round(time.time() - self.started_at, 6))
        t = self._tenancy
        if not t.limiter.shared:
            try:
                t._release_now(self)  # in-process: synchronous (no checkpoint), nothing to shield
            except Exception:
                log.exception("tenancy: true-up failed for tenant %s", self.principal.tenant_id)
            t._record(self)
            return self.final_headers
        with trio.CancelScope(shield=True):
            try:
                with trio.fail_after(5):
                    self._final_results = await t._release(self)
            except Exception:
                log.exception("tenancy: true-up failed for tenant %s", self.principal.tenant_id)
            t._record(self)
        return self.final_headers


class _Admit:
    """Async context manager returned by :meth:`Tenancy.admit`."""

    def __init__(self, tenancy: Tenancy, principal: Principal, kw: dict[str, Any]) -> None:
        self.tenancy, self.principal, self.kw = tenancy, principal, kw
        self.res: Reservation | None = None

    async def __aenter__(self) -> Reservation:
        self.res = await self.tenancy.reserve(self.principal, **self.kw)
        return self.res

    async def __aexit__(self, et, exc, tb) -> None:
        assert self.res is not None
        await self.res.aclose(exc)


# ---------------------------------------------------------------------------------------------------------
class Tenancy:
    """Tenants, keys, limits and usage of one gateway process.

    Args:
        db_path: SQLite file (created with its directory; WAL). ``":memory:"`` for throwaway use.
        redis_url: ``redis://host:port[/db]`` to share rate-limit state between processes; None = in-process.
        admin_key: the admin API key (Bearer); None disables the admin API (every admin call -> 401).
        cache_ttl_s: seconds a key/tenant lookup is cached (revocations and limit changes made by *this*
            process apply at once; made by another process sharing the DB, within this delay).
        create_default: on an empty database create tenant ``default`` + one key, printed once to stderr.
        redis_prefix: key prefix in Redis.
    """

    def __init__(
        self,
        db_path: str = DEFAULT_DB_PATH,
        *,
        redis_url: str | None = None,
        admin_key: str | None = None,
        cache_ttl_s: float = 1.0,
        create_default: bool = True,
        redis_prefix: str = "gw:rl:",
        announce=None,
    ) -> None:
        self.db_path = db_path
        self.redis_url = redis_url
        self._admin_digest = hash_key(admin_key) if admin_key else None
        self.cache_ttl_s = cache_ttl_s
        self.create_default = create_default
        self.store_timeout_s = 5.0  # seconds one shared-store (Redis) round-trip may take before a 503
        self.store = AsyncStore(db_path)
        if redis_url:
            from ratelimit.redis_limiter import RedisLimiter

            self.limiter: Any = RedisLimiter(redis_url, prefix=redis_prefix)
        else:
            self.limiter = LocalLimiter()
        self.ledger = UsageLedger(self.store)
        self._cache: dict[str, tuple[float, KeyRecord, TenantRecord]] = {}
        self._misses: dict[str, float] = {}  # digest of an unknown key -> monotonic expiry
        self._day_start, self._day_text = -1.0, ""
        self._seeds: dict[str, int] = {}  # daily counter key -> tokens in the ledger when first seen
        self._seed_day = ""
        self._announce = announce or (lambda text: (sys.stderr.write(text + "\n"), sys.stderr.flush()))
        self._started = False
        self.default_key: str | None = None  # only set (in memory) when this open created it

    # -- lifecycle ----------------------------------------------------------------------------------------
    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, db_path: str = DEFAULT_DB_PATH, **kw: Any) -> AsyncIterator[Tenancy]:
        """``async with Tenancy.open(path, redis_url=..., admin_key=...) as t:`` -- opens the DB (migrating
        it), starts the ledger writer, and on exit flushes the ledger and closes everything."""
        self = cls(db_path, **kw)
        async with trio.open_nursery() as nursery:
            await self.start(nursery)
            try:
                yield self
            finally:
                with trio.CancelScope(shield=True):
                    await self.aclose()

    async def start(self, nursery: trio.Nursery) -> None:
        """Open the store, create the default tenant if the DB is empty, start the ledger task in ``nursery``."""
        await self.store.open()
        if self.create_default and await self.store.call(Store.count_tenants) == 0:
            t = await self.store.call(Store.create_tenant, "default")
            key, rec = await self.store.call(Store.create_key, t.id, name="default")
            self.default_key = key
            self._announce(
                f"gateway: created tenant 'default' ({t.id}) with API key {key} -- shown once, store it now"
            )
        if self.redis_url:
            await self.limiter.client.execute("PING")
        await nursery.start(self.ledger.run)
        self._started = True

    async def aclose(self) -> None:
        """Flush the usage ledger, close Redis and SQLite. Idempotent."""
        if not self._started:
            return
        self._started = False
        with trio.CancelScope(shield=True):
            await self.ledger.aclose()
            await self.limiter.aclose()
            await self.store.aclose()

    def invalidate(self) -> None:
        """Forget cached key/tenant records (called after every admin change: they apply at once)."""
        self._cache.clear()
        self._misses.clear()

    # -- authentication -----------------------------------------------------------------------------------
    async def _lookup(self, token: str) -> tuple[KeyRecord, TenantRecord] | None:
        digest = hash_key(token)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            rec = hit[1], hit[2]
        else:
            miss = self._misses.get(digest)
            if miss is not None and miss > now:
                return None  # a flood of wrong keys does not reach the DB thread
            found = await self.store.call(Store.find_key, digest)
            if found is None:
                if len(self._misses) > 10_000:
                    self._misses.clear()
                self._misses[digest] = now + self.cache_ttl_s
                return None
            rec = found
            if len(self._cache) > 100_000:
                self._cache.clear()
            self._cache[digest] = (now + self.cache_ttl_s, rec[0], rec[1])
        if not digest_equal(rec[0].hash, digest):
            return None
        return rec

    async def authenticate(self, request: Any) -> Principal:
        """The :class:`Principal` of a request (starlette Request or ASGI scope).

        Only ``Authorization: Bearer <key>`` is accepted. Raises AuthenticationError (401, OpenAI body) for a
        missing/malformed header, a credential in the query string, an unknown, revoked or expired key, a
        disabled or deleted tenant. The key never appears in a message or a log line.
        """
        scope = _scope_of(request)
        state = scope.get("state")
        if (
            isinstance(state, dict)
            and isinstance(state.get("principal"), Principal)
            and state.get("_tenancy") is self
        ):
            return state["principal"]  # TenancyMiddleware already authenticated this very request
        if query_has_key(scope):
            raise AuthenticationError(
                "API keys are not accepted in the query string; use the Authorization: Bearer header.",
                headers={"www-authenticate": "Bearer"},
            )
        token = bearer_token(request)
        if not token:
            raise AuthenticationError(
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                code=None,
                headers={"www-authenticate": "Bearer"},
            )
        found = await self._lookup(token)
        if found is None:
            raise AuthenticationError("Incorrect API key provided.", headers={"www-authenticate": "Bearer"})
        key, tenant = found
        now = time.time()
        if key.revoked_at is not None:
            raise AuthenticationError(
                "This API key has been revoked.", headers={"www-authenticate": "Bearer"}
            )
        if key.expires_at is not None and key.expires_at <= now:
            raise AuthenticationError("This API key has expired.", headers={"www-authenticate": "Bearer"})
        if tenant.disabled or tenant.deleted_at is not None:
            raise AuthenticationError(
                "This API key's tenant is disabled.",
                code="tenant_disabled",
                headers={"www-authenticate": "Bearer"},
            )
        return Principal(
            tenant.id, tenant.name, key.id, key.prefix, tenant.limits, key.limits, tenant.filters
        )

    def is_admin_token(self, token: str | None) -> bool:
        return (
            bool(token)
            and self._admin_digest is not None
            and digest_equal(hash_key(token), self._admin_digest)
        )

    async def require_admin(self, request: Any) -> None:
        """Allow only the admin key (``await`` it!). Raises AuthenticationError (401) for no/wrong key or when
        no admin key is configured, PermissionDenied (403) for a valid tenant key."""
        scope = _scope_of(request)
        if query_has_key(scope):
            raise AuthenticationError(
                "API keys are not accepted in the query string; use the Authorization: Bearer header."
            )
        token = bearer_token(request)
        if not token:
            raise AuthenticationError(
                "This route requires the admin API key (Authorization: Bearer).", code=None
            )
        if self.is_admin_token(token):
            return
        found = await self._lookup(token)
        if found is not None and found[0].revoked_at is None:
            raise PermissionDenied("This API key is not allowed to use the admin API.", code="admin_required")
        raise AuthenticationError("Incorrect admin API key provided.")

    # -- admission ----------------------------------------------------------------------------------------
    def _dims(self, principal: Principal, tokens: int, day: str, ttl: float) -> list[Dim]:
        dims = build_dims(
            principal.limits,
            f"t:{principal.tenant_id}",
            f"tenant {principal.tenant_name}",
            tokens=tokens,
            day=day,
            day_ttl_s=ttl,
        )
        if principal.key_limits is not None:
            dims += build_dims(
                principal.key_limits,
                f"k:{principal.key_id}",
                f"key {principal.key_prefix}...",
                tokens=tokens,
                day=day,
                day_ttl_s=ttl,
            )
        return dims

    async def _seed_daily(self, dims: list[Dim], day: str) -> None:
        """Set ``seed`` of daily dimensions: tokens already in the ledger for that day (read once per process
        and day), so a restart does not reset a daily quota. Used by the limiter only when its counter for
        the day does not exist yet."""
        if self._seed_day != day:
            self._seeds.clear()
            self._seed_day = day
            if hasattr(self.limiter, "prune_daily"):
                self.limiter.prune_daily(day)
        for d in dims:
            if d.kind != "daily":
                continue
            seed = self._seeds.get(d.key)
            if seed is None:
                kind, ident = d.key.split(":")[0], d.key.split(":")[1]
                if kind == "t":
                    seed = await self.store.call(Store.tokens_on_day, tenant_id=ident, day=day)
                else:
                    seed = await self.store.call(Store.tokens_on_day, key_id=ident, day=day)
                self._seeds[d.key] = seed
            d.seed = seed

    def reserve_sync_possible(self) -> bool:
        return not self.limiter.shared

    async def reserve(
        self,
        principal: Principal,
        *,
        prompt_tokens: int,
        max_tokens: int,
        model: str | None = None,
        request_id: str | None = None,
    ) -> Reservation:
        """Check and reserve all limits at once (1 request, ``prompt_tokens + max_tokens`` tokens, 1 slot).
        Prefer :meth:`admit`; a reservation from here must be closed with ``await res.aclose(exc)``.
        Raises RateLimited (429)."""
        if prompt_tokens < 0 or max_tokens < 0:
            raise ValueError("token counts must be >= 0")
        now = time.time()
        day, ttl = self._day(now)
        tokens = prompt_tokens + max_tokens
        dims = self._dims(principal, tokens, day, ttl)
        member = request_id or secrets.token_hex(8)
        results: list[DimResult] = []
        if dims:
            if any(d.kind == "daily" for d in dims):
                await self._seed_daily(dims, day)
            # in-process: no checkpoint between check and reserve (atomic under Trio); Redis: one Lua script,
            # shielded so that a cancellation cannot lose a reservation made on the server
            if self.limiter.shared:
                try:
                    with trio.CancelScope(shield=True):
                        with trio.fail_after(self.store_timeout_s):
                            outcome = await self.limiter.acquire(dims, member)
                except (OSError, RedisError, trio.TooSlowError) as e:
                    log.error("tenancy: rate-limit store unavailable: %s", type(e).__name__)
                    await self._undo_acquire(dims, member)
                    raise ServiceUnavailable(
                        "The rate limiter is unavailable; try again shortly.",
                        code="rate_limiter_unavailable",
                        headers={"retry-after": "1"},
                    ) from None
            else:
                outcome = self.limiter.acquire_now(dims, member)
            if not outcome.ok:
                raise self._rate_limited(principal, outcome.results, tokens)
            results = outcome.results
        return Reservation(
            self, principal, dims, member, prompt_tokens, max_tokens, model, request_id, results
        )

    async def _undo_acquire(self, dims, member: str) -> None:
        """The shared store's reply to an acquire never came (timeout, dropped connection), so the script may
        have reserved everything anyway: take it back if it did (``RedisLimiter.undo`` checks the acquire's
        marker, so it never refunds what was not taken). Shielded and bounded (5 s); failures are logged."""
        undo = getattr(self.limiter, "undo", None)
        if undo is None:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(max(5.0, self.store_timeout_s)):
            try:
                if await undo(dims, member):
                    log.warning("tenancy: took back a reservation whose reply was lost")
            except (OSError, RedisError) as e:
                log.error(
                    "tenancy: could not take back a possibly-made reservation: %s (it expires with "
                    "its window / lease)",
                    type(e).__name__,
                )

    def admit(
        self,
        principal: Principal,
        *,
        prompt_tokens: int,
        max_tokens: int,
        model: str | None = None,
        request_id: str | None = None,
    ) -> _Admit:
        """``async with tenancy.admit(p, prompt_tokens=.., max_tokens=..) as res:`` -- see module doc.
        Raises RateLimited (429) on entry; on exit (any way) trues up and bills the ledger."""
        return _Admit(
            self,
            principal,
            dict(prompt_tokens=prompt_tokens, max_tokens=max_tokens, model=model, request_id=request_id),
        )

    async def peek_headers(self, principal: Principal) -> dict[str, str]:
        """Current ``x-ratelimit-*`` headers of a principal without reserving anything."""
        now = time.time()
        dims = [d for d in self._dims(principal, 0, self._day(now)[0], 1.0) if d.kind == "bucket"]
        if not dims:
            return {}
        return headers_for(await self.limiter.peek(dims))

    @staticmethod
    def _refunds(res: Reservation) -> dict[str, int]:
        refund = res.reserved_tokens - res.used_tokens
        return {d.key: refund for d in res._dims if d.name in ("tokens", "daily_tokens")}

    def _day(self, now: float) -> tuple[str, float]:
        """(UTC day ``YYYY-MM-DD``, seconds until the next UTC midnight) of UNIX time ``now`` (POSIX days are
        86400 s)."""
        start = now - (now % 86400.0)
        if start != self._day_start:
            self._day_start, self._day_text = start, utc_day(start)
        return self._day_text, max(0.001, start + 86400.0 - now)

    def _release_now(self, res: Reservation) -> None:
        if res._dims:
            self.limiter.release_now(res._dims, res._member, self._refunds(res), report=False)

    async def _release(self, res: Reservation) -> list[DimResult]:
        if not res._dims:
            return []
        return await self.limiter.release(res._dims, res._member, self._refunds(res))

    def _record(self, res: Reservation) -> None:
        p = res.principal
        self.ledger.record(
            {
                "ts": (now := time.time()),
                "day": self._day(now)[0],
                "tenant_id": p.tenant_id,
                "key_id": p.key_id,
                "key_prefix": p.key_prefix,
                "request_id": res.request_id,
                "model": res.model,
                "prompt_tokens": res.prompt_tokens,
                "cached_tokens": res.cached_tokens,
                "completion_tokens": res.completion_tokens,
                "total_tokens": res.used_tokens,
                "status": res.status,
                "finish_reason": res.finish_reason,
                "timings": res.timings,
            }
        )

    @staticmethod
    def _window_label(d: Dim) -> str:
        unit = "requests" if d.name == "requests" else "tokens"
        abbr = "RPM" if d.name == "requests" else "TPM"
        if abs(d.window_s - 60.0) < 1e-9:
            return f"{unit} per min ({abbr})"
        return f"{unit} per {d.window_s:g}s ({abbr})"

    def _rate_limited(self, principal: Principal, results: list[DimResult], tokens: int) -> RateLimited:
        failed = [r for r in results if not r.ok]
        headers = headers_for([r for r in results if r.dim.kind == "bucket"])
        daily = [r for r in failed if r.dim.kind == "daily"]
        too_large = [r for r in failed if not math.isfinite(r.retry_s)]
        if daily:
            r = daily[0]
            retry = r.dim.ttl_s
            headers.update(
                {
                    "retry-after": str(max(1, math.ceil(retry))),
                    "retry-after-ms": str(math.ceil(retry * 1000)),
                    "x-should-retry": "false",
                }
            )
            return RateLimited(
                f"You exceeded your current quota of {r.dim.limit} tokens per day for {r.dim.scope}: used "
                f"{r.dim.limit - int(r.remaining)}, requested {r.dim.cost}. The quota resets at 00:00 UTC.",
                type="insufficient_quota",
                code="insufficient_quota",
                headers=headers,
            )
        if too_large:
            r = too_large[0]
            headers["x-should-retry"] = "false"
            return RateLimited(
                f"Request too large for {r.dim.scope} on {self._window_label(r.dim) if r.dim.kind == 'bucket' else 'concurrent requests'}: "
                f"Limit {r.dim.limit}, Requested {r.dim.cost}. The input or output tokens must be reduced in order "
                f"to run successfully.",
                type="tokens" if r.dim.name == "tokens" else "requests",
                param="max_tokens" if r.dim.name == "tokens" else None,
                code="rate_limit_exceeded",
                headers=headers,
            )
        retry = max(r.retry_s for r in failed)
        headers.update(
            {
                "retry-after": str(max(1, math.ceil(retry))),
                "retry-after-ms": str(max(1, math.ceil(retry * 1000))),
            }
        )
        r = max(failed, key=lambda r: r.retry_s)
        if r.dim.kind == "conc":
            msg = f"Too many concurrent requests for {r.dim.scope}: Limit {r.dim.limit}. Please try again later."
            typ = "requests"
        else:
            used = r.dim.limit - int(math.floor(r.remaining + 1e-9))
            msg = (
                f"Rate limit reached for {r.dim.scope} on {self._window_label(r.dim)}: Limit {r.dim.limit}, "
                f"Used {used}, Requested {r.dim.cost}. Please try again in {retry:.3g}s."
            )
            typ = r.dim.name
        return RateLimited(msg, type=typ, code="rate_limit_exceeded", headers=headers)

    # -- admin API ------------------------------------------------------------------------------------
    def routes(self) -> list:
        """Starlette routes of the admin API; mount them under ``/admin/v1``."""
        from gateway.admin import admin_routes

        return admin_routes(self)

    def openapi_routes(self) -> list:
        """``GET /openapi.json`` (public) serving :func:`gateway.admin.openapi_spec`."""
        from gateway.admin import openapi_routes

        return openapi_routes()

    def tenant_routes(self) -> list:
        """Tenant self-service routes (mount at the root): ``GET /v1/usage`` -- the caller's own usage."""
        from gateway.admin import tenant_routes

        return tenant_routes(self)


# ---------------------------------------------------------------------------------------------------------
class TenancyMiddleware:
    """Pure ASGI middleware: authenticates every HTTP request that is not public, before routing.

    * redacts credential-like query parameters from ``scope["query_string"]`` in place (access logs);
    * ``public`` paths (:data:`PUBLIC_PATHS` exactly: ``/``, ``/health``, ``/healthz``, ``/readyz``,
      ``/metrics``, ``/openapi.json``, ``/api/version``; static/playground files; OPTIONS) pass;
      ``/admin/...`` requires the admin key (:meth:`Tenancy.require_admin`); everything else -- aliases,
      trailing slashes, ``..`` paths, unknown paths -- requires a tenant key, and the principal is put in
      ``scope["state"]["principal"]`` (``request.state.principal`` in starlette).
    Errors are answered here with OpenAI's body (401/403). With ``rate_limit_headers`` (default) every
    response to a tenant request that lacks ``x-ratelimit-*`` headers gets the current ones
    (:meth:`Tenancy.peek_headers`), so e.g. ``/v1/models`` and 4xx answers carry them too.
    """

    def __init__(
        self,
        app,
        tenancy: Tenancy,
        *,
        public_paths: frozenset[str] | set[str] = PUBLIC_PATHS,
        public_prefixes: tuple[str, ...] = PUBLIC_PREFIXES,
        rate_limit_headers: bool = True,
    ) -> None:
        self.app = app
        self.rate_limit_headers = rate_limit_headers
        self.tenancy = tenancy
        self.public_paths = frozenset(public_paths)
        self.public_prefixes = tuple(public_prefixes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            # same rules; a refused handshake is closed with 1008 (policy violation) before accept
            if query_has_key(scope):
                redact_query(scope)
                await send({"type": "websocket.close", "code": 1008})
                return
            kind = classify_path(
                scope.get("path", "/"),
                "GET",
                public_paths=self.public_paths,
                public_prefixes=self.public_prefixes,
            )
            try:
                if kind == "admin":
                    await self.tenancy.require_admin(scope)
                elif kind == "tenant":
                    state = scope.setdefault("state", {})
                    state["principal"] = await self.tenancy.authenticate(scope)
                    state["_tenancy"] = self.tenancy
            except APIError:
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        query_key = query_has_key(scope)
        if query_key:
            redact_query(scope)
        kind = classify_path(
            scope.get("path", "/"),
            scope.get("method", "GET"),
            public_paths=self.public_paths,
            public_prefixes=self.public_prefixes,
        )
        try:
            if query_key:  # on any path: a credential in a URL ends up in logs, histories, referers
                raise AuthenticationError(
                    "API keys are not accepted in the query string; use the Authorization: Bearer header."
                )
            if kind == "admin":
                await self.tenancy.require_admin(scope)
                scope.setdefault("state", {})["admin"] = True
            elif kind == "tenant":
                state = scope.setdefault("state", {})
                state["principal"] = await self.tenancy.authenticate(scope)
                state["_tenancy"] = self.tenancy
        except APIError as e:
            await send_error(send, e)
            return
        if kind != "tenant" or not self.rate_limit_headers:
            await self.app(scope, receive, send)
            return
        principal = scope["state"]["principal"]

        async def send_with_headers(message) -> None:
            # every tenant response carries x-ratelimit-*: the admission's (set by the handler) or the current
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers") or []}
                if b"x-ratelimit-limit-requests" not in names and b"x-ratelimit-limit-tokens" not in names:
                    try:
                        extra = await self.tenancy.peek_headers(principal)
                    except Exception:  # noqa: BLE001 - headers are best effort
                        extra = {}
                    if extra:
                        message = {
                            **message,
                            "headers": [
                                *(message.get("headers") or []),
                                *((k.encode(), v.encode()) for k, v in extra.items()),
                            ],
                        }
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def send_error(send, e: APIError) -> None:
    """Send an APIError as a complete JSON response on a raw ASGI ``send``."""
    import json

    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
