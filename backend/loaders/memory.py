"""The memory budget of a model load: what the weights will take, checked before any tensor is dequantized.

The loaders hand the model its tensors lazily (``LazyTensors``): each is dequantized to float32 when the
model takes it and dropped once its compute-dtype copy is made, so the float32 staging copy of the whole
model never exists at once. The estimate, an upper bound of the peak:

* ``elem * P`` bytes: the compute-dtype copy of all ``P`` parameters (2 for bfloat16/float16, 4 for
  float32), when the model lives in host memory (``device == "cpu"``);
* ``4 * P_kept``: the float32 embedding (and untied LM head), kept while the model is built;
* ``4 * P_largest``: the float32 staging of the largest layer tensor (one at a time);
* ``2 * P4`` bytes for the ``P4`` parameters of 4-bit matrices kept for the int4 path (uint8 codes and
  group scales while loading, the packed int4 copy after);
* ``(elem + 5) * P_head`` bytes for the LM head's ``P_head`` parameters (the embedding when tied): its
  compute copy beside the embedding's, its per-row int8 copy and the float32 temporary it is made from;
* the file's bytes (its pages are mapped and read while loading, and count in the process's memory);
* the KV pool's bytes (host memory only).

Measured against it (``ru_maxrss`` growth of ``ModelRunner``, bfloat16 on CPU, 512 MiB KV): the default
SmolLM2-135M Q4_1 file 0.95 GiB (estimate 1.33 GiB; 1.21 GiB before the lazy loading); a
Qwen2.5-0.5B-shaped Q4_0 file (4.94e8 parameters, vocab 151936, tied) 3.53 GiB (estimate 4.01 GiB; 4.40
GiB before). For a Qwen2.5-1.5B (1.54e9 parameters, tied) the estimate is 9.6 GiB in the default mode with
every matrix 4-bit (a 0.6 byte-per-parameter file), 8.7 GiB from a 16-bit file, 12.0 GiB in float32: all
under 24 GiB.

The budget is ``$GATEWAY_MEMORY_BUDGET`` (bytes, or with a ``KiB``/``MiB``/``GiB`` suffix) when set, else the
memory available now (``MemAvailable`` of ``/proc/meminfo``, capped by a cgroup v2 ``memory.max``) minus a
margin of ``max(1 GiB, 10 %)``.

Errors: ``MemoryBudget.check`` raises ``ValueError`` with one line naming the size and the budget; the
backend turns it into its one-line load error (exit status 3, ``backend.protocol.load_error_line``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, MutableMapping
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


@dataclass(frozen=True)
class LoadSize:
    """What a load holds, counted from the tensor shapes before anything is read (parameters unless said).

    Attributes:
        params: all parameters.
        q4_params: those of 4-bit matrices kept for the int4 path too.
        head_params: the LM head's (the embedding's when tied).
        kept: those kept in float32 while the model is built (the embedding and an untied head).
        largest: the largest layer tensor's.
        file_bytes: the model files' size, bytes.
    """

    params: int
    q4_params: int = 0
    head_params: int = 0
    kept: int = 0
    largest: int = 0
    file_bytes: int = 0


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

    def need(self, size: LoadSize) -> int:
        """Estimated peak bytes of a load of ``size`` (see the module docstring)."""
        c = self.compute_bytes
        return (
            c * size.params
            + 2 * size.q4_params
            + (c + 5) * size.head_params
            + 4 * (size.kept + size.largest)
            + size.file_bytes
            + self.extra_bytes
        )

    def check(self, size: LoadSize) -> None:
        """Raise if the estimate is over the budget.

        Raises:
            ValueError: one line, e.g. ``model needs 13.9 GiB to load (1.54e9 parameters: bfloat16 + float32
                while loading + int4 codes + LM head copies, KV cache 0.5 GiB), over the memory budget of 8.0
                GiB (available RAM 9.0 GiB minus a 1.0 GiB margin; pass --memory-budget BYTES or set $GATEWAY_MEMORY_BUDGET to change
                it)``.
        """
        need = self.need(size)
        if need <= self.limit:
            return
        parts = (f"{self.dtype} + " if self.compute_bytes else "") + "float32 while loading"
        if size.q4_params:
            parts += " + int4 codes"
        if size.head_params:
            parts += " + LM head copies"
        if self.extra_bytes:
            parts += f", KV cache {_gib(self.extra_bytes)}"
        raise ValueError(
            f"model needs {_gib(need)} to load ({size.params:.3g} parameters: {parts}), over the memory budget "
            f"of {_gib(self.limit)} ({self.source}; pass --memory-budget BYTES or set ${BUDGET_ENV} to change it)"
        )


class _Group:
    """The tensors one file entry gives (phi3's fused matrices give several), made together once."""

    __slots__ = ("make", "targets", "done")

    def __init__(self, make: Callable[[], dict[str, dict]], targets: dict[str, LazyTensors]) -> None:
        self.make, self.targets, self.done = make, targets, False

    def run(self) -> None:
        if self.done:
            return
        self.done = True
        for kind, made in self.make().items():
            target = self.targets.get(kind)
            for name, value in made.items() if target is not None else ():
                if target._pending.pop(name, None) is not None:
                    target._done[name] = value


class LazyTensors(MutableMapping):
    """A ``dict`` of tensors whose values are made (read, dequantized) when first read: a model is built
    from it one layer at a time (``LlamaModel`` pops each tensor), so the float32 staging copy of the whole
    model never exists at once.

    ``defer(shapes, make, kind, targets)`` registers names whose values ``make()`` gives together;
    ``shape(name)`` answers without making anything. Reading a name makes its group; ``pop`` drops it.
    """

    def __init__(self) -> None:
        self._done: dict[str, object] = {}
        self._pending: dict[str, tuple[tuple[int, ...], _Group]] = {}

    @staticmethod
    def defer(make: Callable[[], dict[str, dict]], parts: dict[str, tuple[LazyTensors, dict]]) -> None:
        """Register one group: ``parts`` maps a kind (e.g. ``"w"``, ``"q4"``) to ``(target, {name: shape})``;
        ``make()`` returns ``{kind: {name: value}}`` for every name registered."""
        group = _Group(make, {kind: target for kind, (target, _) in parts.items()})
        for target, shapes in parts.values():
            for name, shape in shapes.items():
                target._pending[name] = (tuple(shape), group)

    def shape(self, name: str) -> tuple[int, ...]:
        """The value's shape, made or not.

        Raises:
            KeyError: no such name.
        """
        if name in self._done:
            return tuple(self._done[name].shape)
        return self._pending[name][0]

    def __getitem__(self, name: str):
        if name not in self._done:
            self._pending[name][1].run()
        return self._done[name]

    def __setitem__(self, name: str, value) -> None:
        self._pending.pop(name, None)
        self._done[name] = value

    def __delitem__(self, name: str) -> None:
        if self._done.pop(name, None) is None:
            del self._pending[name]

    def __contains__(self, name: object) -> bool:
        return name in self._done or name in self._pending

    def __iter__(self) -> Iterator[str]:
        return iter([*self._done, *self._pending])

    def __len__(self) -> int:
        return len(self._done) + len(self._pending)
