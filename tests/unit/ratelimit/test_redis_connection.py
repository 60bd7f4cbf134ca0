"""The limiter's Redis connection against real redis-servers: a password (``requirepass``), an ACL user, TLS
with a self-signed certificate (verified through ``ssl_ca_certs``, host name checked, a client certificate),
a Unix socket, a Sentinel; what is wrong (a bad password, a CA that did not sign the server's certificate, a
URL the client cannot use) is a clear error at start and a 503 per request, never a hang or a 500."""

from __future__ import annotations

import os
import ssl
import time
from pathlib import Path
from urllib.parse import quote

import anyio
import coredis.exceptions
import pytest
import trio
from plugins.books import NullBook
from plugins.redis_server import (
    TLSFiles,
    redis_has_tls,
    require_redis,
    running,
    self_signed,
    start_redis,
    start_sentinel,
    stop_redis,
)

from auth.principal import Principal
from ratelimit.admission import Admission
from ratelimit.core import Limits
from ratelimit.errors import LimiterUnavailable, RateLimitExceeded, StoreError
from ratelimit.redis_client import redis_connection, store_errors, tls_context
from ratelimit.redis_limiter import RedisLimiter

PASSWORD = "s3cret/with:odd@chars"  # percent-encoded in URLs


def fresh(**limits) -> Principal:
    tag = f"c{os.getpid()}-{time.time_ns()}"
    return Principal(f"tn_{tag}", tag, f"key_{tag}", "sk-gw-AbCd", Limits(**limits))


async def exact_rpm(url: str) -> None:
    """Start-up check, then rpm 2 admits 2 of 3 through ``url``: the connection carries the scripts."""
    adm = Admission(RedisLimiter(url), NullBook())
    await adm.start()
    async with running(adm):
        p = fresh(rpm=2, window_s=3600)
        for _ in range(2):
            async with adm.admit(p, prompt_tokens=1, max_tokens=1) as r:
                r.finish(completion_tokens=1)
        with pytest.raises(RateLimitExceeded):
            await adm.reserve(p, prompt_tokens=1, max_tokens=1)


async def refused_everywhere(url: str, expect: str) -> None:
    """``url`` cannot be used: the start-up check names the cause (``expect``, in the message), and a request
    admitted through it is a 503, within the timeouts."""
    adm = Admission(RedisLimiter(url, connect_timeout_s=2.0, command_timeout_s=2.0), NullBook())
    with trio.fail_after(10):
        with pytest.raises(StoreError) as ei:
            await adm.start()
        assert expect.lower() in str(ei.value).lower(), str(ei.value)
        assert PASSWORD not in str(ei.value)
        async with running(adm):
            with pytest.raises(LimiterUnavailable):
                await adm.reserve(fresh(rpm=5), prompt_tokens=1, max_tokens=1)


