"""The torch reference attention: its bf16 CPU paths (block-diagonal decode, tiled prefill) and its
float32 paths against a dense float32 attention written out from the definition."""

from __future__ import annotations

import math
import random

import pytest
import torch

from backend.attention.base import AttentionMetadata
from backend.attention.torch_ref import TorchAttention

NKV, G, HD, BS = 3, 3, 64, 16


def dense_reference(q_rows, ks, vs, n_new, scale):
    """Plain causal attention of one sequence: ``q [n, nh, hd]``, ``k/v [S, nkv, hd]`` float32."""
    S = ks.shape[0]
    k = ks.repeat_interleave(G, dim=1)  # [S, nh, hd]
    v = vs.repeat_interleave(G, dim=1)
    s = torch.einsum("qhd,khd->hqk", q_rows, k) * scale
    qpos = torch.arange(S - n_new, S)[:, None]
    s = s.masked_fill(torch.arange(S)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def build(seqs, num_blocks, rng):
    """``seqs``: list of (cached, new) token counts, decodes (new == 1) first. Returns meta + tables."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    slots, qsl, seq_lens, qlens, tables = [], [0], [], [], []
    nd = 0
    for cached, new in seqs:
        S = cached + new
        bt = [free.pop() for _ in range(-(-S // BS))]
        tables.append(bt)
        slots += [bt[p // BS] * BS + p % BS for p in range(cached, S)]
        qsl.append(qsl[-1] + new)
        seq_lens.append(S)
        qlens.append(new)
        if new == 1 and nd == len(seq_lens) - 1:
            nd += 1
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=nd, max_query_len=max(qlens), max_seq_len=max(seq_lens), block_size=BS,
        seq_lens_cpu=seq_lens, query_lens_cpu=qlens,
    )
    return meta, tables


BATCHES = {
    # 3 decodes (bf16: block-diagonal path) + prefill chunks with cached prefixes, one longer than a tile
    "mixed": [(37, 1), (200, 1), (15, 1), (0, 300), (130, 70), (16, 5)],
    # 1-2 decodes (bf16: float32 SDPA path), alone and with a chunk
    "one_decode": [(150, 1)],
    "two_decodes_and_chunk": [(31, 1), (64, 1), (40, 9)],
}


@pytest.fixture(scope="module")
def cpu_kernel():
    """The compiled C++ decode kernel module (built once per machine; skipped where it cannot build)."""
    from backend import cpu_kernels

    mod = cpu_kernels.load()
    if mod is None:
        pytest.skip("C++ CPU decode kernel unavailable here")
    return mod


@pytest.mark.parametrize("kernel", ["torch", "cpp"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 4e-2)])
def test_batch_matches_dense_reference(dtype, tol, batch, kernel, request) -> None:
    """Every path of the torch reference (and the C++ decode kernel) against plain causal attention
    over the same (rounded) K/V."""
    rng = random.Random(0)
    torch.manual_seed(0)
    seqs = BATCHES[batch]
    num_blocks = 80
    meta, tables = build(seqs, num_blocks, rng)
    k_cache = torch.zeros(num_blocks, BS, NKV, HD)
    v_cache = torch.zeros(num_blocks, BS, NKV, HD)
    full_k = [torch.randn(c + n, NKV, HD) for c, n in seqs]
    full_v = [torch.randn(c + n, NKV, HD) for c, n in seqs]
    for (c, _), bt, k, v in zip(seqs, tables, full_k, full_v):  # the cached prefixes
        for p in range(c):
            k_cache[bt[p // BS], p % BS] = k[p]
            v_cache[bt[p // BS], p % BS] = v[p]
    T = sum(n for _, n in seqs)
    q = torch.randn(T, NKV * G, HD)
    new_k = torch.cat([k[c:] for (c, _), k in zip(seqs, full_k)])
    new_v = torch.cat([v[c:] for (c, _), v in zip(seqs, full_v)])
    attn = TorchAttention()
    if kernel == "cpp":
        attn._cpu_kernel = request.getfixturevalue("cpu_kernel")
    kc, vc = k_cache.to(dtype), v_cache.to(dtype)
    attn.write_kv(new_k.to(dtype), new_v.to(dtype), kc, vc, meta)
    scale = 1 / math.sqrt(HD)
    out = attn.forward(q.to(dtype), kc, vc, meta, scale).float()
    row = 0
    for (c, n), k, v in zip(seqs, full_k, full_v):
        want = dense_reference(q[row : row + n], k.to(dtype).float(), v.to(dtype).float(), n, scale)
        err = (out[row : row + n] - want).abs().max().item()
        assert err < tol, f"seq cached={c} new={n}: max abs err {err}"
        row += n


def test_cpu_kernel_rejects_bad_tables(cpu_kernel) -> None:
    """Lengths beyond the block table and block ids outside the pool are errors, not wild reads."""
    k = torch.zeros(4, BS, NKV, HD, dtype=torch.bfloat16)
    q = torch.zeros(1, NKV * G, HD)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="length"):
        cpu_kernel.paged_decode(q, k, k, bt, torch.tensor([2 * BS + 1], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="block id"):
        cpu_kernel.paged_decode(q, k, k, torch.tensor([[0, 9]], dtype=torch.int32),
                                torch.tensor([BS + 1], dtype=torch.int32), 0.125)
    out = cpu_kernel.paged_decode(q, k, k, bt, torch.tensor([BS + 1], dtype=torch.int32), 0.125)
    assert out.shape == (1, NKV * G, HD) and out.dtype == torch.bfloat16
