"""CPU emulator for the CUDA kernels of this package (tests on machines without a GPU).

``EmuAttention`` is ``CupyAttention`` with the kernels of ``paged_attention.cu`` compiled as C++ by g++
against ``cuda_emu.h`` (one OS thread per CUDA thread, barriers for ``__syncthreads``/shuffles) and called
through ctypes on CPU tensors. The launch plans (grids, partition sizes, tiles, scratch buffers) are the
ones ``CupyAttention`` uses on the GPU, so this checks the host logic and the kernels' index arithmetic,
synchronisation structure and numerics. It proves nothing about timing, memory coalescing or races that
only show on real hardware. Slow: keep inputs small (hundreds of tokens).

Raises ``RuntimeError`` from ``build`` when no C++20 compiler is available.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from kernels_cupy.attention import CupyAttention
from kernels_cupy.compile import SOURCE_DIR, KernelConfig

_SOURCES = ("paged_attention.cu", "cuda_emu.h", "emu_launch.cpp")


def compiler() -> str | None:
    """The C++ compiler to use ($CXX, g++ or clang++), or None."""
    for c in (os.environ.get("CXX"), "g++", "clang++"):
        if c and shutil.which(c):
            return c
    return None


_PROBE = """#include <barrier>
#include <thread>
int main() { std::barrier<> b(1); b.arrive_and_wait(); _Float16 h = (_Float16)1.5f; return (float)h == 1.5f ? 0 : 1; }
"""


@functools.cache
def usable_compiler() -> str | None:
    """A compiler that builds the emulator's C++20 (``<barrier>``, ``_Float16``), or None (tests skip then)."""
    cxx = compiler()
    if cxx is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.cpp"
        src.write_text(_PROBE)
        r = subprocess.run(
            [cxx, "-std=c++20", "-pthread", str(src), "-o", str(Path(d) / "probe")], capture_output=True
        )
        return cxx if r.returncode == 0 else None


@functools.cache
def build(cfg: KernelConfig) -> ctypes.CDLL:
    """Compile (cached under the temp dir, keyed by source hash + config) and load the emulator library."""
    cxx = usable_compiler()
    if cxx is None:
        raise RuntimeError("no C++20 compiler (g++ >= 11 / clang++) for the CUDA emulator")
    h = hashlib.sha256()
    for n in _SOURCES:
        h.update((SOURCE_DIR / n).read_bytes())
    h.update(repr(cfg).encode())
    out_dir = Path(tempfile.gettempdir()) / "kernels_cupy_emu"
    out_dir.mkdir(exist_ok=True)
    lib = out_dir / f"emu_{h.hexdigest()[:16]}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [
            cxx,
            "-std=c++20",
            "-O1",
            "-shared",
            "-fPIC",
            "-pthread",
            *cfg.defines(),
            "-include",
            str(SOURCE_DIR / "cuda_emu.h"),
            str(SOURCE_DIR / "emu_launch.cpp"),
            "-o",
            str(tmp),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"emulator build failed: {' '.join(cmd)}\n{r.stderr[-4000:]}")
        os.replace(tmp, lib)
    return ctypes.CDLL(str(lib))


class _EmuKernel:
    """Callable like ``cupy.RawKernel``: ``kernel(grid, block, args, shared_mem=0)`` on CPU tensors."""

    def __init__(self, lib: ctypes.CDLL, name: str) -> None:
        self.fn = getattr(lib, f"emu_{name}")
        self.fn.restype = None
        self.name = name
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        g = tuple(grid) + (1,) * (3 - len(grid))
        conv = []
        for a in args:
            if isinstance(a, torch.Tensor):
                conv.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, np.int32):
                conv.append(ctypes.c_int(int(a)))
            elif isinstance(a, np.int64):
                conv.append(ctypes.c_longlong(int(a)))
            elif isinstance(a, np.float32):
                conv.append(ctypes.c_float(float(a)))
            else:
                raise TypeError(f"{self.name}: unsupported argument {type(a)}")
        self.fn(
            ctypes.c_uint(g[0]),
            ctypes.c_uint(g[1]),
            ctypes.c_uint(g[2]),
            ctypes.c_uint(block[0]),
            ctypes.c_longlong(shared_mem),
            *conv,
        )


class EmuAttention(CupyAttention):
    """``CupyAttention`` running the same kernel source on the CPU emulator (CPU fp16/bf16 tensors)."""

    name = "cupy-emu"

    def __init__(self, *args, num_sms: int = 132, **kw) -> None:
        super().__init__(*args, **kw)
        self.num_sms = num_sms

    def _fn(self, cfg: KernelConfig, name: str):
        return _EmuKernel(build(cfg), name)

    def _arg(self, t: torch.Tensor):
        return t

    def _launch_ctx(self, dev: torch.device):
        return contextlib.nullcontext()

    def _check_device(self, k_cache: torch.Tensor) -> None:
        if k_cache.device.type != "cpu":
            raise ValueError("EmuAttention runs on CPU tensors")

    def _sms(self, device: torch.device) -> int:
        return self.num_sms
