"""Process-level CPU tuning of the engine: glibc ``malloc`` keeps freed tensor memory; OpenMP threads sleep.

By default glibc serves every allocation above 128 KiB (growing to at most 32 MiB) with its own
``mmap`` and gives it back to the kernel with ``munmap`` on free. An engine step allocates and frees
the same few-MiB activations, gathered K/V and logits tensors every layer, so each step page-faults
fresh zeroed pages again. Measured on the 2-core CPU VM (bfloat16, 64 decode sequences): 455 ms per
step with 50 s of system time in a 74 s run; with the settings below 220 ms and 1.3 s.

``tune_glibc_malloc`` raises the mmap threshold to its maximum (32 MiB on 64-bit) and keeps up to
1 GiB of freed heap before trimming, through ``mallopt(3)`` at run time (the same knobs as the
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_`` environment variables,
which only apply to a process started with them).

``ThreadGovernor`` keeps torch's OpenMP threads from collapsing a step on a machine whose cores other
processes also use. libgomp's threads spin between parallel regions (its default wait policy); on free
cores that is the fast choice (no futex wake-up per region), but when another process holds a core the
spinning threads take the time slices the working thread needs. Measured on the 2-core VM, one stream with
two busy-loop processes beside it: float32 0.7 tok/s spinning on 2 threads (29 CPU-seconds for 64 tokens)
against 28.6 on free cores; ``OMP_WAIT_POLICY=PASSIVE`` does not collapse (13.3) but halves bf16 on free
cores (52-64 vs 116-131 tok/s); the governor (one thread while the stepping thread waits on a run queue,
all cores otherwise) kept bf16 at 116-130 tok/s on free cores and 43-47 beside the two busy loops.
``openmp_wait_policy`` sets ``OMP_WAIT_POLICY`` from ``--omp-wait-policy`` before torch loads.

Source followed: ``mallopt(3)`` (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD), ``malloc_trim(3)``; the GNU libgomp manual
(``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time
from collections.abc import Callable, MutableMapping

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024
TOP_PAD_BYTES = 64 * 1024 * 1024

_done = False

#: the environment variables through which an operator already chose how OpenMP threads wait
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_wait_policy(environ: MutableMapping[str, str], policy: str | None = None) -> str | None:
    """Set ``OMP_WAIT_POLICY`` in ``environ`` before torch loads; returns the value now in force (or None).

    ``policy`` (``"passive"`` or ``"active"``, the ``--omp-wait-policy`` flag) is set as given; None leaves
    ``environ`` as it is (libgomp's default, or what the operator put in ``OPENMP_WAIT_VARS``). No effect
    on an OpenMP runtime that is already loaded.
    """
    if policy is not None:
        environ["OMP_WAIT_POLICY"] = policy.upper()
    return environ.get("OMP_WAIT_POLICY")


def _glibc(name: str, argtypes: list) -> ctypes._CFuncPtr | None:
    """glibc's function ``name`` with its C signature (``int`` result), or None off Linux or without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


def tune_glibc_malloc() -> bool:
    """Apply the settings above once per process; returns True if glibc accepted them.

    A no-op (False) off Linux or under another C library; never raises.
    """
    global _done
    if _done:
        return True
    mallopt = _glibc("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    ok = all(
        mallopt(opt, val) == 1
        for opt, val in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            (M_TOP_PAD, TOP_PAD_BYTES),
        )
    )
    _done = ok
    return ok


def release_free_heap() -> bool:
    """Give the heap's free pages back to the kernel (``malloc_trim(3)`` with pad 0: the top of the heap and,
    through ``madvise(MADV_DONTNEED)``, free chunks inside it), once a model load has freed its float32
    staging copies, which the trim threshold above would otherwise keep resident. Returns whether memory
    was released; False off glibc; never raises."""
    trim = _glibc("malloc_trim", [ctypes.c_size_t])
    return trim is not None and trim(0) == 1


def main_thread_run_delay() -> float | None:
    """Seconds the calling thread has waited on a run queue so far (``/proc/thread-self/schedstat``, field 2);
    None where the kernel does not report it."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class ThreadGovernor:
    """Torch's intra-op thread count by contention, checked after every engine step (``tick``).

    All ``max_threads`` while the stepping thread gets the CPU it asks for; one thread once it spent more
    than ``contended`` of a ``window_s`` window waiting on a run queue (other processes hold the cores: a
    team of spinning OpenMP threads would then take the slices the working thread needs). After
    ``probe_s`` on one thread it tries ``max_threads`` again; a probe that finds the machine still busy
    doubles the wait (up to 60 s), one that finds it free resets it. ``set_threads`` is
    ``torch.set_num_threads``; ``run_delay`` and ``clock`` return seconds (injectable for tests).

    Source followed: the kernel's ``Documentation/scheduler/sched-stats.rst`` (schedstat: run_delay).
    """

    def __init__(
        self,
        set_threads: Callable[[int], None],
        max_threads: int,
        *,
        window_s: float = 0.5,
        contended: float = 0.25,
        probe_s: float = 5.0,
        run_delay: Callable[[], float | None] = main_thread_run_delay,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.set_threads, self.max_threads = set_threads, max_threads
        self.window_s, self.contended, self.probe_base = window_s, contended, probe_s
        self.probe_s = probe_s
        self.run_delay, self.clock = run_delay, clock
        self.threads = max_threads
        self.switches = 0
        self._t0, self._d0 = clock(), run_delay()
        self._since = self._t0  # when the current thread count was set
        self._probing = False  # all threads again after a wait on one: not yet known to hold

    def tick(self) -> None:
        """Look at the last window (if one has passed) and change the thread count if it calls for it."""
        now = self.clock()
        if now - self._t0 < self.window_s or self._d0 is None or self.max_threads <= 1:
            return
        d = self.run_delay()
        if d is None:
            return
        share = (d - self._d0) / (now - self._t0)
        self._t0, self._d0 = now, d
        if self.threads > 1 and share > self.contended:
            if self._probing:  # the probe failed
                self.probe_s = min(60.0, self.probe_s * 2)
            self._set(1, now)
        elif self.threads == 1 and now - self._since >= self.probe_s:
            self._set(self.max_threads, now)
            self._probing = True
        elif self._probing:  # a whole window on all threads without contention: the probe held
            self.probe_s, self._probing = self.probe_base, False

    def _set(self, n: int, now: float) -> None:
        self._probing = False
        self.set_threads(n)
        self.threads, self._since = n, now
        self.switches += 1
