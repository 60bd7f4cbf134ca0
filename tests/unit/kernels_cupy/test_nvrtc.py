"""NVRTC compile test of kernels_cupy (no GPU or driver needed): every kernel for sm_80 and sm_90.

Uses CuPy's NVRTC binding (``cupy_backends.cuda.libs.nvrtc``); skipped, with the reason, only when CuPy or the
NVRTC library cannot be loaded (``make test`` installs ``cupy-cuda13x`` and ``nvidia-cuda-nvrtc``).
"""

from __future__ import annotations

import re

import pytest

from kernels_cupy.compile import KERNEL_NAMES, KernelConfig, compile_options, source


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()  # loads libnvrtc
    except Exception as e:  # noqa: BLE001
        pytest.skip(
            f"CuPy NVRTC binding unavailable ({type(e).__name__}: {e}); install cupy-cuda13x + nvidia-cuda-nvrtc"
        )
    return nvrtc


# every specialisation (dtype x head dim x group size) for sm_90 (the H200); every other one for sm_80 (each
# dtype, head dim and group size still appears there), to keep the CPU suite fast
CONFIGS = [
    KernelConfig(dt, hd, 16, g) for dt in ("float16", "bfloat16") for hd in (64, 128) for g in (1, 3, 8)
]
ARCH_CONFIGS = {"sm_90": CONFIGS, "sm_80": CONFIGS[::2]}


def _compile(nvrtc, cfg: KernelConfig, arch: str) -> tuple[bytes, str]:
    prog = nvrtc.createProgram(source(), "paged_attention.cu", [], [])
    try:
        opts = [*compile_options(cfg), f"--gpu-architecture={arch}", "--ptxas-options=-v"]
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            pytest.fail(f"NVRTC failed for {cfg} {arch}: {e}\n{nvrtc.getProgramLog(prog)}")
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_compiles(arch: str) -> None:
    nvrtc = _nvrtc()
    for cfg in ARCH_CONFIGS[arch]:
        cubin, log = _compile(nvrtc, cfg, arch)
        assert cubin[:4] == b"\x7fELF", f"{cfg} {arch}: not a CUBIN"
        for name in KERNEL_NAMES:
            assert name.encode() in cubin, f"{cfg} {arch}: kernel {name} missing"
        # the decode kernel must keep its per-lane arrays (q, K/V vectors, accumulators) in registers: a spilled
        # array costs hundreds of bytes of local memory; ptxas may spill a word or two in the epilogue
        m = re.search(
            rf"Compiling entry function 'paged_decode' for '{arch}'.*?(\d+) bytes stack frame", log, re.S
        )
        assert m is not None, log
        assert int(m.group(1)) <= 16, f"{cfg} {arch}: paged_decode uses local memory\n{log}"


def test_compile_helper_and_include_path() -> None:
    _nvrtc()
    from kernels_cupy.compile import cuda_include_dirs, nvrtc_compile

    assert nvrtc_compile(KernelConfig("bfloat16", 128, 16, 4), "sm_90")[:4] == b"\x7fELF"
    for d in cuda_include_dirs():
        assert d and __import__("os").path.isdir(d)
