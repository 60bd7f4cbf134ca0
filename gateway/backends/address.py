"""Backend addresses: ``unix:PATH`` or ``tcp://HOST:PORT`` (the ``--listen`` forms of ``python -m backend``)."""

from __future__ import annotations

import socket

import trio


def parse_backend_url(url: str) -> tuple[str, str | tuple[str, int]]:
    """``unix:PATH`` -> ("unix", PATH); ``tcp://HOST:PORT`` -> ("tcp", (HOST, PORT)).

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
    if url.startswith("tcp://"):
        host, sep, port = url[6:].rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"backend url {url!r} lacks a port")
        return "tcp", (host.strip("[]") or "127.0.0.1", int(port))
    raise ValueError(f"backend url must be unix:PATH or tcp://HOST:PORT, got {url!r}")


async def open_backend_stream(url: str) -> trio.abc.Stream:
    """Connect to ``url`` (see ``parse_backend_url``). Raises OSError when nothing listens."""
    kind, addr = parse_backend_url(url)
    if kind == "unix":
        return await trio.open_unix_socket(addr)  # type: ignore[arg-type]
    host, port = addr  # type: ignore[misc]
    stream = await trio.open_tcp_stream(host, port)
    try:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass
    return stream