def with_userinfo(url: str, userinfo: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{userinfo}@{rest}"


async def test_password_and_acl_user(tmp_path):
    """``redis://:password@`` for requirepass and ``redis://user:password@`` for an ACL user work; a wrong
    password, no password, or a user without the password is refused with the server's reason."""
    acl = ["alice", "on", f">{PASSWORD}", "~*", "&*", "+@all"]  # one word per argument
    proc, url = start_redis(tmp_path, extra=["--requirepass", PASSWORD, "--user", *acl])
    try:
        await exact_rpm(with_userinfo(url, ":" + quote(PASSWORD, safe="")))
        await exact_rpm(with_userinfo(url, "alice:" + quote(PASSWORD, safe="")))
        await refused_everywhere(with_userinfo(url, ":wrong"), "invalid username-password")
        await refused_everywhere(with_userinfo(url, "alice:wrong"), "invalid username-password")
        await refused_everywhere(url, "AuthenticationRequiredError")
    finally:
        stop_redis(proc)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> TLSFiles:
    require_redis()
    if not redis_has_tls():
        pytest.skip("this redis-server was built without TLS (BUILD_TLS=yes)")
    return self_signed(tmp_path_factory.mktemp("tls"))


async def test_tls_with_a_self_signed_certificate(tmp_path, tls_files):
    """``rediss://`` verifies the server's certificate against ``ssl_ca_certs`` and checks the host name:
    the right CA works; another CA, the system's CAs (the default) or a host name the certificate does not
    name are refused at the TLS handshake; a plain ``redis://`` to the TLS port gets no answer, not a hang."""
    proc, url = start_redis(tmp_path, tls=tls_files)
    try:
        await exact_rpm(f"{url}?ssl_ca_certs={tls_files.cert}")
        other = self_signed(Path(tmp_path))  # a CA that did not sign the server's certificate
        await refused_everywhere(f"{url}?ssl_ca_certs={other.cert}", "CERTIFICATE_VERIFY_FAILED")
        await refused_everywhere(url, "CERTIFICATE_VERIFY_FAILED")
        localhost = url.replace("127.0.0.1", "localhost") + f"?ssl_ca_certs={tls_files.cert}"
        await refused_everywhere(localhost, "CERTIFICATE_VERIFY_FAILED")
        await exact_rpm(localhost + "&ssl_check_hostname=false")
        await refused_everywhere(url.replace("rediss://", "redis://"), "Connection")
    finally:
        stop_redis(proc)


async def test_tls_with_a_client_certificate(tmp_path, tls_files):
    """A server with ``tls-auth-clients yes`` admits a client that presents a certificate of its CA
    (``ssl_certfile`` + ``ssl_keyfile``) and refuses one without."""
    proc, url = start_redis(tmp_path, tls=tls_files, extra=["--tls-auth-clients", "yes"])
    try:
        ca = f"{url}?ssl_ca_certs={tls_files.cert}"
        await exact_rpm(f"{ca}&ssl_certfile={tls_files.cert}&ssl_keyfile={tls_files.key}")
        await refused_everywhere(ca, "Connection")
    finally:
        stop_redis(proc)


async def test_unix_socket(tmp_path):
    sock = tmp_path / "redis.sock"
    proc, _ = start_redis(tmp_path, extra=["--unixsocket", str(sock), "--unixsocketperm", "700"])
    try:
        await exact_rpm(f"unix://{sock}?db=0")
    finally:
        stop_redis(proc)


async def test_sentinel_names_the_primary(tmp_path):
    """``redis+sentinel://`` asks the Sentinel for the primary of the service and admits through it (with the
    primary's password); a service the Sentinel does not monitor is refused with that reason. A failover is
    not tested."""
    proc, url = start_redis(tmp_path, extra=["--requirepass", PASSWORD])
    sentinel = None
    try:
        sentinel, sentinel_url = start_sentinel(tmp_path, url, password=PASSWORD)
        await exact_rpm(sentinel_url)
        await refused_everywhere(
            sentinel_url.replace("/mymaster/", "/nosuch/"), "No primary found for 'nosuch'"
        )
    finally:
        if sentinel is not None:
            stop_redis(sentinel)
        stop_redis(proc)


@pytest.mark.parametrize(
    ("url", "expect"),
    [
        ("http://127.0.0.1:6379", "scheme"),
        ("redis+cluster://127.0.0.1:7000", "scheme"),
        ("redis+sentinel://127.0.0.1:26379", "service name"),
        ("redis://127.0.0.1:6379/0?ssl_ca_certs=/x.pem", "rediss://"),
        ("rediss://127.0.0.1:6379/0?ssl_ca_cert=/x.pem", "unknown query parameter(s) ssl_ca_cert"),
        ("rediss://127.0.0.1:6379/0?ssl_ca_certs=/nonexistent/ca.pem", "cannot load the TLS files"),
        ("rediss://127.0.0.1:6379/0?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
        ("rediss://127.0.0.1:6379/0?ssl_check_hostname=perhaps", "ssl_check_hostname"),
        ("redis://127.0.0.1:6379/zero", "must be numbers"),
        ("redis://127.0.0.1:port/0", "must be numbers"),
        ("unix://", "socket's path"),
    ],
)
def test_a_url_the_client_cannot_use_is_a_clear_error(url, expect):
    with pytest.raises(ValueError) as ei:
        RedisLimiter(url)
    assert expect in str(ei.value)


def test_tls_defaults_verify_and_check_the_host_name():
    ctx = tls_context({})
    assert (ctx.verify_mode, ctx.check_hostname) == (ssl.CERT_REQUIRED, True)
    ctx = tls_context({"ssl_cert_reqs": "none"})
    assert (ctx.verify_mode, ctx.check_hostname) == (ssl.CERT_NONE, False)


def test_bounded_timeouts_reach_the_connections():
    params = redis_connection("redis://127.0.0.1:6379/3").client.connection_pool.connection_kwargs
    assert (params["connect_timeout"], params["stream_timeout"], params["db"]) == (5.0, 5.0, 3)


@pytest.mark.parametrize(
    "exc",
    [
        OSError("refused"),
        TimeoutError("slow"),
        coredis.exceptions.AuthenticationFailureError("bad password"),
        anyio.BrokenResourceError(),
        ExceptionGroup("pool", [ExceptionGroup("connection", [coredis.exceptions.ConnectionError("lost")])]),
    ],
)
def test_a_failure_of_the_store_is_one_error(exc):
    """What coredis raises when Redis fails, alone or as the only leaves of an exception group, is a
    StoreError (admission: a 503); a bug is not hidden behind one."""
    with pytest.raises(StoreError):
        with store_errors():
            raise exc
    for bug in (ValueError("bug"), ExceptionGroup("pool", [OSError("x"), ValueError("bug")])):
        with pytest.raises(type(bug)):
            with store_errors():
                raise bug
