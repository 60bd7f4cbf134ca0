"""The ledger's local spool: usage rows that could not be written to the store wait here, on disk.

One file per gateway process, ``<folder>/ledger-spool-<pid>.jsonl``: append-only, one JSON object per line
(a ledger row, ``row_id`` included), ``fsync``'d after every append, so a spooled row survives a crash. The file
is held under an exclusive ``flock`` while its process lives; a file whose lock can be taken belongs to a
process that died, and the next gateway to start in that folder adopts it (:func:`leftovers`).

Rows the store refuses on their own (``auth.ledger``: a value out of its range) go to the folder's reject file,
``<folder>/ledger-rejected.jsonl`` (:meth:`Spool.reject`): append-only, one JSON object a line
(``{"rejected_at": UNIX seconds, "pid": ..., "reason": "...", "row": {...}}``), ``fsync``'d, shared by the
gateways of the folder, never replayed or adopted: it is the operator's to read (and to fix and re-insert).

Bounded: at most ``max_rows`` rows; the rows that do not fit are dropped, counted in ``dropped`` and logged
(an ERROR line per append that dropped any). All methods block (file I/O): call them from a worker thread.
"""

from __future__ import annotations

import fcntl
import glob
import json
import logging
import os
import time
from typing import Any

log = logging.getLogger("auth.ledger")

PATTERN = "ledger-spool-*.jsonl"
REJECTS = "ledger-rejected.jsonl"


def _lock(path: str) -> int | None:
    """Open ``path`` (created if absent) and take its exclusive lock; None when another process holds it or
    the name now points to another file (it was adopted and removed meanwhile)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.stat(path).st_ino:
            raise FileNotFoundError(path)
    except OSError:
        os.close(fd)
        return None
    return fd


def _read(fd: int) -> list[dict[str, Any]]:
    """The complete rows in the file (a torn last line, from a crash during an append, is skipped)."""
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    rows = []
    for line in b"".join(chunks).splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            log.error("ledger spool: skipping a torn line (%d bytes)", len(line))
    return rows


class Spool:
    """This process's spool file (see the module docstring). Raises OSError when the folder is not writable.

    Attributes:
        path: the file.
        rows: rows in it now.
        dropped: rows refused since start (the spool was full).
    """

    def __init__(self, folder: str, *, max_rows: int = 100_000) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        self.path = os.path.join(folder, f"ledger-spool-{os.getpid()}.jsonl")
        self.reject_path = os.path.join(folder, REJECTS)
        self.max_rows = max_rows
        self.dropped = 0
        fd = _lock(self.path)
        if fd is None:
            raise OSError(f"ledger spool {self.path} is locked by another process")
        self.fd = fd
        self.rows = len(_read(fd))

    def append(self, rows: list[dict[str, Any]]) -> int:
        """Append (and fsync) as many of ``rows`` as fit; returns how many were dropped."""
        room = max(0, self.max_rows - self.rows)
        keep, drop = rows[:room], len(rows) - min(room, len(rows))
        if keep:
            data = b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in keep)
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view) :]
            os.fsync(self.fd)
            self.rows += len(keep)
        if drop:
            self.dropped += drop
            log.error(
                "ledger spool %s full (%d rows): dropped %d usage rows (%d since start)",
                self.path,
                self.max_rows,
                drop,
                self.dropped,
            )
        return drop

    def read(self) -> list[dict[str, Any]]:
        return _read(self.fd)

    def reject(self, row: dict[str, Any], reason: str) -> None:
        """Append ``row`` (and fsync) to the reject file with ``reason`` (see the module docstring). One
        ``write`` of one line with ``O_APPEND``: gateways sharing the folder never interleave their lines.
        Raises OSError."""
        line = {"rejected_at": time.time(), "pid": os.getpid(), "reason": reason, "row": row}
        data = json.dumps(line, separators=(",", ":"), default=repr).encode() + b"\n"
        fd = os.open(self.reject_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def truncate(self) -> None:
        """Empty the file (after its rows were written to the store)."""
        os.ftruncate(self.fd, 0)
        os.fsync(self.fd)
        self.rows = 0

    def close(self) -> None:
        """Release the lock; an empty file is removed, a non-empty one stays for the next start."""
        if self.rows == 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)


def leftovers(folder: str, own: str | None) -> list[tuple[str, int]]:
    """The spool files in ``folder`` of processes that died (their lock is free), locked now by the caller:
    ``(path, fd)`` pairs. The caller reads them (:func:`read_leftover`) and removes them (:func:`drop_leftover`)."""
    found = []
    for path in sorted(glob.glob(os.path.join(folder, PATTERN))):
        if path == own:
            continue
        try:
            fd = _lock(path)
        except OSError:
            continue
        if fd is not None:
            found.append((path, fd))
    return found


def read_leftover(fd: int) -> list[dict[str, Any]]:
    return _read(fd)


def drop_leftover(path: str, fd: int) -> None:
    """Remove an adopted file (its rows are in the store or in this process's spool) and release it."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(fd)
