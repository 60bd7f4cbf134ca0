"""``BackendSupervisor``: one per backend (``BackendPool`` in gateway/backends/pool.py picks one per request).

A supervisor owns one backend: either a process it spawns
(``python -m backend --model PATH --listen unix:SOCK ...``) or an external
``--backend-url``. Its ``run()`` loop: start the process, connect and
handshake (``BackendClient.connect``), publish the client, run it until the
connection or the process ends, then fail what was in flight (the client does
that: HTTP 503 before streaming, an error event mid-stream), kill a
half-dead process, wait a backoff (0.5 s doubling to 10 s, reset after 30 s of
healthy running) and start again. ``stop()`` sends ``Shutdown`` and waits a
bounded time for the process to exit (then SIGKILL).

Nothing mutable is shared: handlers only read ``supervisor.client`` (a
reference swap done by the supervisor's own task) and wait on ``ready_event``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import trio

from gateway.backends.client import BackendClient
from gateway.backends.request import DEFAULT_REQUEST_BUFFER, BackendUnavailable

log = logging.getLogger("gateway.supervisor")


@dataclass
class SpawnSpec:
    """How to start a backend process: ``python -m backend --model MODEL --listen unix:SOCK *extra``."""

    model: str
    extra_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    startup_timeout: float = 600.0  # seconds to wait for the socket + handshake


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM us when the gateway dies (prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001 - not Linux: best effort
        pass


class _Proc:
    """A ``subprocess.Popen`` with an async ``wait`` (polls every 50 ms; the socket EOF is the fast signal)."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    async def wait(self) -> int:
        while self.popen.poll() is None:  # noqa: ASYNC110 - a child exit sets no Trio event; polling is the wait
            await trio.sleep(0.05)
        return self.popen.returncode

    def send_signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class BackendSupervisor:
    """Supervises one backend (spawned when ``spawn`` is given, else external at ``url``)."""

    def __init__(
        self,
        *,
        url: str | None = None,
        spawn: SpawnSpec | None = None,
        name: str = "backend-0",
        request_buffer: int = DEFAULT_REQUEST_BUFFER,
    ) -> None:
        if (url is None) == (spawn is None):
            raise ValueError("give exactly one of url / spawn")
        self.name = name
        self.spawn = spawn
        self._tmpdir: str | None = None
        if spawn is not None:
            self._tmpdir = tempfile.mkdtemp(prefix="gateway-backend-")
            url = f"unix:{os.path.join(self._tmpdir, name + '.sock')}"
        self.url: str = url  # type: ignore[assignment]
        self.request_buffer = request_buffer
        self.client: BackendClient | None = None
        self.ready_event = trio.Event()
        self.state = "starting"  # starting | ready | restarting | stopped
        self.restarts = 0
        self.pid: int | None = None
        self.last_error: str | None = None
        self._stopping = False
        self._proc: _Proc | None = None
        self._cancel: trio.CancelScope | None = None

    # ------------------------------------------------------------------ handler side
    async def wait_client(self, timeout: float) -> BackendClient:
        """The live client, waiting up to ``timeout`` seconds for (re)start.

        Raises:
            BackendUnavailable: none ready in time, or shutting down.
        """
        if self.client is not None and self.client.alive:
            return self.client
        if self._stopping:
            raise BackendUnavailable("The gateway is shutting down.")
        with trio.move_on_after(timeout):
            while True:
                await self.ready_event.wait()
                c = self.client
                if c is not None and c.alive:
                    return c
                await trio.sleep(0.05)
        raise BackendUnavailable("The inference backend is starting or restarting; retry shortly.")

    def info(self) -> dict:
        c = self.client
        return {
            "name": self.name,
            "url": self.url,
            "state": self.state,
            "pid": self.pid,
            "restarts": self.restarts,
            "in_flight": c.in_flight if c else 0,
            "last_error": self.last_error,
        }

    # ------------------------------------------------------------------ actor body
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Supervise until ``stop()``; ``task_status.started()`` fires on the first ``Ready``."""
        backoff = 0.5
        started = False
        with trio.CancelScope() as self._cancel:
            while not self._stopping:
                t0 = time.monotonic()
                try:
                    async with trio.open_nursery() as nursery:
                        if self.spawn is not None:
                            self._proc = await self._start_process()
                            self.pid = self._proc.pid
                            nursery.start_soon(self._watch_process, self._proc, nursery.cancel_scope)
                        client = await self._connect()
                        self.client = client
                        self.state = "ready"
                        self.ready_event.set()
                        log.info(
                            "%s ready at %s (pid %s): %s", self.name, self.url, self.pid, client.card.name
                        )
                        if not started:
                            started = True
                            task_status.started()
                        await client.run()
                        self.last_error = client.closed_reason
                        nursery.cancel_scope.cancel()
                except (OSError, trio.TooSlowError, Exception) as exc:  # noqa: BLE001 - supervisor must survive
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.warning("%s failed: %s", self.name, self.last_error)
                finally:
                    if self.client is not None:
                        self.client.close_all()
                    self.client = None
                    self.ready_event = trio.Event()
                    with trio.CancelScope(shield=True):
                        await self._reap()
                if self._stopping:
                    break
                self.state = "restarting"
                self.restarts += 1
                if time.monotonic() - t0 > 30:
                    backoff = 0.5
                log.warning("%s: restarting in %.1fs (restart #%d)", self.name, backoff, self.restarts)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
        self.state = "stopped"
        self._remove_tmpdir()
        if not started:
            task_status.started()

    def _remove_tmpdir(self) -> None:
        """Remove the spawned backend's socket folder (ours; the backend removes only its socket)."""
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    async def _start_process(self) -> _Proc:
        spec = self.spawn
        assert spec is not None
        sock = self.url[5:]
        try:
            os.unlink(sock)
        except FileNotFoundError:
            pass
        cmd = [spec.python, "-m", "backend", "--model", spec.model, "--listen", self.url, *spec.extra_args]
        log.info("starting backend: %s", " ".join(cmd))
        # Own session (a terminal's Ctrl-C reaches only the gateway, which drains then stops the backend),
        # and a parent-death signal so that a SIGKILLed gateway never leaves an orphan backend (Linux).
        # Popen runs here, in the Trio thread: PR_SET_PDEATHSIG fires when the *forking thread* exits, so a
        # worker thread (what trio.lowlevel.open_process uses) would kill the backend when it is recycled.
        return _Proc(
            subprocess.Popen(  # noqa: ASYNC220 - must fork in this thread (PR_SET_PDEATHSIG, above)
                cmd, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent
            )
        )

    async def _watch_process(self, proc: _Proc, scope: trio.CancelScope) -> None:
        rc = await proc.wait()
        self.last_error = f"backend process exited with code {rc}"
        log.warning("%s: %s", self.name, self.last_error)
        scope.cancel()

    async def _connect(self) -> BackendClient:
        timeout = self.spawn.startup_timeout if self.spawn else 30.0
        deadline = trio.current_time() + timeout
        delay = 0.05
        while True:
            try:
                return await BackendClient.connect(
                    self.url,
                    timeout=max(1.0, deadline - trio.current_time()),
                    request_buffer=self.request_buffer,
                )
            except OSError as exc:
                if trio.current_time() >= deadline:
                    raise trio.TooSlowError(
                        f"backend at {self.url} not reachable after {timeout:.0f}s: {exc}"
                    ) from None
                await trio.sleep(delay)
                delay = min(delay * 1.5, 0.5)

    async def _reap(self, grace: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.returncode is None:
            with trio.move_on_after(grace if self._stopping else 0.5):
                await proc.wait()
        if proc.returncode is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            with trio.move_on_after(3):
                await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def stop(self, grace: float = 10.0) -> None:
        """Send ``Shutdown``, wait up to ``grace`` seconds for the process to exit, then end ``run()``."""
        self._stopping = True
        self.state = "stopped"
        c = self.client
        if c is not None:
            c.shutdown()
        proc = self._proc
        if proc is not None:
            with trio.move_on_after(grace):
                await proc.wait()
        if self._cancel is not None:
            self._cancel.cancel()
