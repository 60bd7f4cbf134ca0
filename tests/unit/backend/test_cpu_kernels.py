"""CPU-side tests of kernels_cupy and scripts/gpu_check (no GPU, no CuPy import)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels_cupy.attention import (
    CupyAttention,
    build_prefill_tiles,
    choose_partition_size,
    decode_smem_bytes,
)
from kernels_cupy.compile import KernelConfig

ROOT = Path(__file__).resolve().parents[3]


def test_importing_never_imports_cupy() -> None:
    code = (
        "import sys, kernels_cupy, kernels_cupy.attention, kernels_cupy.compile, backend.model_runner;"
        "from kernels_cupy.attention import CupyAttention; CupyAttention();"
        "assert 'cupy' not in sys.modules and 'cupy_backends' not in sys.modules, 'cupy imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_cpu_tensors_rejected_without_cupy() -> None:
    a = CupyAttention()
    x = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        a.write_kv(x, x, cache, cache, None)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        a.forward(x.float(), cache, cache, None, 0.125)
    with pytest.raises(ValueError):
        CupyAttention(dtype=torch.float32)


def test_kernel_config_validation() -> None:
    assert "-DGQA=3" in KernelConfig("float16", 64, 16, 3).defines()
    for bad in (
        ("float32", 64, 16, 1),
        ("float16", 96, 16, 1),
        ("float16", 64, 16, 9),
        ("float16", 64, 0, 1),
    ):
        with pytest.raises(ValueError):
            KernelConfig(*bad)


@pytest.mark.parametrize("bs", [1, 8, 16, 24, 32])
def test_partition_size(bs: int) -> None:
    for hkv in (1, 3, 8):
        for b in (1, 7, 64, 256):
            for L in (1, 100, 512, 2048, 8192):
                ps = choose_partition_size(hkv, b, L, bs)
                assert ps % bs == 0 and ps >= bs
                assert 64 <= ps or ps == bs * math.ceil(64 / bs) or bs > 64
                assert ps < 512 + bs
    assert choose_partition_size(8, 256, 2048, 16) == 512  # big batches keep vLLM's 512
    assert choose_partition_size(8, 1, 8192, 16) == 128  # small batches split finer


def test_decode_smem_fits_default_limit() -> None:
    for g in range(1, 9):
        for d in (64, 128):
            assert decode_smem_bytes(512, g, d, 16) <= 48 * 1024


def test_prefill_tiles_cover_each_row_once() -> None:
    qlens = [1, 1, 1, 5, 4, 9, 1, 130]
    nd = 3
    tiles = build_prefill_tiles(qlens, nd, rows=4)
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    rows = []
    for seq, r0 in zip(tiles[::2], tiles[1::2]):
        assert seq >= nd and starts[seq] <= r0 < starts[seq + 1]
        rows += list(range(r0, min(r0 + 4, starts[seq + 1])))
    assert sorted(rows) == list(range(starts[nd], starts[-1]))


def test_gpu_check_without_gpu_says_so() -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "no CUDA GPU" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_gpu_check_reference_matches_torch_ref() -> None:
    """The float64 reference of the GPU check agrees with TorchAttention on a ragged mixed batch (CPU, fp32)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    from backend.attention.torch_ref import TorchAttention

    gen = torch.Generator().manual_seed(7)
    seqs = [(0, 1), (15, 1), (600, 1), (0, 37), (100, 5), (40, 130)]
    meta, q, k, v, kc, vc = gpu_check.make_batch(seqs, 2, 3, 64, 16, torch.float32, "cpu", gen)
    assert meta.num_decodes == 3
    t = TorchAttention()
    t.write_kv(k, v, kc, vc, meta)
    out = t.forward(q, kc, vc, meta, 0.125)
    assert gpu_check.rel_err(out, gpu_check.ref_attention(q, kc, vc, meta, 0.125)) < 1e-5
