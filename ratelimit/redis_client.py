"""The Redis connection of the shared limiter: a URL becomes a coredis client (TLS, password, bounded timeouts),
and every failure of the store becomes one error, :class:`~ratelimit.errors.StoreError`.

coredis 6 (https://coredis.readthedocs.io/en/stable/handbook/connections.html) runs on anyio, so on Trio. Its
connection pool is an async context manager: its task group holds one reader and one writer task per
connection, so the pool is entered by the task that owns the limiter (:meth:`RedisConnection.open` in
:meth:`ratelimit.redis_limiter.RedisLimiter.run`) and every command of the process shares its connections.
Commands are pipelined on a connection (the reply to each is matched in order, so a reply that comes after
its caller gave up is read and dropped, never handed to the next caller); a connection the server closed (a
Redis restart) ends its tasks and leaves the pool, and the next command opens a new one. Commands are never
retried by the client: an admission script whose reply was lost may have run, which only the limiter's undo
can tell (:meth:`~ratelimit.redis_limiter.RedisLimiter.undo`).

URLs (https://www.iana.org/assignments/uri-schemes/prov/redis and ``.../rediss``)::

    redis://[[user]:password@]host[:port][/db]       TCP; user:password = an ACL user (Redis >= 6),
                                                     :password = the default user (requirepass)
    rediss://[[user]:password@]host[:port][/db][?ssl_ca_certs=/path/ca.pem&...]     TLS
    unix://[[user]:password@]/path/to/redis.sock[?db=N]
    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]     the primary of
                                                     ``service`` as the Sentinels name it (port 26379 by
                                                     default); the password is the primary's

Reserved characters of a user name or password are percent-encoded (``%40`` for ``@``). Query parameters of
``rediss://``: ``ssl_ca_certs`` (a PEM file or a folder of CA certificates; default: the system's),
``ssl_certfile`` and ``ssl_keyfile`` (a client certificate, for ``tls-auth-clients yes``), ``ssl_cert_reqs``
(``required``, the default; ``optional``; ``none``), ``ssl_check_hostname`` (``true``, the default, or
``false``). ``db`` is accepted by every scheme. Any other parameter is an error (a typo must not turn off
verification silently). With Sentinel the pool asks the Sentinels for the primary's address before each new
connection, so after a failover the connections that fail are replaced by ones to the new primary; the
Sentinels themselves take no password and no TLS here. Redis Cluster
is not supported: the admission script touches the keys of a tenant and of its key in one call, which a cluster
would need hash tags for.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import cast
from urllib.parse import parse_qs, unquote, urlsplit

import anyio
import coredis
import coredis.exceptions
from coredis.connection import TCPLocation
from coredis.retry import NoRetryPolicy

from .errors import StoreError

# coredis logs each connection the server closed at INFO, with an empty stack ("Connection closed
# unexpectedly!" / "NoneType: None"): a Redis restart would print that per connection. The limiter and the
# admission say what an outage means, once per outage; coredis' warnings and errors still show.
logging.getLogger("coredis").setLevel(logging.WARNING)

CONNECT_TIMEOUT_S = 5.0  # seconds a new connection (TCP, TLS handshake, HELLO/AUTH) may take
COMMAND_TIMEOUT_S = 5.0  # seconds a reply may take (the admission's store timeout bounds a call as well)

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel")
TLS_PARAMS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}


def _flag(name: str, text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"Redis URL: {name} must be true or false, not {text!r}")


def tls_context(params: dict[str, str]) -> ssl.SSLContext:
    """The client TLS context of a ``rediss://`` URL's query ``params`` (see the module doc): the server's
    certificate is verified against ``ssl_ca_certs`` (else the system's CAs) and its host name checked unless
    told otherwise. Raises ``ValueError`` naming the parameter or the file that is wrong."""
    reqs = params.get("ssl_cert_reqs", "required")
    if reqs not in CERT_REQS:
        raise ValueError(f"Redis URL: ssl_cert_reqs must be required, optional or none, not {reqs!r}")
    check = _flag("ssl_check_hostname", params.get("ssl_check_hostname", "true"))
    ca = params.get("ssl_ca_certs")
    try:
        if ca is None:
            ctx = ssl.create_default_context()  # the system's CAs
        elif os.path.isdir(ca):
            ctx = ssl.create_default_context(capath=ca)  # these CAs only
        else:
            ctx = ssl.create_default_context(cafile=ca)
        cert, key = params.get("ssl_certfile"), params.get("ssl_keyfile")
        if cert is not None:
            ctx.load_cert_chain(cert, key)
        elif key is not None:
            raise ValueError("Redis URL: ssl_keyfile needs ssl_certfile")
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"Redis URL: cannot load the TLS files: {e}") from None
    ctx.check_hostname = check and CERT_REQS[reqs] != ssl.CERT_NONE
    ctx.verify_mode = CERT_REQS[reqs]
    return ctx


@dataclass(frozen=True)
class RedisConnection:
    """A coredis client and what has to be entered for it to work: the client itself, and with Sentinel first
    the Sentinel clients it asks for the primary. ``async with conn.open() as client:`` in the task that owns
    it; nothing is connected before the first command."""

    client: coredis.Redis[str]
    parts: tuple[AbstractAsyncContextManager[object], ...]

    @asynccontextmanager
    async def open(self) -> AsyncIterator[coredis.Redis[str]]:
        async with AsyncExitStack() as stack:
            for part in self.parts:
                await stack.enter_async_context(part)
            yield self.client


def redis_connection(
    url: str,
    *,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    command_timeout_s: float = COMMAND_TIMEOUT_S,
) -> RedisConnection:
    """The coredis client (replies decoded as UTF-8 text, no retries) of ``url`` (see the module doc).

    Raises:
        ValueError: an unsupported scheme, a bad port or db, an unknown query parameter, unreadable TLS files.
    """
    u = urlsplit(url)
    if u.scheme not in SCHEMES:
        raise ValueError(
            "Redis URL: the scheme must be redis://, rediss://, unix:// or redis+sentinel://, not "
            f"{u.scheme or url!r}"
        )
    params = {k: v[-1] for k, v in parse_qs(u.query, keep_blank_values=True).items()}
    unknown = sorted(set(params) - {"db", *TLS_PARAMS})
    if unknown:
        raise ValueError(f"Redis URL: unknown query parameter(s) {', '.join(unknown)}")
    if u.scheme != "rediss" and set(params) & set(TLS_PARAMS):
        raise ValueError("Redis URL: ssl_* parameters need a rediss:// URL")
    userinfo, _, hosts = u.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    path = [unquote(x) for x in u.path.split("/") if x]
    if u.scheme == "redis+sentinel":  # /service[/db]
        service, path = (path[0], path[1:]) if path else ("", [])
        if not service:
            raise ValueError(
                "Redis URL: redis+sentinel:// needs the service name (redis+sentinel://h:26379/mymaster)"
            )
    try:
        db = int(params.get("db") or (path[0] if path and u.scheme != "unix" else "0"))
        default_port = 26379 if u.scheme == "redis+sentinel" else 6379
        locations = [_location(h, default_port) for h in hosts.split(",")] if u.scheme != "unix" else []
    except ValueError:
        raise ValueError("Redis URL: the port and the db must be numbers") from None
    common = dict(
        db=db,
        username=unquote(user) or None,
        password=unquote(password) or None,
        connect_timeout=connect_timeout_s,
        stream_timeout=command_timeout_s,
        decode_responses=True,
        retry_policy=NoRetryPolicy(),
    )
    if u.scheme == "redis+sentinel":
        timeouts = {"connect_timeout": connect_timeout_s, "stream_timeout": command_timeout_s}
        sentinel = coredis.Sentinel(
            locations, sentinel_kwargs=timeouts, decode_responses=True, retry_policy=NoRetryPolicy()
        )
        del common["decode_responses"], common["retry_policy"]
        primary = cast(coredis.Redis[str], sentinel.primary_for(service, **common))
        return RedisConnection(primary, (sentinel, primary))
    if u.scheme == "unix":
        if not u.path:
            raise ValueError("Redis URL: unix:// needs the socket's path (unix:///run/redis.sock)")
        client = coredis.Redis(unix_socket_path=unquote(u.path), **common)  # type: ignore[call-overload]
    else:
        tls = tls_context(params) if u.scheme == "rediss" else None
        at = locations[0]
        client = coredis.Redis(host=at.host, port=at.port, ssl_context=tls, **common)  # type: ignore[call-overload]
    return RedisConnection(cast(coredis.Redis[str], client), (client,))


def _location(text: str, default_port: int) -> TCPLocation:
    """``host[:port]`` (``[v6]:port``) of a URL's host list."""
    u = urlsplit("//" + text)
    return TCPLocation(u.hostname or "127.0.0.1", u.port or default_port)


def describe(exc: BaseException) -> str:
    """One line for a failure of the store: the exception's type and its message (a coredis connection error
    adds the reason it wraps: refused, TLS verification, timeout)."""
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}".rstrip(": ")
    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, coredis.exceptions.ConnectionError) and cause is not None:
        text += f" ({type(cause).__name__}: {' '.join(str(cause).split())})".replace(": )", ")")
    return text[:300]


# what a coredis call raises when the store fails: OSError (TimeoutError included), coredis' RedisError tree
# (connection, authentication, error replies), anyio's stream errors of a connection that just closed
FAILURES: tuple[type[Exception], ...] = (
    OSError,
    coredis.exceptions.RedisError,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
)


@contextmanager
def store_errors() -> Iterator[None]:
    """Turn a failure of the store (:data:`FAILURES`, alone or as the only leaves of an exception group) into
    :class:`StoreError`; anything else (cancellation included) passes unchanged."""
    try:
        yield
    except FAILURES as e:
        raise StoreError(describe(e)) from e
    except BaseExceptionGroup as group:
        failures, rest = group.split(FAILURES)
        if failures is None or rest is not None:
            raise
        first: BaseException = failures
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise StoreError(describe(first)) from group
