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

A batch the store refuses for another reason (a value out of its range, e.g. a token count over a 64-bit
integer; a constraint) is written again row by row, so one bad row never takes the others with it: each row
the store still refuses alone is logged (ERROR, with its request id and tenant) and appended to the spool
folder's reject file (``auth.spool.Spool.reject``: ``ledger-rejected.jsonl``, kept for the operator, never
replayed); an outage met meanwhile sends the rows not yet written to the spool as above.

Loss bounds:

* clean shutdown (:meth:`aclose`): none; the queue is written, or spooled when the store is down (logged);
* crash (SIGKILL, power loss): the rows recorded in the last ``flush_s`` seconds and not yet written, at most
  ``batch`` rows plus what the store was slow to take; spooled rows survive;
* spool full (``spool_max_rows``): the rows that do not fit are dropped and logged;
* a row the store refuses on its own: none of the batch's other rows; that row is in the reject file (without
  a spool folder: only in the log line).

``tokens_on_day`` reads what was billed on a day (the seed of a daily quota, ``ratelimit.admission``).
"""

from __future__ import annotations

import json
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


def _reason(exc: BaseException) -> str:
    """One line: the exception's type and message (cut to 300 characters)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _as_text(row: dict[str, Any]) -> str:
    """``row`` as one line of JSON (odd values as their repr)."""
    return json.dumps(row, default=repr, separators=(",", ":"))


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
        self._rejected: set[object] = set()  # row ids rejected (a replay meets a spooled one again)

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
                unwritten = await self._insert(rows)
                if unwritten:
                    await self._to_spool(unwritten)
            self._pending = max(0, self._pending - len(rows))

    async def _insert(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Write ``rows`` in one transaction; when the store refuses it (not an outage), row by row, each row
        it refuses alone rejected (:meth:`_reject`). Returns the rows left unwritten by an outage
        (``StoreUnavailable``; the caller spools them), [] when every row was written or rejected."""
        try:
            self.written += await self.store.insert_usage(rows)
            return []
        except StoreUnavailable:
            return rows
        except Exception as exc:  # noqa: BLE001 - the driver's refusal: a value or constraint error
            if len(rows) == 1:
                await self._reject(rows[0], exc)
                return []
            log.warning(
                "usage ledger: the store refused a batch of %d rows (%s); writing them one by one",
                len(rows),
                _reason(exc),
            )
        for i, row in enumerate(rows):
            try:
                self.written += await self.store.insert_usage([row])
            except StoreUnavailable:
                return rows[i:]
            except Exception as exc:  # noqa: BLE001 - as above, for this row alone
                await self._reject(row, exc)
        return []

    async def _reject(self, row: dict[str, Any], exc: BaseException) -> None:
        """A row the store refused on its own: logged with its request id, kept in the reject file."""
        where = self.spool.reject_path if self.spool is not None else None
        if row.get("row_id") in self._rejected:
            return  # a spooled row rejected before, met again on a replay
        self._rejected.add(row.get("row_id"))
        log.error(
            "usage ledger: the store refused the row of request %s (tenant %s, row %s): %s; %s",
            row.get("request_id"),
            row.get("tenant_id"),
            row.get("row_id"),
            _reason(exc),
            f"kept in {where}" if where else f"no spool folder, row lost: {_as_text(row)}",
        )
        if self.spool is None:
            return
        spool = self.spool
        try:
            await trio.to_thread.run_sync(spool.reject, row, _reason(exc))
        except OSError as e:
            log.error("usage ledger: cannot write %s (%s): row %s lost", where, e, row.get("row_id"))

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
        for i in range(0, len(rows), self.batch):
            if await self._insert(rows[i : i + self.batch]):  # an outage: all stays spooled, retried later
                self._backoff = min(RETRY_MAX_S, self._backoff * 2)
                self._retry_at = trio.current_time() + self._backoff
                return
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
