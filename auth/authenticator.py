"""Authenticator: a request's bearer key to its :class:`~auth.principal.Principal`, and the admin key check.

Keys are looked up by SHA-256 digest (:func:`auth.keys.hash_key`), the stored digest compared in constant time.
Lookups, hits and misses alike, are cached per process (a flood of wrong keys does not reach the database):

* a cached lookup is *fresh* for ``cache_ttl_s`` (1 s) seconds, or ``feed_ttl_s`` (10 s) while the store's
  change feed (``auth.store.ChangeFeed``, PostgreSQL ``LISTEN``) is connected; :meth:`Authenticator.invalidate`
  (called by the admin API after each change, and by the feed after every change any gateway makes) makes
  every cached lookup stale at once, so a revocation reaches every gateway within the feed's delivery time;
* a stale lookup is looked up again; if the store is unreachable (:class:`~auth.errors.StoreUnavailable`) a
  cached *hit* is still served while it was last confirmed at most ``stale_s`` (60 s) ago; a miss, an unknown
  key or an older hit get the 503.

A lookup's confirmation time is the moment its query started, so a change committed while it ran is never
hidden by it. Revocation, expiry and the tenant's state are checked on every request, cache or not.
"""

from __future__ import annotations

import math
import time

from .credentials import Headers, bearer_token, reject_query_key
from .errors import Forbidden, StoreUnavailable, Unauthenticated
from .keys import digest_equal, hash_key
from .principal import Principal
from .records import KeyRecord, TenantRecord
from .store import TenantStore

CHALLENGE = {"www-authenticate": "Bearer"}
NO_KEY_MESSAGE = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer "
    "auth (i.e. Authorization: Bearer YOUR_KEY)."
)
MAX_CACHED = 100_000  # cached hits before the cache is emptied (bounded memory)
MAX_MISSES = 10_000  # cached misses before they are emptied


def allowed_models(tenant: list[str] | None, key: list[str] | None) -> tuple[str, ...] | None:
    """The models a key may use: the tenant's (None: every model) narrowed to the key's list when it has one,
    in the tenant's order; ``()`` when the two lists share no name."""
    if key is None:
        return None if tenant is None else tuple(tenant)
    if tenant is None:
        return tuple(key)
    return tuple(m for m in tenant if m in key)


