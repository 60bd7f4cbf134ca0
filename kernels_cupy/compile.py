"""Run-time compilation of the CUDA sources in this package (NVRTC through CuPy), with caching.

Nothing here imports CuPy at module import: ``cupy`` is imported inside the functions that need it,
so the CPU-only test suite can import ``kernels_cupy`` freely.

One compiled module per configuration ``KernelConfig(dtype, head_dim, block_size, gqa)``: the .cu
source is specialised with ``-D`` macros (compile-time head size, block size and group size let the
kernels keep their per-lane arrays in registers). Modules are cached in-process (``get_module``) and
on disk by CuPy's own kernel cache (``~/.cupy/kernel_cache``, ``CUPY_CACHE_DIR``).

The source includes no headers (16-bit conversions are PTX ``cvt``), so NVRTC needs no include path;
``cuda_include_dirs`` still finds one (nvidia pip packages, ``$CUDA_PATH``, ``/usr/local/cuda``) and
passes it, so that a future ``#include`` keeps compiling.
"""

from __future__ import annotations

import functools
import glob
import os
import sys
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
ATTENTION_SOURCE = SOURCE_DIR / "paged_attention.cu"
KERNEL_NAMES = ("write_kv", "paged_decode", "paged_decode_reduce", "paged_prefill")
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_GQA = 8

# Constants mirrored from the .cu source (host-side launch geometry).
PREFILL_WARPS = 4  # query rows per prefill CTA
PREFILL_THREADS = PREFILL_WARPS * 32
WRITE_KV_THREADS = 128


@dataclass(frozen=True)
class KernelConfig:
    """One specialisation of the kernels.

    Attributes:
        dtype: ``"float16"`` or ``"bfloat16"`` (storage of q/k/v/out and the cache; fp32 accumulation).
        head_dim: elements per head, 64 or 128.
        block_size: tokens per KV-cache block (>= 1).
        gqa: query heads per KV head, 1..8.
        decode_warps / k_unroll / v_unroll: decode-kernel tuning (warps per CTA: 2, 4 or 8; K and V rows
            in flight per lane). Defaults are the measured choice (docs/perf-gpu.md).
    """

    dtype: str
    head_dim: int
    block_size: int
    gqa: int
    decode_warps: int = 4
    k_unroll: int = 4
    v_unroll: int = 8

    def __post_init__(self) -> None:
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"unsupported dtype {self.dtype!r} (float16 or bfloat16)")
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"unsupported head_dim {self.head_dim} (one of {SUPPORTED_HEAD_DIMS})")
        if not 1 <= self.gqa <= MAX_GQA:
            raise ValueError(f"unsupported query heads per KV head {self.gqa} (1..{MAX_GQA})")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.decode_warps not in (2, 4, 8) or not 1 <= self.k_unroll <= 8 or not 1 <= self.v_unroll <= 16:
            raise ValueError(f"bad decode tuning {self.decode_warps}/{self.k_unroll}/{self.v_unroll}")

    def defines(self) -> list[str]:
        return [
            f"-DKV_BF16={1 if self.dtype == 'bfloat16' else 0}",
            f"-DHEAD_DIM={self.head_dim}",
            f"-DBLOCK_SIZE={self.block_size}",
            f"-DGQA={self.gqa}",
            f"-DDECODE_WARPS={self.decode_warps}",
            f"-DK_UNROLL={self.k_unroll}",
            f"-DV_UNROLL={self.v_unroll}",
        ]


def source() -> str:
    """The CUDA C source of the attention kernels (``paged_attention.cu``)."""
    return ATTENTION_SOURCE.read_text()


def cuda_include_dirs() -> list[str]:
    """Directories holding ``cuda_runtime.h``/``cuda_fp16.h``: nvidia pip packages, $CUDA_PATH, /usr/local/cuda.

    Returns the existing ones, best first (may be empty: the kernels need no headers).
    """
    cands: list[str] = []
    for p in sys.path:
        if not p:
            continue
        for pat in ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cuda_nvrtc/include"):
            cands.extend(sorted(glob.glob(os.path.join(p, pat))))
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "include"))
    cands += ["/usr/local/cuda/include", "/opt/cuda/include"]
    out: list[str] = []
    for c in cands:
        if os.path.isdir(c) and c not in out:
            out.append(c)
    return out


def compile_options(cfg: KernelConfig) -> tuple[str, ...]:
    """NVRTC options for ``cfg`` (no ``-arch``: CuPy adds the device's; the CI test adds its own)."""
    opts = ["-std=c++17", "--restrict", *cfg.defines()]
    opts += [f"-I{d}" for d in cuda_include_dirs()[:1]]
    return tuple(opts)


def nvrtc_compile(cfg: KernelConfig, arch: str) -> bytes:
    """Compile the source for ``arch`` (e.g. ``"sm_90"``) with CuPy's NVRTC binding; no GPU/driver needed.

    Returns:
        The CUBIN bytes.

    Raises:
        RuntimeError: compilation failed (the NVRTC log is in the message).
        ImportError: CuPy / NVRTC unavailable.
    """
    from cupy_backends.cuda.libs import nvrtc  # lazy: CuPy is optional

    prog = nvrtc.createProgram(source(), "paged_attention.cu", [], [])
    try:
        opts = [*compile_options(cfg), f"--gpu-architecture={arch}"]
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed for {cfg} {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from e
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


@functools.cache
def get_module(cfg: KernelConfig):
    """The ``cupy.RawModule`` for ``cfg``, compiled for the current device (cached in-process and on disk)."""
    import cupy  # lazy

    return cupy.RawModule(code=source(), options=compile_options(cfg), name_expressions=None)


@functools.cache
def get_function(cfg: KernelConfig, name: str):
    """A ``cupy.RawKernel`` (``name`` in ``KERNEL_NAMES``) of the module for ``cfg``."""
    if name not in KERNEL_NAMES:
        raise KeyError(name)
    return get_module(cfg).get_function(name)
