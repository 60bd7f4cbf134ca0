"""Authenticator: a request's bearer key to its :class:`~auth.principal.Principal`, and the admin key check.

Keys are looked up by SHA-256 digest (:func:`auth.keys.hash_key`), the stored digest compared in constant time.
Lookups, hits and misses alike, are cached ``cache_ttl_s`` seconds (a flood of wrong keys does not reach the
database thread); :meth:`Authenticator.invalidate` forgets them (the admin API calls it after every change, so
changes made through this process apply at once; another process sharing the database sees them within the
TTL). Revocation, expiry and the tenant's state are checked on every request, cache or not.
"""

from __future__ import annotations

import time

from .credentials import Headers, bearer_token, reject_query_key
from .errors import Forbidden, Unauthenticated
from .keys import digest_equal, hash_key
from .principal import Principal
from .records import KeyRecord, TenantRecord
from .store import AsyncStore, Store

CHALLENGE = {"www-authenticate": "Bearer"}
NO_KEY_MESSAGE = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer "
    "auth (i.e. Authorization: Bearer YOUR_KEY)."
)
MAX_CACHED = 100_000  # cached hits before the cache is emptied (bounded memory)
MAX_MISSES = 10_000  # cached misses before they are emptied


class Authenticator:
    """Tenant keys and the admin key of one process.

    Args:
        store: the key database; None: no tenant keys exist (only the admin key can pass).
        admin_key: the admin API's bearer key; None: every admin call is refused (401).
        cache_ttl_s: seconds a lookup is cached.
    """

    def __init__(self, store: AsyncStore | None, *, admin_key: str | None, cache_ttl_s: float = 1.0) -> None:
        self.store = store
        self.cache_ttl_s = cache_ttl_s
        self._admin_digest = hash_key(admin_key) if admin_key else None
        self._hits: dict[str, tuple[float, KeyRecord, TenantRecord]] = {}  # digest -> (monotonic expiry, ...)
        self._misses: dict[str, float] = {}  # digest of an unknown key -> monotonic expiry

    def invalidate(self) -> None:
        """Forget every cached lookup (after a change to keys or tenants: it applies to the next request)."""
        self._hits.clear()
        self._misses.clear()

    async def _lookup(self, token: str) -> tuple[KeyRecord, TenantRecord] | None:
        digest = hash_key(token)
        now = time.monotonic()
        hit = self._hits.get(digest)
        if hit is not None and hit[0] > now:
            found = hit[1], hit[2]
        else:
            miss = self._misses.get(digest)
            if self.store is None or (miss is not None and miss > now):
                return None
            looked_up = await self.store.call(Store.find_key, digest)
            if looked_up is None:
                if len(self._misses) > MAX_MISSES:
                    self._misses.clear()
                self._misses[digest] = now + self.cache_ttl_s
                return None
            found = looked_up
            if len(self._hits) > MAX_CACHED:
                self._hits.clear()
            self._hits[digest] = (now + self.cache_ttl_s, *found)
        return found if digest_equal(found[0].hash, digest) else None

    async def authenticate(self, headers: Headers, query_string: bytes = b"") -> Principal:
        """The principal of a request's ``Authorization: Bearer <key>``.

        Raises:
            Unauthenticated: 401 (with ``www-authenticate: Bearer``) for a key in the query string, no key or
                another scheme, an unknown, revoked or expired key, a disabled or deleted tenant
                (code ``tenant_disabled``).
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
            tenant.id, tenant.name, key.id, key.prefix, tenant.limits, key.limits, tenant.filters
        )

    async def check_admin(self, headers: Headers, query_string: bytes = b"") -> None:
        """Pass only the admin key.

        Raises:
            Unauthenticated: 401 for a key in the query string, no key, a wrong key, or no admin key set.
            Forbidden: 403 ``admin_required`` for a valid (not revoked) tenant key.
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
