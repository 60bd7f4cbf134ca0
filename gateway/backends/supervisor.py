"""``BackendSupervisor``: one per backend (``BackendPool`` in gateway/backends/pool.py picks one per request).

A supervisor owns one backend: either a process it spawns (``python -m backend --model PATH --listen
unix:SOCK ...``, ``gateway/backends/process.py``; with ``SpawnSpec.host``, ``tcp://HOST:PORT`` on a free port
and a fresh secret per start in ``$LLM_BACKEND_SECRET``, never on the command line) or an external
``--backend-url`` (proving ``LinkCredentials.secret``). Its ``run()`` loop: start the process, connect and
handshake (``BackendClient.connect``), publish the client, run it until the connection or the process ends,
then fail what was in flight (the client does that: HTTP 503 before streaming, an error event mid-stream),
stop a half-dead process (SIGTERM, then SIGKILL after 3 s), wait a backoff and start again.

Failures (an attempt that never reached ``Ready``, or a backend that ended before ``HEALTHY_S`` of running):

* **First start.** A spawned backend that exits with ``EXIT_MODEL_LOAD_FAILED`` has said which file and why
  (``backend.protocol.load_error_line``), and a handshake that fails authentication
  (``AuthenticationFailed``: a wrong or missing secret on either side) will not pass by waiting either:
  ``run()`` raises ``BackendStartError`` with that line at once, and nothing retries it. Any other failure is
  retried with the backoff below; ``MAX_FAILURES`` in a row raise ``BackendStartError`` too. The gateway then
  exits non-zero (gateway/server.py). An external backend not up yet is retried within the attempt for
  ``REMOTE_CONNECT_S`` (``CONNECT_RETRY_MIN_S`` doubling to ``BACKOFF_MAX_S``).
* **After a good start.** Restarts back off exponentially: ``BACKOFF_MIN_S`` doubling to ``BACKOFF_MAX_S``,
  the count and the delay reset by ``HEALTHY_S`` of running after ``Ready``. After ``MAX_FAILURES``
  consecutive failures, or at once when a restart cannot load the model (waiting would not fix the file),
  the model is **unavailable**: requests get 503 ``model_unavailable`` with ``retry-after`` without waiting,
  ``/readyz`` is 503, and one attempt is made every ``UNAVAILABLE_RETRY_S``; one that reaches ``Ready``
  serves again. An external backend: one connect per attempt, the same backoff, every ``BACKOFF_MAX_S`` while
  unavailable (a connect is cheap); a failed authentication makes it unavailable at once.

``stop()`` sends ``Shutdown`` (or SIGTERM to a backend still loading, which has no link to send it on) and
waits a bounded time for the process to exit (then SIGKILL); a backoff wait ends at once.

Nothing mutable is shared: handlers only read ``supervisor.client`` and ``state`` (set by the supervisor's
own task) and wait on ``wait_client``.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field

import trio

from backend.protocol import EXIT_MODEL_LOAD_FAILED, SECRET_ENV, AuthenticationFailed
from gateway.backends.address import LinkCredentials
from gateway.backends.client import BackendClient
from gateway.backends.process import BackendProcess
from gateway.backends.request import DEFAULT_REQUEST_BUFFER, BackendUnavailable

log = logging.getLogger("gateway.supervisor")

# default failures in a row before giving up (first start) or unavailable (backend.max_failures)
MAX_FAILURES = 5
HEALTHY_S = 30.0  # seconds of running after Ready that reset the failure count and the backoff
BACKOFF_MIN_S = 0.5  # first restart delay, seconds; doubles per consecutive failure
BACKOFF_MAX_S = 10.0
UNAVAILABLE_RETRY_S = 30.0  # seconds between attempts while the model is unavailable
REMOTE_CONNECT_S = 30.0  # seconds a first start of an external backend retries refused connects
CONNECT_RETRY_MIN_S = 0.05  # first delay between those connects; doubles up to BACKOFF_MAX_S


@dataclass
class SpawnSpec:
    """How to start a backend process: ``python -m backend --model MODEL --listen unix:SOCK *extra``
    (``host``: ``--listen tcp://HOST:PORT``, a free port and a fresh secret at each start)."""

    model: str
    extra_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    startup_timeout: float = 600.0  # seconds to wait for the socket + handshake
    host: str | None = None


class BackendStartError(Exception):
    """The first start of a backend failed for good; ``str()`` is one line naming the file and the reason
    (``cannot load model /m/x.gguf: tensor 'token_embd.weight' missing``) or the last failure."""


class ModelUnavailable(BackendUnavailable):
    """503 ``model_unavailable``: the backend failed ``MAX_FAILURES`` restarts in a row, or a restart could
    not load the model; ``retry-after`` (seconds, >= 1) says when the next attempt is due."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.code = "model_unavailable"
        self.headers["retry-after"] = str(max(1, math.ceil(retry_after)))


class BackendSupervisor:
    """Supervises one backend (spawned when ``spawn`` is given, else external at ``url``).

    ``state``: ``starting`` (first start) | ``ready`` | ``restarting`` | ``unavailable`` | ``stopped``.
    ``credentials``: the secret and TLS context of an external backend's link (a spawned one gets its own).
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        spawn: SpawnSpec | None = None,
        name: str = "backend-0",
        request_buffer: int = DEFAULT_REQUEST_BUFFER,
        max_failures: int = MAX_FAILURES,
        credentials: LinkCredentials | None = None,
    ) -> None:
        if (url is None) == (spawn is None):
            raise ValueError("give exactly one of url / spawn")
        self.name = name
        self.spawn = spawn
        self._tmpdir: str | None = None
        if spawn is not None:
            self._tmpdir = tempfile.mkdtemp(prefix="gateway-backend-")
            # a fixed file name in a directory of its own: the backend's name holds the model's served
            # name, which may contain '/', a NUL or more than AF_UNIX's 108 bytes
            url = f"unix:{os.path.join(self._tmpdir, 'backend.sock')}"
        self.url: str = url  # type: ignore[assignment]
        self.request_buffer = request_buffer
        self.max_failures = max_failures
        self.client: BackendClient | None = None
        self.ready_event = trio.Event()  # set while a client is published
        self.state = "starting"
        self.restarts = 0
        self.failures = 0  # consecutive failed attempts / short runs
        self.pid: int | None = None
        self.last_error: str | None = None
        self._retry_at = 0.0  # time.monotonic() of the next attempt
        self._changed = trio.Event()  # set (and replaced) on every change of client or state
        self._stopping = False
        self._proc: BackendProcess | None = None
        self._cancel: trio.CancelScope | None = None
        self.credentials = credentials or LinkCredentials()
        self._started = False  # a first Ready was seen

    # ------------------------------------------------------------------ handler side
    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def unavailable_error(self) -> ModelUnavailable | None:
        """The 503 to answer while the model is unavailable, else None."""
        if self.state != "unavailable":
            return None
        return ModelUnavailable(  # the reason (a server path) stays in the log and /admin/v1/stats
            "The model is unavailable: its inference backend failed to restart; retry later.",
            retry_after=self._retry_at - time.monotonic(),
        )

    async def wait_client(self, timeout: float) -> BackendClient:
        """The live client, waiting up to ``timeout`` seconds for a (re)start.

        Raises:
            ModelUnavailable: the model is unavailable (at once, no wait).
            BackendUnavailable: none ready in time, or shutting down.
        """
        with trio.move_on_after(timeout):
            while True:
                c = self.client
                if c is not None and c.alive:
                    return c
                if self._stopping:
                    raise BackendUnavailable("The gateway is shutting down.")
                err = self.unavailable_error()
                if err is not None:
                    raise err
                with trio.move_on_after(0.5):  # a link dies without a state change: look again soon
                    await self._changed.wait()
        raise BackendUnavailable("The inference backend is starting or restarting; retry shortly.")

    def info(self) -> dict:
        c = self.client
        return {
            "name": self.name,
            "url": self.url,
            "state": self.state,
            "pid": self.pid,
            "restarts": self.restarts,
            "failures": self.failures,
            "in_flight": c.in_flight if c else 0,
            "last_error": self.last_error,
        }

    # ------------------------------------------------------------------ actor body
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Supervise until ``stop()``; ``task_status.started()`` fires on the first ``Ready``.

        Raises:
            BackendStartError: the first start failed for good (see the module docstring).
        """
        backoff = BACKOFF_MIN_S
        started = False
        failure: BackendStartError | None = None

        def on_ready() -> None:
            nonlocal started
            if not started:
                started = self._started = True
                task_status.started()

        async with trio.open_nursery() as relays:  # stderr relays: each lives until its pipe's EOF
            with trio.CancelScope() as self._cancel:
                while not self._stopping:
                    ready_at, rc, refused = await self._attempt(relays, on_ready)
                    if self._stopping:
                        break
                    if ready_at is not None and time.monotonic() - ready_at >= HEALTHY_S:
                        self.failures, backoff = 0, BACKOFF_MIN_S
                    self.failures += 1
                    load_failed = rc == EXIT_MODEL_LOAD_FAILED or refused  # waiting would not fix it
                    if not started and (load_failed or self.failures >= self.max_failures):
                        failure = BackendStartError(
                            self.last_error
                            if load_failed
                            else f"backend {self.name} failed to start {self.failures} times: {self.last_error}"
                        )
                        break
                    if load_failed or self.failures >= self.max_failures:
                        if self.state != "unavailable":
                            log.error(
                                "%s: model unavailable after %d failure(s) in a row: %s",
                                self.name,
                                self.failures,
                                self.last_error,
                            )
                        delay = UNAVAILABLE_RETRY_S if self.spawn is not None else BACKOFF_MAX_S
                        self.state = "unavailable"
                    else:
                        delay, self.state = backoff, ("restarting" if started else "starting")
                        backoff = min(backoff * 2, BACKOFF_MAX_S)
                    self._retry_at = time.monotonic() + delay
                    self._notify()
                    log.warning(
                        "%s failed: %s; restarting in %.1fs (restart #%d)",
                        self.name,
                        self.last_error,
                        delay,
                        self.restarts + 1,
                    )
                    await trio.sleep(delay)
                    self.restarts += 1
            relays.cancel_scope.deadline = trio.current_time() + 1.0  # the last lines, then stop reading
        self.state = "stopped"
        self._notify()
        self._remove_tmpdir()
        if failure is not None:
            raise failure
        if not started:
            task_status.started()

    async def _attempt(self, relays: trio.Nursery, on_ready) -> tuple[float | None, int | None, bool]:
        """One start: spawn (or connect), serve until the link or the process ends, stop what is left.

        Returns ``(time.monotonic() of Ready or None, exit status of the spawned process or None, whether
        the handshake failed authentication)``; sets ``last_error``. Never raises but ``Cancelled``."""
        ready_at: float | None = None
        proc: BackendProcess | None = None
        reason: str | None = None
        refused = False
        try:
            async with trio.open_nursery() as nursery:
                credentials = self.credentials
                if self.spawn is not None:
                    proc, credentials = self._start_process()
                    self._proc = proc
                    self.pid = proc.pid
                    relays.start_soon(proc.relay_stderr)
                    nursery.start_soon(self._watch_process, proc, nursery.cancel_scope)
                client = await self._connect(credentials)
                ready_at = time.monotonic()
                self.client = client
                self.state = "ready"
                self.ready_event.set()
                self._notify()
                log.info("%s ready at %s (pid %s): %s", self.name, self.url, self.pid, client.card.name)
                on_ready()
                await client.run()
                reason = client.closed_reason
                nursery.cancel_scope.cancel()
        except Exception as exc:  # noqa: BLE001 - OSError, TooSlowError, ProtocolError...: the supervisor survives
            while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]  # the nursery's wrapping of the one failure
            refused = isinstance(exc, AuthenticationFailed)
            reason = f"authentication failed: {exc}" if refused else f"{type(exc).__name__}: {exc}"
        finally:
            if self.client is not None:
                self.client.close_all()
            self.client = None
            self.ready_event = trio.Event()
            self._notify()
            with trio.CancelScope(shield=True):
                await self._reap()
                if proc is not None:
                    with trio.move_on_after(1.0):  # the load-error line may still be in the pipe
                        await proc.stderr_closed.wait()
        if proc is None:
            self.last_error = reason or "backend connection closed"
            rc = None
        else:
            rc = proc.returncode
            exit_text = proc.describe_exit()
            self.last_error = exit_text if proc.load_error or not reason else f"{reason}; {exit_text}"
        if refused:
            log.error("%s: %s", self.name, reason)
        return ready_at, rc, refused

    def _remove_tmpdir(self) -> None:
        """Remove the spawned backend's socket folder (ours; the backend removes only its socket)."""
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _start_process(self) -> tuple[BackendProcess, LinkCredentials]:
        """Spawn the backend; returns it and the credentials of its link (a fresh secret over TCP)."""
        spec = self.spawn
        assert spec is not None
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}  # ours is for external backends
        credentials = LinkCredentials()
        if spec.host is not None:
            with socket.socket(socket.AF_INET6 if ":" in spec.host else socket.AF_INET) as probe:
                probe.bind((spec.host, 0))  # a free port now (another process may take it before the backend)
                port = probe.getsockname()[1]
            self.url = f"tcp://{spec.host}:{port}"
            env[SECRET_ENV] = secret = secrets.token_hex(32)
            credentials = LinkCredentials(secret=secret.encode())
        elif os.path.exists(self.url[5:]):
            os.unlink(self.url[5:])
        cmd = [spec.python, "-m", "backend", "--model", spec.model, "--listen", self.url, *spec.extra_args]
        log.info("starting backend: %s", " ".join(cmd))
        return BackendProcess.spawn(cmd, env=env), credentials

    async def _watch_process(self, proc: BackendProcess, scope: trio.CancelScope) -> None:
        await proc.wait()
        scope.cancel()

    async def _connect(self, credentials: LinkCredentials) -> BackendClient:
        """Connect and handshake. A spawned backend is retried every <= 0.5 s until its startup timeout; an
        external one, at its first start, with capped exponential backoff for ``REMOTE_CONNECT_S``, and after
        it once (the run loop backs off between attempts)."""
        spawned = self.spawn is not None
        timeout = self.spawn.startup_timeout if self.spawn else REMOTE_CONNECT_S
        deadline = trio.current_time() + timeout
        delay = CONNECT_RETRY_MIN_S
        while True:
            try:
                return await BackendClient.connect(
                    self.url,
                    timeout=max(1.0, min(30.0, deadline - trio.current_time())),
                    request_buffer=self.request_buffer,
                    credentials=credentials,
                )
            except OSError as exc:
                if not spawned and self._started:
                    raise
                if trio.current_time() >= deadline:
                    raise trio.TooSlowError(
                        f"backend at {self.url} not reachable after {timeout:.0f}s: {exc}"
                    ) from None
                await trio.sleep(delay)
                delay = min(delay * 2, 0.5 if spawned else BACKOFF_MAX_S)

    async def _reap(self, grace: float = 10.0) -> None:
        """Make sure the spawned process is gone: while stopping, give it ``grace`` seconds to act on
        ``Shutdown``; else (its link ended, or we were cancelled) SIGTERM it at once; SIGKILL after 3 s."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if self._stopping and proc.returncode is None:
            with trio.move_on_after(grace):
                await proc.wait()
        if proc.returncode is None:
            proc.terminate()
            with trio.move_on_after(3):
                await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def stop(self, grace: float = 10.0) -> None:
        """Send a spawned backend ``Shutdown`` (SIGTERM to one still loading), wait up to ``grace`` seconds
        for the process to exit, then end ``run()``. A backend reached by URL was not started here and may
        serve other gateways: it only loses this link (it aborts the requests this gateway sent)."""
        self._stopping = True
        self.state = "stopped"
        self._notify()
        c = self.client
        proc = self._proc
        if c is not None and c.alive and self.spawn is not None:
            c.shutdown()
        elif proc is not None:
            proc.terminate()
        if proc is not None:
            with trio.move_on_after(grace):
                await proc.wait()
        if self._cancel is not None:
            self._cancel.cancel()
