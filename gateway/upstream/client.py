"""``UpstreamClient``: one ``httpx.AsyncClient`` per upstream model, the failover over its URLs, and the
mapping of what the upstream answers onto the gateway's errors.

httpx runs under Trio through anyio; the client's connection pool is the model's, closed by ``aclose`` at
shutdown. ``stream(path, body)`` POSTs JSON to each URL in order until one answers 2xx and yields that
response unread (``stream=True``); leaving the block closes it in cancel-shielded cleanup, which closes the
upstream connection when the answer was not read to its end (the upstream sees the client leave). Retries
and failover happen here only, before anything was sent to the client: once a response is yielded, a
failure is the run's to report.

Per URL: refused, unresolvable or a connect timeout -> the next URL (503 ``UpstreamUnavailable`` after the
last); a 5xx, a 3xx (never followed), a read timeout or a broken answer before the status line -> the next
URL (502 ``UpstreamError`` after the last, which wins over 503); a 4xx -> no failover (the request is what
the upstream refused): ``errors.refused`` (the same status and message; 429 with its ``retry-after``).

The API key goes in the ``Authorization`` header only; logs name a URL by scheme, host and port. https URLs
are verified against the system's CAs or ``ca_file``; httpx's standard ``HTTP(S)_PROXY`` / ``NO_PROXY``
environment variables apply.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import trio

from gateway.errors import APIError, LoopDetected
from gateway.middleware.hops import outgoing_via
from gateway.upstream.config import UpstreamConfig
from gateway.upstream.errors import UpstreamError, UpstreamUnavailable, refused

log = logging.getLogger("gateway.upstream")

_ERROR_BODY_BYTES = 64 * 1024  # of an error answer read to find its message
_encode = msgspec.json.Encoder().encode


def _where(url: str) -> str:
    """``scheme://host:port`` of ``url`` (no user info, path or query in a log line)."""
    u = httpx.URL(url)
    return f"{u.scheme}://{u.host}" + (f":{u.port}" if u.port else "")


async def _error_body(resp: httpx.Response) -> Any:
    """The JSON of an error answer (at most ``_ERROR_BODY_BYTES`` read), or None."""
    data = b""
    try:
        async for part in resp.aiter_bytes():
            data += part
            if len(data) >= _ERROR_BODY_BYTES:
                break
    except httpx.HTTPError:
        pass
    try:
        return msgspec.json.decode(data[:_ERROR_BODY_BYTES])
    except msgspec.DecodeError:
        return None


class UpstreamClient:
    """The HTTP side of one upstream model.

    Args:
        name: the served name (log lines only).
        config: its URLs and timeouts (``UpstreamConfig``).
        api_key: sent as ``Authorization: Bearer``; None: no header.

    Attributes:
        in_flight: upstream requests open now (0 when every answer was closed).
    """

    def __init__(self, name: str, config: UpstreamConfig, api_key: str | None) -> None:
        self.name = name
        self.urls = [u.rstrip("/") for u in config.urls]
        headers = {"content-type": "application/json", "user-agent": "llm-gateway"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self.http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(config.read_timeout, connect=config.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
            follow_redirects=False,
            verify=config.tls(),
        )
        self.in_flight = 0

    async def aclose(self) -> None:
        """Close the connection pool (the gateway's shutdown)."""
        await self.http.aclose()

    @asynccontextmanager
    async def stream(
        self, path: str, body: dict[str, Any], request_id: str | None = None
    ) -> AsyncIterator[httpx.Response]:
        """POST ``body`` to ``path`` (``/chat/completions``, ``/completions``) of the first URL that takes it;
        the response is yielded unread and closed (cancel-shielded) when the block ends. ``request_id`` goes
        as ``x-request-id`` (the upstream's logs can name the same request).

        Raises:
            LoopDetected: 508, the upstream answered 508 (a loop).
            UpstreamUnavailable: 503, no URL could be reached.
            UpstreamError: 502, every reachable URL failed (5xx, timeout, broken answer).
            APIError: the upstream's 4xx (``errors.refused``).
        """
        headers = {"via": outgoing_via()}
        if request_id:
            headers["x-request-id"] = request_id
        resp = await self._send(path, _encode(body), headers)
        self.in_flight += 1
        try:
            yield resp
        finally:
            self.in_flight -= 1
            with trio.CancelScope(shield=True):
                await resp.aclose()

    async def _send(self, path: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
        failure: APIError | None = None
        for url in self.urls:
            req = self.http.build_request("POST", url + path, content=content, headers=headers)
            try:
                resp = await self.http.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                log.warning("model %s: %s unreachable (%s)", self.name, _where(url), type(exc).__name__)
                if not isinstance(failure, UpstreamError):
                    failure = UpstreamUnavailable(
                        f"The upstream model server of '{self.name}' is unreachable."
                    )
                continue
            except httpx.TimeoutException:
                log.warning("model %s: %s timed out before answering", self.name, _where(url))
                failure = UpstreamError(f"The upstream model server of '{self.name}' did not answer in time.")
                continue
            except httpx.HTTPError as exc:
                log.warning("model %s: %s failed (%s)", self.name, _where(url), type(exc).__name__)
                failure = UpstreamError(f"The upstream model server of '{self.name}' broke off the answer.")
                continue
            if resp.status_code < 300:
                return resp
            try:
                data = await _error_body(resp)
            finally:
                with trio.CancelScope(shield=True):
                    await resp.aclose()
            if resp.status_code == 508:  # a loop back to a gateway on the way: no other URL can help
                log.warning("model %s: %s answered 508 (a loop)", self.name, _where(url))
                raise LoopDetected(
                    f"The upstream model server of '{self.name}' leads back to a gateway this request has "
                    "already passed through (a loop): point the model's urls at another server."
                )
            if resp.status_code >= 500 or resp.status_code < 400:  # a 3xx is not followed: a failure
                log.warning("model %s: %s answered %d", self.name, _where(url), resp.status_code)
                failure = UpstreamError(
                    f"The upstream model server of '{self.name}' answered {resp.status_code}."
                )
                continue
            raise refused(resp.status_code, data, {k.lower(): v for k, v in resp.headers.items()})
        assert failure is not None  # at least one URL (UpstreamConfig.check)
        raise failure
