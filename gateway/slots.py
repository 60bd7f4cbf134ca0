"""Fair slots: N in all, at most one per key (a tenant), for work that tenants queue for (filter matching
threads, grammar check workers).

``KeySlots(total)`` belongs to one Trio run. ``bind(key)`` gives a ``KeySlot``: the limiter interface
``trio.to_thread.run_sync`` takes (``acquire_on_behalf_of`` / ``release_on_behalf_of``); ``hold(key)``
is the same as an async context manager. A holder takes its key's own slot (capacity 1) first, then one of
the ``total``: a key never waits in the shared queue more than once, so whatever one tenant queues, another
tenant waits for at most one piece of work per other key ahead of it (divided by ``total``).

A slot whose caller gave up on the work (an abandoned thread) can give the shared slot back at once
(``KeySlot.abandon``) and its key's slot when the work ends, so that a few tenants' abandoned work cannot
leave every other tenant waiting.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import trio


class KeySlots:
    """``total`` slots in all, one per key (module docstring)."""

    def __init__(self, total: int) -> None:
        self.total = trio.CapacityLimiter(total)
        self.per_key: dict[object, trio.CapacityLimiter] = {}

    def bind(self, key: object) -> KeySlot:
        return KeySlot(self, key)

    @contextlib.asynccontextmanager
    async def hold(self, key: object) -> AsyncIterator[None]:
        """Hold ``key``'s slot and a shared one for the block."""
        slot, me = self.bind(key), object()
        await slot.acquire_on_behalf_of(me)
        try:
            yield
        finally:
            slot.release_on_behalf_of(me)


class KeySlot:
    """One holder's hold on the slots: its key's own limiter (capacity 1), then the total."""

    def __init__(self, slots: KeySlots, key: object) -> None:
        self.slots, self.key = slots, key
        self.own: trio.CapacityLimiter | None = None
        self.borrower: object = None  # holding the shared slot on its behalf, until released or abandoned

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        own = self.own = self.slots.per_key.setdefault(self.key, trio.CapacityLimiter(1))
        try:
            await own.acquire_on_behalf_of(borrower)
        except BaseException:
            self._drop_if_idle()
            raise
        try:
            await self.slots.total.acquire_on_behalf_of(borrower)
        except BaseException:
            own.release_on_behalf_of(borrower)
            self._drop_if_idle()
            raise
        self.borrower = borrower

    def abandon(self) -> None:
        """The caller gave up on the work: the shared slot goes back now, the key's when it ends."""
        if self.borrower is not None:
            self.slots.total.release_on_behalf_of(self.borrower)
            self.borrower = None

    def release_on_behalf_of(self, borrower: object) -> None:
        assert self.own is not None
        self.abandon()
        self.own.release_on_behalf_of(borrower)
        self._drop_if_idle()

    def _drop_if_idle(self) -> None:
        """Keep no entry for a key nobody holds or waits for (one per tenant ever seen otherwise)."""
        own = self.own
        if own is not None and own.borrowed_tokens == 0 and own.statistics().tasks_waiting == 0:
            if self.slots.per_key.get(self.key) is own:
                del self.slots.per_key[self.key]
