"""``BackendProcess``: one spawned ``python -m backend`` child, its exit status and its stderr.

The child runs in a session of its own (its process group id is its pid: a terminal's Ctrl-C reaches only
the gateway, which drains, then stops the backend) with a parent-death signal, so that a SIGKILLed gateway
never leaves a backend behind (Linux ``prctl(PR_SET_PDEATHSIG)``). Signals go to the whole group (the backend
and anything it started, e.g. the compiler of its C++ kernels on first use), and only while the backend is
not reaped yet, so the group id cannot have been reused: once the backend has exited, what is left of its
group is SIGKILLed, then the backend is reaped (``os.waitid`` with ``WNOWAIT`` tells the exit apart from the
reaping).

stderr is a pipe that ``relay_stderr`` (a task of the supervisor's nursery) copies line by line to the
gateway's stderr, but for the backend's load-error line (``backend.protocol.LOAD_ERROR_PREFIX``: which model
file, and why it cannot be loaded), which is kept in ``load_error`` for the supervisor to report once.

Source followed: Linux ``prctl(2)``, ``waitid(2)``, ``killpg(2)``; ``backend/__main__.py`` for the exit
statuses.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import trio

from backend.protocol import EXIT_MODEL_LOAD_FAILED, LOAD_ERROR_PREFIX

MAX_LINE_BYTES = 64 * 1024  # a longer stderr line is relayed in pieces of this size


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM us when the gateway dies (prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001 - not Linux: best effort
        pass


class BackendProcess:
    """A spawned backend: ``pid``, an async ``wait()``, group signals, the relayed stderr.

    Attributes:
        pid: the child's pid (also its process group id).
        load_error: ``"cannot load model PATH: REASON"`` when the backend said so on stderr, else None.
        stderr_closed: set when the stderr pipe reached EOF (the backend and its children are gone) or
            the relay stopped.
    """

    def __init__(self, popen: subprocess.Popen, stderr_fd: int) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.load_error: str | None = None
        self.stderr_closed = trio.Event()
        self._stderr_fd: int | None = stderr_fd

    @classmethod
    def spawn(cls, cmd: list[str], env: dict[str, str] | None = None) -> BackendProcess:
        """Start ``cmd`` (stdin /dev/null, stdout inherited, stderr a pipe to ``relay_stderr``; ``env``: its
        environment, None: ours; a secret goes there, never on the command line).

        Must run in the Trio thread: PR_SET_PDEATHSIG fires when the *forking thread* exits, so a worker
        thread (what ``trio.lowlevel.open_process`` uses) would kill the backend when it is recycled.

        Raises:
            OSError: the interpreter cannot be started.
        """
        r, w = os.pipe()
        try:
            popen = subprocess.Popen(  # noqa: ASYNC220 - must fork in this thread (see above)
                cmd,
                stdin=subprocess.DEVNULL,
                stderr=w,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        return cls(popen, r)

    # ------------------------------------------------------------------ exit
    @property
    def returncode(self) -> int | None:
        """The exit status once reaped (negative: killed by that signal), else None."""
        return self.popen.returncode

    def _exited(self) -> bool:
        """True once the child has exited; it is left unreaped (a zombie) so that its pid stays ours."""
        if self.popen.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped elsewhere
            self.popen.poll()
            return True

    async def wait(self) -> int:
        """Wait for the exit (polls every 50 ms: a child exit sets no Trio event; the socket EOF is the fast
        signal), SIGKILL what is left of the process group, reap; returns the exit status."""
        while not self._exited():  # noqa: ASYNC110 - polling is the wait
            await trio.sleep(0.05)
        if self.popen.returncode is None:
            self._signal_group(signal.SIGKILL)  # the backend's own children must not outlive it
            self.popen.wait()  # already exited: does not block
        return self.popen.returncode

    def describe_exit(self) -> str:
        """``backend process exited with code 1`` / ``... was killed by SIGKILL`` / ``... is running``."""
        rc = self.popen.returncode
        if rc is None:
            return "backend process is running"
        if rc < 0:
            try:
                return f"backend process was killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"backend process was killed by signal {-rc}"
        if rc == EXIT_MODEL_LOAD_FAILED and self.load_error:
            return self.load_error
        return f"backend process exited with code {rc}"

    # ------------------------------------------------------------------ signals
    def _signal_group(self, sig: int) -> None:
        if self.popen.returncode is not None:  # reaped: the pid may belong to someone else now
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM the process group, then SIGCONT it (a stopped backend must wake to act on it)."""
        self._signal_group(signal.SIGTERM)
        self._signal_group(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the process group."""
        self._signal_group(signal.SIGKILL)

    # ------------------------------------------------------------------ stderr
    async def relay_stderr(self) -> None:
        """Copy the backend's stderr to ours line by line until EOF; keep the load-error line instead of
        copying it. Sets ``stderr_closed`` on the way out, whatever ends it."""
        fd, self._stderr_fd = self._stderr_fd, None
        if fd is None:
            self.stderr_closed.set()
            return
        buf = b""
        try:
            async with trio.lowlevel.FdStream(fd) as stream:
                while data := await stream.receive_some(65536):
                    buf += data
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        self._line(line)
                    while len(buf) > MAX_LINE_BYTES:
                        self._line(buf[:MAX_LINE_BYTES])
                        buf = buf[MAX_LINE_BYTES:]
                if buf:
                    self._line(buf)
        except OSError:
            pass
        finally:
            self.stderr_closed.set()

    def _line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        if text.startswith(LOAD_ERROR_PREFIX):
            self.load_error = text[len("error: ") :]
            return
        try:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # our stderr is closed: the line is lost, the backend goes on
            pass

    def close(self) -> None:
        """Close the stderr pipe if no relay ever took it (synchronous, idempotent)."""
        fd, self._stderr_fd = self._stderr_fd, None
        if fd is not None:
            os.close(fd)
            self.stderr_closed.set()
