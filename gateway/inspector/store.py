"""``InspectStore``: the inspection records of recent requests, in memory, per gateway process.

A record is kept ``ttl_s`` seconds (default 600) under its tenant and request id (and one alias: the HTTP
request's ``x-request-id``, which differs from the response's ``id``); a tenant keeps at most
``per_tenant`` records (default 32) and the store at most ``total`` (default 256): the oldest goes first.
A record is read back only under the tenant that wrote it: another tenant's id is simply absent. Records are
stored encoded (JSON bytes) and never change. Expired records are dropped as the store is used (every
``put`` and ``get``), so its memory is bounded by ``total`` records whatever the traffic.

Not thread-safe: the gateway's Trio loop is its only user. Times come from ``clock`` (seconds, monotonic).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

TTL_S = 600.0  # seconds a record is kept
PER_TENANT = 32  # records kept per tenant
TOTAL = 256  # records kept in all (an 8000-token prompt makes a record of ~124 KB)


class InspectStore:
    """Recent inspection records, keyed by ``(tenant_id, request_id)`` (see the module docstring).

    Raises:
        ValueError: a bound below 1 or a TTL <= 0.
    """

    def __init__(
        self,
        *,
        ttl_s: float = TTL_S,
        per_tenant: int = PER_TENANT,
        total: int = TOTAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0 or per_tenant < 1 or total < 1:
            raise ValueError("ttl_s must be > 0, per_tenant and total >= 1")
        self.ttl_s = ttl_s
        self.per_tenant = per_tenant
        self.total = total
        self._clock = clock
        # insertion order is expiry order (one TTL for all)
        self._items: OrderedDict[tuple[str, str], tuple[float, bytes, str | None]] = OrderedDict()
        self._tenants: dict[str, OrderedDict[str, None]] = {}
        self._aliases: dict[tuple[str, str], str] = {}  # (tenant, alias) -> request id

    def __len__(self) -> int:
        return len(self._items)

    def _drop(self, key: tuple[str, str]) -> None:
        item = self._items.pop(key, None)
        if item is not None and item[2] is not None:
            self._aliases.pop((key[0], item[2]), None)
        ids = self._tenants.get(key[0])
        if ids is not None:
            ids.pop(key[1], None)
            if not ids:
                del self._tenants[key[0]]

    def _expire(self, now: float) -> None:
        while self._items:
            key, (expires, _, _) = next(iter(self._items.items()))
            if expires > now:
                break
            self._drop(key)

    def put(self, tenant_id: str, request_id: str, record: bytes, *, alias: str | None = None) -> None:
        """Keep ``record`` (encoded) for ``ttl_s`` seconds, readable by ``request_id`` or ``alias``; the
        tenant's oldest goes when it holds ``per_tenant``, the store's oldest when it holds ``total``. The same
        id again replaces the record."""
        now = self._clock()
        self._expire(now)
        key = (tenant_id, request_id)
        self._drop(key)
        if alias == request_id:
            alias = None
        held = self._aliases.get((tenant_id, alias)) if alias is not None else None
        if held is not None:  # the alias moves to this record
            self._drop((tenant_id, held))
        ids = self._tenants.setdefault(tenant_id, OrderedDict())
        while len(ids) >= self.per_tenant:
            self._drop((tenant_id, next(iter(ids))))
        while len(self._items) >= self.total:
            self._drop(next(iter(self._items)))
        self._items[key] = (now + self.ttl_s, record, alias)
        self._tenants.setdefault(tenant_id, ids)[request_id] = None
        if alias is not None:
            self._aliases[(tenant_id, alias)] = request_id

    def get(self, tenant_id: str, request_id: str) -> bytes | None:
        """The record of ``request_id`` (or of the request with that alias) written under ``tenant_id``; None
        when there is none (never written, expired, pushed out, or written by another tenant)."""
        self._expire(self._clock())
        rid = self._aliases.get((tenant_id, request_id), request_id)
        item = self._items.get((tenant_id, rid))
        return None if item is None else item[1]
