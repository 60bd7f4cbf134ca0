"""UsageLedger actor: finished-request rows go onto a channel; one task writes them in batches.

``record(row)`` is synchronous and never blocks (safe in a cancel-shielded ``finally``). The writer task
takes whatever is queued (up to ``batch`` rows) and inserts it in one SQLite transaction in the DB thread.
``aclose()`` (called when the gateway's tenant services close) drains the queue, so no row is lost on an
orderly shutdown; rows are durable once written (SQLite WAL). ``tokens_on_day`` reads what was billed on a day
(the seed of a daily quota, ``ratelimit.admission``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import trio

from .store import AsyncStore, Store

log = logging.getLogger("auth.ledger")


class UsageLedger:
    def __init__(self, store: AsyncStore, *, batch: int = 512) -> None:
        self.store = store
        self.batch = batch
        self._send, self._recv = trio.open_memory_channel[dict[str, Any]](math.inf)
        self._done = trio.Event()
        self._pending = 0
        self._idle = trio.Event()
        self._idle.set()

    def record(self, row: dict[str, Any]) -> None:
        """Queue one ledger row (see :meth:`auth.store.Store.insert_usage` for the fields)."""
        try:
            self._send.send_nowait(row)
            self._pending += 1
            self._idle = trio.Event() if self._idle.is_set() else self._idle
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            log.error("usage ledger closed; dropping a row for tenant %s", row.get("tenant_id"))

    async def tokens_on_day(
        self, *, tenant_id: str | None = None, key_id: str | None = None, day: str
    ) -> int:
        """Tokens (prompt + completion) written for a tenant or a key on UTC ``day`` (``YYYY-MM-DD``)."""
        return await self.store.call(Store.tokens_on_day, tenant_id=tenant_id, key_id=key_id, day=day)

    async def flush(self) -> None:
        """Wait until every row queued so far is written."""
        if self._pending:
            await self._idle.wait()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The writer task; returns when the channel is closed and drained."""
        task_status.started()
        try:
            async with self._recv:
                async for row in self._recv:
                    rows = [row]
                    while len(rows) < self.batch:
                        try:
                            rows.append(self._recv.receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    try:
                        with trio.CancelScope(shield=True):
                            await self.store.call(Store.insert_usage, rows)
                    except Exception:
                        log.exception("usage ledger: failed to write %d rows", len(rows))
                    self._pending -= len(rows)
                    if self._pending <= 0:
                        self._pending = 0
                        self._idle.set()
        finally:
            self._done.set()

    async def aclose(self) -> None:
        """Stop accepting rows, write the queued ones, wait for the writer."""
        await self._send.aclose()
        with trio.CancelScope(shield=True):
            await self._done.wait()
