"""The memory budget of a model load: what the weights will take, checked before any tensor is dequantized.

The loaders stage every tensor in float32 (``gguf.quants.dequantize`` gives float32; safetensors tensors
are cast), then ``LlamaModel`` makes its compute-dtype copy layer by layer. The estimate is the sum of
both, an upper bound of the peak:

* ``4 * P`` bytes: the float32 staging copy of all ``P`` parameters;
* ``elem * P`` bytes: the compute-dtype copy (2 for bfloat16/float16, 4 for float32), when the model lives
  in host memory (``device == "cpu"``);
* ``2 * P4`` bytes for the ``P4`` parameters of 4-bit matrices kept for the int4 path (uint8 codes and
  group scales while loading, the packed int4 copy after);
* ``(elem + 5) * P_head`` bytes for the LM head's ``P_head`` parameters (the embedding when tied): its
  compute copy beside the embedding's, its per-row int8 copy and the float32 temporary that copy is made
  from;
* the KV pool's bytes (host memory only).

Measured against it (``ru_maxrss`` growth of the load, bfloat16 on CPU, 512 MiB KV): the default SmolLM2-135M
Q4_1 file 1.21 GiB (estimate 1.63 GiB); a Qwen2.5-0.5B-shaped Q4_0 file (4.94e8 parameters, vocab 151936,
tied) 4.40 GiB (estimate 5.07 GiB). For a Qwen2.5-1.5B (1.54e9 parameters, tied) the estimate is 13.5 GiB
in the default mode with every matrix 4-bit, 10.6 GiB from a 16-bit file, 14.0 GiB in float32: under 24 GiB.

The budget is ``$GATEWAY_MEMORY_BUDGET`` (bytes, or with a ``KiB``/``MiB``/``GiB`` suffix) when set, else the
memory available now (``MemAvailable`` of ``/proc/meminfo``, capped by a cgroup v2 ``memory.max``) minus a
margin of ``max(1 GiB, 10 %)``.

Errors: ``MemoryBudget.check`` raises ``ValueError`` with one line naming the size and the budget; the
backend turns it into its one-line load error (exit status 3, ``backend.protocol.load_error_line``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GiB = 1 << 30
BUDGET_ENV = "GATEWAY_MEMORY_BUDGET"
_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"123"``, ``"512MiB"``, ``"2GiB"``, ``"1.5G"`` -> bytes.

    Raises:
        ValueError: not a byte count.
    """
    low = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if low and low[-1] in _UNITS:
            return int(float(low[:-1]) * _UNITS[low[-1]])
        return int(low)
    except ValueError:
        raise ValueError(f"{BUDGET_ENV}={text!r} is not a byte count (e.g. 8GiB)") from None


def available_ram() -> int:
    """Bytes of host memory available now: ``MemAvailable`` (``/proc/meminfo``), capped by the cgroup v2
    limit minus its usage when one is set (``/sys/fs/cgroup/memory.max``, ``memory.current``)."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(avail, 0)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


@dataclass
class MemoryBudget:
    """How much host memory a model load may take.

    Attributes:
        limit: the budget in bytes.
        source: how it was set, for the error line (``"available RAM 9.0 GiB minus a 1.0 GiB margin"``).
        compute_bytes: bytes per parameter of the compute copy held in host memory (0 on an accelerator).
        extra_bytes: other host memory of the load (the KV pool), bytes.
        dtype: the compute dtype's name, for the error line.
    """

    limit: int
    source: str
    compute_bytes: int = 2
    extra_bytes: int = 0
    dtype: str = "bfloat16"

    @classmethod
    def for_load(cls, *, dtype: str, compute_bytes: int, extra_bytes: int) -> MemoryBudget:
        """The budget from ``$GATEWAY_MEMORY_BUDGET`` or the available RAM (see the module docstring).

        Raises:
            ValueError: ``$GATEWAY_MEMORY_BUDGET`` is not a byte count.
        """
        env = os.environ.get(BUDGET_ENV)
        if env:
            limit, source = parse_bytes(env), f"${BUDGET_ENV}"
        else:
            avail = available_ram()
            margin = max(GiB, avail // 10)
            limit, source = avail - margin, f"available RAM {_gib(avail)} minus a {_gib(margin)} margin"
        return cls(limit, source, compute_bytes, extra_bytes, dtype)

    def need(self, n_params: int, n_q4_params: int = 0, n_head_params: int = 0) -> int:
        """Estimated peak bytes of loading ``n_params`` parameters, ``n_q4_params`` of them kept as int4 too,
        with an LM head of ``n_head_params`` (see the module docstring)."""
        c = self.compute_bytes
        return 4 * n_params + c * n_params + 2 * n_q4_params + (c + 5) * n_head_params + self.extra_bytes

    def check(self, n_params: int, n_q4_params: int = 0, n_head_params: int = 0) -> None:
        """Raise if the estimate is over the budget.

        Raises:
            ValueError: one line, e.g. ``model needs 13.9 GiB to load (1.54e9 parameters: float32 while
                loading + bfloat16, KV cache 0.5 GiB), over the memory budget of 8.0 GiB
                (available RAM 9.0 GiB minus a 1.0 GiB margin; set $GATEWAY_MEMORY_BUDGET to change it)``.
        """
        need = self.need(n_params, n_q4_params, n_head_params)
        if need <= self.limit:
            return
        parts = "float32 while loading" + (f" + {self.dtype}" if self.compute_bytes else "")
        if n_q4_params:
            parts += " + int4 codes"
        if n_head_params:
            parts += " + LM head copies"
        if self.extra_bytes:
            parts += f", KV cache {_gib(self.extra_bytes)}"
        raise ValueError(
            f"model needs {_gib(need)} to load ({n_params:.3g} parameters: {parts}), over the memory budget "
            f"of {_gib(self.limit)} ({self.source}; set ${BUDGET_ENV} to change it)"
        )