class Authenticator:
    """Tenant keys and the admin key of one process.

    Args:
        store: the key database; None: no tenant keys exist (only the admin key can pass).
        admin_key: the admin API's bearer key; None: every admin call is refused (401).
        cache_ttl_s: seconds a lookup stays fresh without a change feed.
        feed_ttl_s: seconds a lookup stays fresh while ``store.feed`` is connected.
        stale_s: seconds after its last confirmation a cached hit is still served while the store is down.
    """

    def __init__(
        self,
        store: TenantStore | None,
        *,
        admin_key: str | None,
        cache_ttl_s: float = 1.0,
        feed_ttl_s: float = 10.0,
        stale_s: float = 60.0,
    ) -> None:
        self.store = store
        self.cache_ttl_s = cache_ttl_s
        self.feed_ttl_s = feed_ttl_s
        self.stale_s = stale_s
        self.stale_served = 0  # requests answered from a stale hit while the store was down
        self._admin_digest = hash_key(admin_key) if admin_key else None
        self._hits: dict[
            str, tuple[float, KeyRecord, TenantRecord]
        ] = {}  # digest -> (monotonic confirmed, ...)
        self._misses: dict[str, float] = {}  # digest of an unknown key -> monotonic confirmed
        self._valid_after = -math.inf  # lookups confirmed before this (monotonic) are stale

    def invalidate(self) -> None:
        """Make every cached lookup stale (after a change to keys or tenants: it applies to the next request);
        hits stay for serving while the store is down (``stale_s``)."""
        self._valid_after = time.monotonic()
        self._misses.clear()

    def ttl_s(self) -> float:
        """Seconds a lookup stays fresh now: ``feed_ttl_s`` while a change feed listens, else ``cache_ttl_s``."""
        feed = self.store.feed if self.store is not None else None
        return self.feed_ttl_s if feed is not None and feed.connected else self.cache_ttl_s

    def _fresh(self, confirmed: float, now: float) -> bool:
        return confirmed > self._valid_after and now - confirmed < self.ttl_s()

    async def _lookup(self, token: str) -> tuple[KeyRecord, TenantRecord] | None:
        """Raises StoreUnavailable (503) when the store is down and no recent enough hit is cached."""
        digest = hash_key(token)
        now = time.monotonic()
        hit = self._hits.get(digest)
        miss = self._misses.get(digest)
        if hit is not None and self._fresh(hit[0], now):
            found = hit[1], hit[2]
        elif self.store is None or (miss is not None and self._fresh(miss, now)):
            return None
        else:
            try:
                looked_up = await self.store.find_key(digest)
            except StoreUnavailable:
                if hit is None or time.monotonic() - hit[0] > self.stale_s:
                    raise
                self.stale_served += 1
                looked_up = hit[1], hit[2]
            else:
                self._hits.pop(digest, None)
                if looked_up is None:
                    if len(self._misses) > MAX_MISSES:
                        self._misses.clear()
                    self._misses[digest] = now
                    return None
                if len(self._hits) > MAX_CACHED:
                    self._hits.clear()
                self._hits[digest] = (now, *looked_up)
            found = looked_up
        return found if digest_equal(found[0].hash, digest) else None

    async def authenticate(self, headers: Headers, query_string: bytes = b"") -> Principal:
        """The principal of a request's ``Authorization: Bearer <key>``.

        Raises:
            Unauthenticated: 401 (with ``www-authenticate: Bearer``) for a key in the query string, no key or
                another scheme, an unknown, revoked or expired key, a disabled or deleted tenant
                (code ``tenant_disabled``).
            StoreUnavailable: 503 (``retry-after``), the store is down and the key is not cached recently.
        """
        reject_query_key(query_string, challenge=True)
        token = bearer_token(headers)
        if not token:
            raise Unauthenticated(NO_KEY_MESSAGE, code=None, headers=CHALLENGE)
        found = await self._lookup(token)
        if found is None:
            raise Unauthenticated("Incorrect API key provided.", headers=CHALLENGE)
        key, tenant = found
        if key.revoked_at is not None:
            raise Unauthenticated("This API key has been revoked.", headers=CHALLENGE)
        if key.expires_at is not None and key.expires_at <= time.time():
            raise Unauthenticated("This API key has expired.", headers=CHALLENGE)
        if tenant.disabled or tenant.deleted_at is not None:
            raise Unauthenticated(
                "This API key's tenant is disabled.", code="tenant_disabled", headers=CHALLENGE
            )
        return Principal(
            tenant.id,
            tenant.name,
            key.id,
            key.prefix,
            tenant.limits,
            key.limits,
            tenant.filters,
            allowed_models(tenant.models, key.models),
            tenant.model_limits,
        )

    async def check_admin(self, headers: Headers, query_string: bytes = b"") -> None:
        """Pass only the admin key.

        Raises:
            Unauthenticated: 401 for a key in the query string, no key, a wrong key, or no admin key set.
            Forbidden: 403 ``admin_required`` for a valid (not revoked) tenant key.
            StoreUnavailable: 503, a non-admin key could not be looked up.
        """
        reject_query_key(query_string)
        token = bearer_token(headers)
        if not token:
            raise Unauthenticated("This route requires the admin API key (Authorization: Bearer).", code=None)
        if self._admin_digest is not None and digest_equal(hash_key(token), self._admin_digest):
            return
        found = await self._lookup(token)
        if found is not None and found[0].revoked_at is None:
            raise Forbidden("This API key is not allowed to use the admin API.", code="admin_required")
        raise Unauthenticated("Incorrect admin API key provided.")
