"""Backend addresses and how the link to one is opened.

Forms (the ``--listen`` forms of ``python -m backend``, plus TLS): ``unix:PATH``, ``tcp://HOST:PORT``, and
``tls://HOST:PORT`` (alias ``tcp+tls://HOST:PORT``): TCP under TLS, the certificate verified against the
system's CAs or ``backend_tls_ca_file`` and the host name of the URL (Python ``ssl.create_default_context``).

``LinkCredentials`` is what the gateway proves and checks on a link: the shared secret of the handshake
(``backend.protocol`` module docstring; required on TCP and TLS links) and the TLS client context. TCP
sockets get ``TCP_NODELAY`` and keepalive probes (tcp(7)), so a backend host that vanishes without closing
the connection is noticed within about ``KEEPIDLE_S + KEEPINTVL_S * KEEPCNT`` seconds of silence.

Source followed: Python ``ssl`` ("Security considerations": verified by default), Trio ``SSLStream``.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import trio

from backend.protocol import AuthenticationFailed, ProtocolError, keepalive_options, load_secret

KEEPIDLE_S, KEEPINTVL_S, KEEPCNT = 2, 1, 2  # seconds idle, seconds between probes, probes

_TLS_SCHEMES = ("tls://", "tcp+tls://")


@dataclass(frozen=True)
class LinkCredentials:
    """``secret``: the link's shared secret (bytes; None: none configured); ``tls``: the client
    ``ssl.SSLContext`` of ``tls://`` URLs (None: the system's default, verified)."""

    secret: bytes | None = None
    tls: ssl.SSLContext | None = None


def link_credentials(
    secret_file: str | None, ca_file: str | None, environ: Mapping[str, str] = os.environ
) -> LinkCredentials:
    """The credentials of the ``[backend]`` settings: the secret from ``secret_file`` or
    ``$LLM_BACKEND_SECRET`` (``backend.protocol.load_secret``), a TLS context trusting ``ca_file`` (else the
    system's CAs).

    Raises:
        ValueError: one line: the secret file cannot be read or is too short, the CA file does not load.
    """
    secret = load_secret(secret_file, environ)
    tls = None
    if ca_file is not None:
        try:
            tls = ssl.create_default_context(cafile=ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the backend CA file {ca_file}: {exc}") from None
    return LinkCredentials(secret=secret, tls=tls)


def parse_backend_url(url: str) -> tuple[Literal["unix", "tcp", "tls"], str | tuple[str, int]]:
    """``unix:PATH`` -> ("unix", PATH); ``tcp://HOST:PORT`` -> ("tcp", (HOST, PORT)); ``tls://HOST:PORT`` or
    ``tcp+tls://HOST:PORT`` -> ("tls", (HOST, PORT)).

    Raises:
        ValueError: any other form.
    """
    if url.startswith("unix:"):
        path = url[5:]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ValueError(f"empty unix socket path in {url!r}")
        return "unix", path
    for scheme, kind in (("tcp://", "tcp"), *((s, "tls") for s in _TLS_SCHEMES)):
        if url.startswith(scheme):
            host, sep, port = url[len(scheme) :].rpartition(":")
            if not sep or not port.isdigit():
                raise ValueError(f"backend url {url!r} lacks a port")
            return kind, (host.strip("[]") or "127.0.0.1", int(port))  # type: ignore[return-value]
    raise ValueError(f"backend url must be unix:PATH or tcp://HOST:PORT (or tls://HOST:PORT), got {url!r}")


def is_network_url(url: str) -> bool:
    """Whether ``url`` is a TCP or TLS link (the shared secret is required there)."""
    return parse_backend_url(url)[0] != "unix"


def _tune_tcp(stream: trio.SocketStream) -> None:
    try:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in keepalive_options(KEEPIDLE_S, KEEPINTVL_S, KEEPCNT):
            stream.setsockopt(*opt)
    except (OSError, AttributeError):
        pass


async def open_backend_stream(url: str, tls: ssl.SSLContext | None = None) -> trio.abc.Stream:
    """Connect to ``url`` (see ``parse_backend_url``); a ``tls://`` URL completes the TLS handshake with
    ``tls`` (None: ``ssl.create_default_context()``), checking the certificate and the host name.

    Raises:
        OSError: nothing listens at ``url``.
        AuthenticationFailed: the backend's certificate does not verify (waiting will not fix it).
        ProtocolError: the TLS handshake failed otherwise (the peer does not speak TLS, closed it).
    """
    kind, addr = parse_backend_url(url)
    if kind == "unix":
        return await trio.open_unix_socket(addr)  # type: ignore[arg-type]
    host, port = addr  # type: ignore[misc]
    stream = await trio.open_tcp_stream(host, port)
    _tune_tcp(stream)
    if kind == "tcp":
        return stream
    ssl_stream = trio.SSLStream(stream, tls or ssl.create_default_context(), server_hostname=host)
    try:
        await ssl_stream.do_handshake()
    except trio.BrokenResourceError as exc:
        await trio.aclose_forcefully(ssl_stream)
        cause = exc.__cause__ or exc
        if isinstance(cause, ssl.SSLCertVerificationError):
            raise AuthenticationFailed(f"TLS handshake with {url} failed: {cause}") from None
        raise ProtocolError(
            f"TLS handshake with {url} failed: {cause} (a backend listening without TLS has a tcp:// URL)"
        ) from None
    except BaseException:
        await trio.aclose_forcefully(ssl_stream)
        raise
    return ssl_stream
