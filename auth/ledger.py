"""UsageLedger actor: finished-request rows go onto a channel; one task writes them to the store in batches.

``record(row)`` is synchronous and never blocks (safe in a cancel-shielded ``finally``); it gives the row its
``row_id`` (a random 128-bit hex id), which makes every later write of it idempotent. The writer task
(:meth:`UsageLedger.run`) waits for a row, then for up to ``flush_s`` seconds more (or until ``batch`` rows are
queued, or :meth:`flush` asks), and inserts them in one transaction.

When the store is unreachable (:class:`~auth.errors.StoreUnavailable`) the batch goes to the local spool
(``auth.spool``: append-only, fsync'd, bounded) and the spool is retried with backoff (0.5 s doubling to 5 s);
new batches join the spool until it has been written back, then it is truncated. At start, spool files left by
a process that died in the same folder are adopted and written (rows already stored are skipped by their
``row_id``).

Loss bounds:

* clean shutdown (:meth:`aclose`): none; the queue is written, or spooled when the store is down (logged);
* crash (SIGKILL, power loss): the rows recorded in the last ``flush_s`` seconds and not yet written, at most
  ``batch`` rows plus what the store was slow to take; spooled rows survive;
* spool full (``spool_max_rows``): the rows that do not fit are dropped and logged.

``tokens_on_day`` reads what was billed on a day (the seed of a daily quota, ``ratelimit.admission``).
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

import trio

from .errors import StoreUnavailable
from .spool import Spool, drop_leftover, leftovers, read_leftover
from .store import TenantStore

log = logging.getLogger("auth.ledger")

RETRY_MIN_S = 0.5
RETRY_MAX_S = 5.0


class UsageLedger:
    """Args:
    store: where rows are written.
    batch: most rows per transaction (and per spool append).
    flush_s: seconds a row may wait for others before its batch is written.
    spool_dir: folder of the spool file; None: no spool (a failed write is logged and its rows lost).
    spool_max_rows: rows the spool may hold.
    """

    def __init__(
        self,
        store: TenantStore,
        *,
        batch: int = 512,
        flush_s: float = 0.5,
        spool_dir: str | None = None,
        spool_max_rows: int = 100_000,
    ) -> None:
        self.store = store
        self.batch = batch
        self.flush_s = flush_s
        self.spool_dir = spool_dir
        self.spool_max_rows = spool_max_rows
        self.spool: Spool | None = None
        self.written = 0  # rows inserted by this process (spool replays included)
        self._send, self._recv = trio.open_memory_channel[dict[str, Any]](math.inf)
        self._done = trio.Event()
        self._pending = 0
        self._hurry: trio.CancelScope | None = None
        self._retry_at = math.inf  # trio time of the next spool replay (inf: nothing spooled)
        self._backoff = RETRY_MIN_S
        self._cycles = 0  # write cycles done (a batch and/or a spool replay)
        self._cycled = trio.Event()  # set (and replaced) after each
        self._busy = False

    def record(self, row: dict[str, Any]) -> None:
        """Queue one ledger row (fields: ``auth.sql.USAGE_COLUMNS``; ``row_id`` is given here if absent)."""
        row.setdefault("row_id", uuid.uuid4().hex)
        try:
            self._send.send_nowait(row)
            self._pending += 1
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            log.error("usage ledger closed; dropping a row for tenant %s", row.get("tenant_id"))

    async def tokens_on_day(
        self, *, tenant_id: str | None = None, key_id: str | None = None, day: str, model: str | None = None
    ) -> int:
        """Tokens (prompt + completion) written for a tenant or a key on UTC ``day`` (``YYYY-MM-DD``; ``model``:
        only that model's rows). Raises StoreUnavailable."""
        return await self.store.tokens_on_day(tenant_id=tenant_id, key_id=key_id, day=day, model=model)

    async def flush(self) -> None:
        """Write every row queued so far now (no ``flush_s`` wait) and, with rows spooled, try the store for
        them now (no backoff wait); returns when that is done (rows the store still refuses stay spooled)."""
        spooled = self.spool is not None and self.spool.rows > 0
        if not (self._pending or spooled) or self._done.is_set():
            return
        self._retry_at = min(self._retry_at, trio.current_time()) if spooled else self._retry_at
        target = self._cycles + (2 if self._busy else 1)  # a cycle under way may have begun before this call
        while not self._done.is_set() and (self._cycles < target or self._pending > 0):
            if self._hurry is not None:
                self._hurry.cancel()
            await self._cycled.wait()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The writer task: adopt leftover spools, then write batches; returns when the channel is closed and
        drained (the spool written, or left on disk when the store is down)."""
        try:
            if self.spool_dir is not None:
                folder = self.spool_dir
                try:
                    self.spool = await trio.to_thread.run_sync(
                        lambda: Spool(folder, max_rows=self.spool_max_rows)
                    )
                except OSError as e:
                    log.error("usage ledger: no spool (%s): rows written while the store is down are lost", e)
                else:
                    await self._adopt()
            task_status.started()
            async with self._recv:
                closed = False
                while not closed:
                    rows, closed = await self._collect()
                    self._busy = True
                    await self._write(rows)
                    self._busy = False
                    self._cycles += 1
                    self._cycled.set()
                    self._cycled = trio.Event()
                if self.spool is not None and self.spool.rows:
                    with trio.CancelScope(shield=True):
                        await self._replay()  # one last try
                if self.spool is not None and self.spool.rows:
                    log.warning(
                        "usage ledger: store unavailable at shutdown; %d rows left in %s (written at the next start)",
                        self.spool.rows,
                        self.spool.path,
                    )
        finally:
            if self.spool is not None:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self.spool.close)
            self._done.set()
            self._cycled.set()

    async def _collect(self) -> tuple[list[dict[str, Any]], bool]:
        """The next batch and whether the channel has ended. Waits for a first row (or, with rows spooled, at
        most until the next retry), then up to ``flush_s`` for more."""
        rows: list[dict[str, Any]] = []
        try:
            with trio.move_on_at(self._retry_at) as self._hurry:
                rows.append(await self._recv.receive())
            if not rows:
                return rows, False
            with trio.move_on_after(self.flush_s) as self._hurry:
                while len(rows) < self.batch:
                    rows.append(await self._recv.receive())
        except trio.EndOfChannel:
            return rows, True
        finally:
            self._hurry = None
        return rows, False

    async def _write(self, rows: list[dict[str, Any]]) -> None:
        with trio.CancelScope(shield=True):
            if self.spool is not None and self.spool.rows and trio.current_time() >= self._retry_at:
                await self._replay()
            if rows and self.spool is not None and self.spool.rows:
                await self._to_spool(rows)  # keep order simple: the spool drains first
            elif rows:
                try:
                    self.written += await self.store.insert_usage(rows)
                except StoreUnavailable:
                    await self._to_spool(rows)
                except Exception:
                    log.exception("usage ledger: failed to write %d rows", len(rows))
            self._pending = max(0, self._pending - len(rows))

    async def _to_spool(self, rows: list[dict[str, Any]]) -> None:
        spool = self.spool
        if spool is None:
            log.error("usage ledger: store unavailable, no spool: %d rows lost", len(rows))
            return
        first = spool.rows == 0
        try:
            await trio.to_thread.run_sync(spool.append, rows)
        except OSError as e:
            log.error("usage ledger: cannot spool to %s (%s): %d rows lost", spool.path, e, len(rows))
            return
        if first:
            log.warning("usage ledger: store unavailable; spooling rows to %s", spool.path)
            self._retry_at = trio.current_time() + RETRY_MIN_S
            self._backoff = RETRY_MIN_S

    async def _replay(self) -> None:
        """Write the spool to the store (in batches) and truncate it; on failure retry later, with backoff."""
        spool = self.spool
        assert spool is not None
        rows = await trio.to_thread.run_sync(spool.read)
        try:
            for i in range(0, len(rows), self.batch):
                self.written += await self.store.insert_usage(rows[i : i + self.batch])
        except StoreUnavailable:
            self._backoff = min(RETRY_MAX_S, self._backoff * 2)
            self._retry_at = trio.current_time() + self._backoff
            return
        except Exception:  # rows the store refuses (not an outage): retrying cannot help
            log.exception("usage ledger: the store refused spooled rows; dropping the rest of %d", len(rows))
        else:
            log.warning("usage ledger: store back; %d spooled rows written", len(rows))
        await trio.to_thread.run_sync(spool.truncate)
        self._retry_at = math.inf

    async def _adopt(self) -> None:
        """Write the spools of dead processes in this folder (or move their rows into this one's spool)."""
        spool = self.spool
        assert spool is not None
        for path, fd in await trio.to_thread.run_sync(leftovers, spool.folder, spool.path):
            rows = await trio.to_thread.run_sync(read_leftover, fd)
            if rows:
                log.warning("usage ledger: writing %d rows left in %s by a stopped gateway", len(rows), path)
                await self._to_spool(rows)
            await trio.to_thread.run_sync(drop_leftover, path, fd)
        if spool.rows:
            self._retry_at = -math.inf  # write them with the first batch, or at once

    async def aclose(self) -> None:
        """Stop accepting rows, write the queued ones (and the spool), wait for the writer."""
        await self._send.aclose()
        with trio.CancelScope(shield=True):
            await self._done.wait()
