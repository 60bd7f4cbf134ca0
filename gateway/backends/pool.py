"""``BackendPool``: every supervised backend of the gateway; ``pick()`` chooses one per request.

The pool owns only the ``draining`` flag (set on SIGINT/SIGTERM) and the last model card seen; each backend's
state belongs to its ``BackendSupervisor`` (gateway/backends/supervisor.py), read here by reference.
"""

from __future__ import annotations

import logging

import trio

from backend.protocol import ModelCard, Stats
from gateway.backends.client import BackendClient
from gateway.backends.request import BackendUnavailable
from gateway.backends.supervisor import BackendStartError, BackendSupervisor, ModelUnavailable

log = logging.getLogger("gateway.backends")


class BackendPool:
    """All supervised backends; ``pick()`` returns the ready client with the fewest requests in flight."""

    def __init__(self, supervisors: list[BackendSupervisor], *, wait_timeout: float = 30.0) -> None:
        self.supervisors = supervisors
        self.wait_timeout = wait_timeout
        self.draining = False
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
        for s in self.supervisors:
            if s.client is not None and s.client.alive:
                return s.client
        return None

    def is_ready(self) -> bool:
        return not self.draining and self.ready is not None

    def unavailable_error(self) -> ModelUnavailable | None:
        """503 ``model_unavailable`` (the soonest ``retry-after``) when every backend is unavailable, else
        None."""
        errors = [s.unavailable_error() for s in self.supervisors]
        if not errors or any(e is None for e in errors):
            return None
        return min(errors, key=lambda e: int(e.headers["retry-after"]))  # type: ignore[union-attr]

    async def pick(self) -> BackendClient:
        """Least-loaded ready client; waits up to ``wait_timeout`` s for one.

        Raises:
            ModelUnavailable: every backend is unavailable (at once, no wait).
            BackendUnavailable: draining, or none ready in time.
        """
        if self.draining:
            raise BackendUnavailable("The gateway is shutting down.")
        live = [s.client for s in self.supervisors if s.client is not None and s.client.alive]
        if live:
            return min(live, key=lambda c: c.in_flight)
        if len(self.supervisors) == 1:
            return await self.supervisors[0].wait_client(self.wait_timeout)
        with trio.move_on_after(self.wait_timeout):
            while True:
                live = [s.client for s in self.supervisors if s.client is not None and s.client.alive]
                if live:
                    return min(live, key=lambda c: c.in_flight)
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
