"""A small Redis client for Trio (RESP2 over ``trio.SocketStream``), enough for EVALSHA/SCRIPT/PING.

Why not redis-py: its asyncio client does not run under Trio, and its blocking client would need a thread
hop per call. Connections are pooled; a connection interrupted mid-command (error or cancellation) is closed,
never reused, so a reply can never be read by the wrong caller, and an idle one the server closed (a restart)
is dropped before use. Source: https://redis.io/docs/latest/develop/reference/protocol-spec/
"""

from __future__ import annotations

import select
from urllib.parse import unquote, urlparse

import trio


class RedisError(Exception):
    """An error reply from the server (``-ERR ...``) or a protocol/connection failure."""


class _Conn:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise RedisError("connection closed by server")
        self.buf += data

    async def _line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[: i + 2]
                return line
            await self._fill()

    async def _exact(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            await self._fill()
        data = bytes(self.buf[:n])
        del self.buf[: n + 2]
        return data

    async def read_reply(self):
        line = await self._line()
        t, rest = line[:1], line[1:]
        if t == b"+":
            return rest.decode()
        if t == b"-":
            return RedisError(rest.decode())
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            return None if n < 0 else (await self._exact(n)).decode()
        if t == b"*":
            n = int(rest)
            if n < 0:
                return None
            return [await self.read_reply() for _ in range(n)]
        raise RedisError(f"bad reply type {t!r}")


def _stale(conn: _Conn) -> bool:
    """Whether an idle connection has something to read: the server closed it (EOF, e.g. Redis restarted) or
    sent what nobody asked for. Either way it is not reused (a command sent on it would fail)."""
    if conn.buf:
        return True
    poller = select.poll()
    poller.register(conn.stream.socket.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


def _encode(args: tuple) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class RedisClient:
    """``await client.execute("PING")``. URL: ``redis://[:password@]host:port[/db]``."""

    def __init__(self, url: str, *, max_idle: int = 256) -> None:
        u = urlparse(url)
        if u.scheme not in ("redis", ""):
            raise ValueError("only redis:// URLs are supported")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 6379
        self.password = unquote(u.password) if u.password else None
        self.username = unquote(u.username) if u.username else None
        self.db = int(u.path.strip("/") or 0)
        self._idle: list[_Conn] = []
        self._max_idle = max_idle
        self._closed = False

    async def _connect(self) -> _Conn:
        stream = await trio.open_tcp_stream(self.host, self.port)
        conn = _Conn(stream)
        try:
            if self.password:
                auth = ("AUTH", self.username, self.password) if self.username else ("AUTH", self.password)
                await self._roundtrip(conn, auth)
            if self.db:
                await self._roundtrip(conn, ("SELECT", self.db))
        except BaseException:
            stream.socket.close()
            raise
        return conn

    @staticmethod
    async def _roundtrip(conn: _Conn, args: tuple):
        try:
            await conn.stream.send_all(_encode(args))
            reply = await conn.read_reply()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise RedisError(f"connection lost: {exc}") from exc
        if isinstance(reply, RedisError):
            raise reply
        return reply

    async def execute(self, *args):
        """Send one command, return its reply (str | int | list | None).

        Raises:
            RedisError: an error reply, or the connection lost mid-command (reset, closed).
            OSError: no connection could be made.
        """
        if self._closed:
            raise RedisError("client closed")
        conn = None
        while self._idle and conn is None:
            conn = self._idle.pop()
            if _stale(conn):
                conn.stream.socket.close()
                conn = None
        if conn is None:
            conn = await self._connect()
        ok = False
        try:
            await conn.stream.send_all(_encode(args))
            reply = await conn.read_reply()
            ok = True
        except (
            trio.BrokenResourceError,
            trio.ClosedResourceError,
        ) as exc:  # a reset: one error type for callers
            raise RedisError(f"connection lost: {exc}") from exc
        finally:
            if ok and not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
            elif not ok or self._closed or len(self._idle) >= self._max_idle:
                conn.stream.socket.close()
        if isinstance(reply, RedisError):
            raise reply
        return reply

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().stream.socket.close()
