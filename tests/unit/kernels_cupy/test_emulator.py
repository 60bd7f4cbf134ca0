"""The real CUDA source of kernels_cupy, run on the CPU emulator (kernels_cupy/emu.py) through CupyAttention's
launch plans: write_kv bit-exact (slots < 0 skipped), decode (one partition / many partitions + reduce),
prefill over cached blocks, mixed batches; fp16/bf16, head dims 64/128, 1/3/8 query heads per KV head,
shuffled block tables, block sizes 8/16/32, NaN-poisoned outputs. Needs only a C++20 compiler.
"""

from __future__ import annotations

import dataclasses
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402  (make_batch, ref_attention, rel_err)

sys.path.pop(0)

from kernels_cupy.emu import EmuAttention, usable_compiler  # noqa: E402

pytestmark = pytest.mark.skipif(
    usable_compiler() is None, reason="no C++20 compiler (<barrier>, _Float16) for the CUDA emulator"
)

CASES = [
    # dtype, head_dim, gqa, kv_heads, block_size, seqs (cached, new), tuning
    ("bfloat16", 64, 3, 2, 16, [(0, 1), (16, 1), (200, 1), (0, 5), (30, 40)], {}),
    ("float16", 128, 8, 1, 8, [(63, 1), (3, 1), (0, 70)], {}),
    (
        "bfloat16",
        128,
        1,
        3,
        32,
        [(150, 1), (1, 1), (40, 1)],
        {"decode_warps": 8, "k_unroll": 1, "v_unroll": 2},
    ),
    ("float16", 64, 1, 2, 16, [(10, 1), (62, 1), (5, 1)], {}),  # one partition: direct write
    ("bfloat16", 128, 3, 1, 16, [(0, 9), (100, 33)], {"decode_warps": 2}),  # prefill only
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-D{c[1]}-G{c[2]}-bs{c[4]}")
def test_kernels_on_emulator(case) -> None:
    dn, D, G, Hkv, bs, seqs, tuning = case
    dtype = getattr(torch, dn)
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    meta, q, k, v, kc, vc = gpu_check.make_batch(seqs, Hkv, G, D, bs, dtype, "cpu", gen)
    attn = EmuAttention()
    attn.poison_scratch = True
    attn.tuning = tuning

    # write_kv with some rows skipped (slot -1): bit-exact against index assignment
    skip = torch.zeros(q.shape[0], dtype=torch.bool)
    skip[::3] = True
    meta_skip = dataclasses.replace(meta, slot_mapping=torch.where(skip, -1, meta.slot_mapping))
    kc2, vc2 = kc.clone(), vc.clone()
    attn.write_kv(k, v, kc2, vc2, meta_skip)
    ek, ev = kc.clone(), vc.clone()
    ek.view(-1, Hkv, D)[meta.slot_mapping[~skip]] = k[~skip]
    ev.view(-1, Hkv, D)[meta.slot_mapping[~skip]] = v[~skip]
    assert torch.equal(ek, kc2) and torch.equal(ev, vc2)

    attn.clear_cache()
    attn.write_kv(k, v, kc, vc, meta)
    # a non-contiguous query (a view into a fused qkv-like buffer) must work without a copy
    big = torch.randn(q.shape[0], q.shape[1] + 2, D, generator=gen).to(dtype)
    big[:, : q.shape[1]] = q
    qv = big[:, : q.shape[1]]
    out = torch.full_like(q, float("nan"))
    attn.forward(qv, kc, vc, meta, D**-0.5, out=out)
    ref = gpu_check.ref_attention(q, kc, vc, meta, D**-0.5)
    assert bool(out.isfinite().all()), "unwritten output elements"
    tol = 4e-3 if dn == "bfloat16" else 1e-3
    assert gpu_check.rel_err(out, ref) < tol
