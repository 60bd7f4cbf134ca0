"""The x86 instruction set the CPU kernels run on, chosen once per process by ``LLM_GATEWAY_CPU_ISA``.

========== ==================================================== =====================================
setting    CPU flags needed (``/proc/cpuinfo``)                 what runs
========== ==================================================== =====================================
avx2       avx2 fma f16c bmi1 bmi2 movbe (x86-64-v3)            8-lane row kernels, ``q4_gemm`` with
                                                                VPMADDUBSW/VPMADDWD integer dots
avx512     + avx512f/bw/cd/dq/vl, avx512_vnni                   16-lane kernels, VPDPBUSD dots
avx512bf16 + avx512_bf16                                        the same, bf16 stores in one instruction;
                                                                bfloat16 is the default dtype
auto       (default) the last of the three that the CPU runs; none on a CPU without AVX2 (generic C++)
========== ==================================================== =====================================

``backend.cpu_kernels`` builds one extension per ISA (``make install`` builds every one the CPU runs, so an
AVX-512 machine tests the AVX2 kernels too) and loads the selected one. A named ISA (not ``auto``) also caps
ATen's and oneDNN's own dispatch to match (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, unless already
set), so a run forced to ``avx2`` on an AVX-512 machine computes as an AVX2 machine does: ``apply`` must run
before torch is imported (``python -m backend``, ``python -m gateway serve`` and the test suite's conftest
call it first). A setting the CPU cannot run is ``IsaError``: the programs print it as one line and exit 2,
never reaching an illegal instruction.

Source followed: the x86-64 micro-architecture levels (System V AMD64 psABI); PyTorch's
``ATEN_CPU_CAPABILITY`` and oneDNN's ``ONEDNN_MAX_CPU_ISA`` documentation.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from collections.abc import Mapping, MutableMapping

#: the setting's name
SETTING = "LLM_GATEWAY_CPU_ISA"

#: the ISAs the kernels are built for, least first
ISAS = ("avx2", "avx512", "avx512bf16")

_AVX2 = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}
#: the CPU flags each ISA needs
REQUIRED: dict[str, frozenset[str]] = {
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512bf16": _AVX512 | {"avx512_bf16"},
}

#: compiler flags of each ISA's build of ``backend/cpu_kernels.cpp``
CFLAGS: dict[str, list[str]] = {
    "avx2": ["-march=x86-64-v3"],
    "avx512": ["-march=x86-64-v4", "-mavx512vnni", "-mprefer-vector-width=512"],
    "avx512bf16": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mprefer-vector-width=512"],
}

#: what a named ISA caps torch's own kernels to: (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA)
TORCH_CAPS: dict[str, tuple[str, str]] = {
    "avx2": ("avx2", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE_VNNI"),
    "avx512bf16": ("avx512", "AVX512_CORE_BF16"),
}


class IsaError(ValueError):
    """``LLM_GATEWAY_CPU_ISA`` names no known ISA, or one this CPU cannot run; the message names the setting."""


@functools.cache
def cpu_flags_line() -> str:
    """The first ``flags`` line of ``/proc/cpuinfo`` after its colon, stripped ("" where there is none, e.g.
    not Linux); read once per process."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[-1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """``cpu_flags_line()`` as a set of flag names (empty off x86-64 Linux)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    return frozenset(cpu_flags_line().split())


def supported(flags: frozenset[str] | None = None) -> list[str]:
    """The ISAs of ``ISAS`` that a CPU with ``flags`` (default: this one) runs, least first."""
    have = cpu_flags() if flags is None else flags
    return [isa for isa in ISAS if REQUIRED[isa] <= have]


def selected(environ: Mapping[str, str] | None = None, flags: frozenset[str] | None = None) -> str | None:
    """The ISA the kernels run on: the setting's, or with ``auto`` (or unset) the best one the CPU runs
    (None: none of them, e.g. a CPU without AVX2 or not x86).

    Raises:
        IsaError: the setting is not one of ``auto``, ``ISAS``, or names an ISA the CPU lacks.
    """
    env = os.environ if environ is None else environ
    want = env.get(SETTING, "auto").strip().lower() or "auto"
    have = supported(flags)
    if want == "auto":
        return have[-1] if have else None
    if want not in ISAS:
        raise IsaError(f"{SETTING}={want}: unknown ISA (choose auto, {', '.join(ISAS)})")
    if want not in have:
        missing = sorted(REQUIRED[want] - (cpu_flags() if flags is None else flags))
        raise IsaError(
            f"{SETTING}={want}: this CPU lacks {' '.join(missing)} "
            f"(it runs: {', '.join(have) or 'none of ' + ', '.join(ISAS)})"
        )
    return want


def native_bf16(environ: Mapping[str, str] | None = None) -> bool:
    """True when the selected ISA multiplies bf16 natively (``avx512bf16``): bfloat16 is the CPU default there."""
    return selected(environ) == "avx512bf16"


def apply(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Validate the setting and, for a named ISA, cap ATen and oneDNN to it (``environ.setdefault``); returns
    ``selected()``. Call before torch is imported: both read their variable once, at first use.

    Raises:
        IsaError: as ``selected``.
    """
    env = os.environ if environ is None else environ
    isa = selected(env)
    if isa is not None and env.get(SETTING, "auto").strip().lower() not in ("", "auto"):
        aten, onednn = TORCH_CAPS[isa]
        env.setdefault("ATEN_CPU_CAPABILITY", aten)
        env.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
    return isa


def apply_or_exit(program: str) -> str | None:
    """``apply()`` for a program's start: an ``IsaError`` is one line on stderr (``program: error: ...``) and exit 2."""
    try:
        return apply()
    except IsaError as exc:
        print(f"{program}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
