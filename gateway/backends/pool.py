"""``BackendPool``: every supervised backend of one model; ``pick()`` chooses one per request.

The pool owns the ``draining`` flag (set on SIGINT/SIGTERM), the operator's per-backend drains (by name), the
router (gateway/backends/routing.py: prefix-aware or least-loaded) and the last model card seen; each
backend's state belongs to its ``BackendSupervisor`` (gateway/backends/supervisor.py), read here by reference.

A drained backend gets no new request; those in flight finish; it stays drained across its restarts until
``undrain``. ``pick()`` with every backend drained is a 503 at once (nothing would end the wait).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import trio

from backend.protocol import ModelCard, Stats
from gateway.backends.client import BackendClient
from gateway.backends.request import BackendUnavailable
from gateway.backends.routing import Router, RoutingConfig
from gateway.backends.supervisor import BackendStartError, BackendSupervisor, ModelUnavailable

log = logging.getLogger("gateway.backends")


def route_id(s: BackendSupervisor) -> str:
    """A backend's rendezvous name, stable across gateway restarts and the same in every gateway sharing it:
    an external backend's URL, a spawned one's supervisor name (its socket path is a fresh temp folder)."""
    return s.name if s.spawn is not None else s.url


class BackendPool:
    """All supervised backends of one model; ``pick()`` returns a ready, undrained client chosen by
    ``routing`` (default: prefix-aware, gateway/backends/routing.py)."""

    def __init__(
        self,
        supervisors: list[BackendSupervisor],
        *,
        wait_timeout: float = 30.0,
        routing: RoutingConfig | None = None,
    ) -> None:
        self.supervisors = supervisors
        self.wait_timeout = wait_timeout
        self.router = Router(routing)
        self.draining = False
        self.drained: set[str] = set()  # supervisor names drained by the operator
        self._last_card: ModelCard | None = None

    @property
    def card(self) -> ModelCard | None:
        """Model card of a ready backend, or of the last one seen (None before the first Ready)."""
        for s in self.supervisors:
            if s.client is not None:
                self._last_card = s.client.card
                return s.client.card
        return self._last_card

    @property
    def ready(self) -> BackendClient | None:
        """A live client that takes requests (not drained), or None."""
        live = self._live()
        return live[0].client if live else None

    def is_ready(self) -> bool:
        return not self.draining and self.ready is not None

    def unavailable_error(self) -> ModelUnavailable | None:
        """503 ``model_unavailable`` (the soonest ``retry-after``) when every backend is unavailable, else
        None."""
        errors = [s.unavailable_error() for s in self.supervisors]
        if not errors or any(e is None for e in errors):
            return None
        return min(errors, key=lambda e: int(e.headers["retry-after"]))  # type: ignore[union-attr]

    # ------------------------------------------------------------------ operator drains
    def supervisor(self, name: str) -> BackendSupervisor | None:
        """The backend named ``name`` (``backend-0``...), or None."""
        return next((s for s in self.supervisors if s.name == name), None)

    def drain(self, name: str) -> None:
        """Route no new request to backend ``name`` (in-flight ones finish). Raises ``KeyError``: no such
        backend."""
        if self.supervisor(name) is None:
            raise KeyError(name)
        if name not in self.drained:
            log.info("%s: draining (no new requests)", name)
        self.drained.add(name)

    def undrain(self, name: str) -> None:
        """Route requests to backend ``name`` again. Raises ``KeyError``: no such backend."""
        if self.supervisor(name) is None:
            raise KeyError(name)
        if name in self.drained:
            log.info("%s: taking requests again", name)
        self.drained.discard(name)

    async def wait_drained(self, name: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until drained backend ``name`` has no request in flight; True
        when it has none (or is not running), False when still busy or no longer drained."""
        with trio.move_on_after(timeout):
            while name in self.drained:
                s = self.supervisor(name)
                if s is None or s.client is None or s.client.in_flight == 0:
                    return True
                await trio.sleep(0.05)
            return False
        s = self.supervisor(name)
        return s is None or s.client is None or s.client.in_flight == 0

    # ------------------------------------------------------------------ picking
    def _live(self) -> list[BackendSupervisor]:
        return [
            s
            for s in self.supervisors
            if s.client is not None and s.client.alive and s.name not in self.drained
        ]

    def _choose(self, prompt_ids: Sequence[int] | None, salt: str) -> BackendClient | None:
        live = [(s, s.client) for s in self._live() if s.client is not None]
        if len(live) <= 1:
            return live[0][1] if live else None
        i = self.router.choose(
            [route_id(s) for s, _ in live],
            [c.in_flight for _, c in live],
            prompt_ids,
            salt,
            live[0][1].ready.block_size,
        )
        return live[i][1]

    async def pick(self, prompt_ids: Sequence[int] | None = None, salt: str = "") -> BackendClient:
        """A ready, undrained client for a request with these prompt token ids and ``Submit.cache_salt``
        (chosen by the routing policy; no ``prompt_ids``: least-loaded); waits up to ``wait_timeout`` s for
        one to (re)start.

        Raises:
            ModelUnavailable: every backend is unavailable (at once, no wait).
            BackendUnavailable: draining, every backend drained by the operator (at once), or none ready in
                time.
        """
        if self.draining:
            raise BackendUnavailable("The gateway is shutting down.")
        c = self._choose(prompt_ids, salt)
        if c is not None:
            return c
        if len(self.supervisors) == 1 and not self.drained:
            return await self.supervisors[0].wait_client(self.wait_timeout)
        with trio.move_on_after(self.wait_timeout):
            while True:
                if self.supervisors and all(s.name in self.drained for s in self.supervisors):
                    raise BackendUnavailable("Every inference backend is drained; retry later.")
                c = self._choose(prompt_ids, salt)
                if c is not None:
                    return c
                err = self.unavailable_error()
                if err is not None:
                    raise err
                await trio.sleep(0.05)
        raise BackendUnavailable("No inference backend is ready; retry shortly.")

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Start every supervisor at once; ``started()`` once all of them are ready.

        Raises:
            BackendStartError: a backend's first start failed for good (the first such error; the other
                backends are stopped).
        """
        failures: list[BackendStartError] = []
        async with trio.open_nursery() as nursery:

            async def start(s: BackendSupervisor) -> None:
                try:
                    await nursery.start(s.run)
                except BackendStartError as exc:
                    failures.append(exc)
                    nursery.cancel_scope.cancel()

            async with trio.open_nursery() as starting:
                for s in self.supervisors:
                    starting.start_soon(start, s)
            if not failures:
                task_status.started()
        if failures:
            raise failures[0]

    async def stop(self, grace: float = 10.0) -> None:
        async with trio.open_nursery() as nursery:
            for s in self.supervisors:
                nursery.start_soon(s.stop, grace)

    async def stats(self) -> dict[str, tuple[Stats, int]]:
        """``{supervisor name: (Stats, restarts)}`` of the live backends (``GET /metrics`` polls it on each
        scrape; the restart count tells a restarted backend's counters from a reset). A backend whose poll
        fails is left out, so its last counters stay."""
        out: dict[str, tuple[Stats, int]] = {}
        for s in self.supervisors:
            c = s.client
            if c is None or not c.alive:
                continue
            try:
                out[s.name] = (await c.get_stats(), s.restarts)
            except BackendUnavailable:
                log.debug("stats poll of %s failed", s.name, exc_info=True)
        return out
