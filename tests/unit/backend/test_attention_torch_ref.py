"""The torch reference attention: its bf16 CPU paths (block-diagonal decode, tiled prefill) and its
float32 paths against a dense float32 attention written out from the definition."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from backend.attention.base import AttentionMetadata
from backend.attention.torch_ref import TorchAttention

NKV, G, HD, BS = 3, 3, 64, 16


def dense_reference(q_rows, ks, vs, n_new, scale):
    """Plain causal attention of one sequence: ``q [n, nh, hd]``, ``k/v [S, nkv, hd]`` float32."""
    S = ks.shape[0]
    g = q_rows.shape[1] // ks.shape[1]  # query head h reads KV head h // g
    k = ks.repeat_interleave(g, dim=1)  # [S, nh, hd]
    v = vs.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q_rows, k) * scale
    qpos = torch.arange(S - n_new, S)[:, None]
    s = s.masked_fill(torch.arange(S)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def build(seqs, num_blocks, rng, bs=BS):
    """``seqs``: list of (cached, new) token counts, decodes (new == 1) first. Returns meta + tables."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    slots, qsl, seq_lens, qlens, tables = [], [0], [], [], []
    nd = 0
    for cached, new in seqs:
        S = cached + new
        bt = [free.pop() for _ in range(-(-S // bs))]
        tables.append(bt)
        slots += [bt[p // bs] * bs + p % bs for p in range(cached, S)]
        qsl.append(qsl[-1] + new)
        seq_lens.append(S)
        qlens.append(new)
        if new == 1 and nd == len(seq_lens) - 1:
            nd += 1
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=nd,
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
        block_size=bs,
        seq_lens_cpu=seq_lens,
        query_lens_cpu=qlens,
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
        cpu_kernel.paged_decode(
            q,
            k,
            k,
            torch.tensor([[0, 9]], dtype=torch.int32),
            torch.tensor([BS + 1], dtype=torch.int32),
            0.125,
        )
    out = cpu_kernel.paged_decode(q, k, k, bt, torch.tensor([BS + 1], dtype=torch.int32), 0.125)
    assert out.shape == (1, NKV * G, HD) and out.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Head layouts, block sizes and lengths: the C++ kernel's AVX-512 (head_dim 64, G in {1, 3, 4}) and
# generic paths, and the torch paths (block-diagonal decode for nkv <= 4 and > 2 decodes, float32
# SDPA decode otherwise, tiled bf16 prefill).

#: (num_heads, num_kv_heads, head_dim): Llama-3.2-1B (G = 4), TinyLlama (G = 8), G = 1 at head_dim 64,
#: G = 2 at 32, G = 3 at 80, G = 4 at 128
CONFIGS = [(32, 8, 64), (32, 4, 64), (4, 4, 64), (8, 4, 32), (6, 2, 80), (8, 2, 128)]

#: cache dtype, query dtype, max abs error: the query is float32 over a bf16 cache in the model's fused
#: CPU path; a float16 cache (allowed on CPU) is not one the C++ kernel reads: the torch path serves it
MODES = {
    "fp32": (torch.float32, torch.float32, 2e-5),
    "bf16": (torch.bfloat16, torch.bfloat16, 4e-2),
    "bf16_q_fp32": (torch.bfloat16, torch.float32, 4e-2),
    "fp16": (torch.float16, torch.float16, 1e-2),
}


def batches_for(bs):
    """Five decodes (new == 1): 1 key, lengths ending mid-block, exactly one and two blocks; then prefill
    chunks (one over a cached prefix ending mid-block). And one decode (the <= 2-decode torch paths; the
    C++ kernel splits a sequence's KV heads over threads when there are few sequences) + a chunk."""
    return [
        [(0, 1), (bs + 2, 1), (2 * bs - 1, 1), (bs - 1, 1), (3 * bs + 4, 1), (0, 5), (bs + 3, bs + 2)],
        [(2 * bs - 1, 1), (3, bs + 1)],
    ]


def check_batch(seqs, nh, nkv, hd, bs, mode, attn, seed=0):
    """Writes each sequence's cached prefix, then runs ``write_kv`` + ``forward`` for the new tokens and
    compares every row against ``dense_reference`` over the same (rounded) K/V."""
    cache_dt, q_dt, tol = MODES[mode]
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // bs) for c, n in seqs) + 3
    meta, tables = build(seqs, num_blocks, rng, bs)
    full_k = [torch.randn(c + n, nkv, hd, generator=gen).to(cache_dt) for c, n in seqs]
    full_v = [torch.randn(c + n, nkv, hd, generator=gen).to(cache_dt) for c, n in seqs]
    if attn._cpu_kernel is not None and cache_dt != torch.float16:
        # NaN in every slot but the sequences' keys: any read outside them (another block, past the
        # length) shows up. The torch decode path gathers whole blocks and masks the padding, so it
        # gets stale-looking random values there instead.
        k_cache = torch.full((num_blocks, bs, nkv, hd), float("nan"), dtype=cache_dt)
        v_cache = k_cache.clone()
    else:
        k_cache = torch.randn(num_blocks, bs, nkv, hd, generator=gen).to(cache_dt)
        v_cache = torch.randn(num_blocks, bs, nkv, hd, generator=gen).to(cache_dt)
    for (c, _), bt, k, v in zip(seqs, tables, full_k, full_v):  # the cached prefixes
        slots = torch.tensor([bt[p // bs] * bs + p % bs for p in range(c)], dtype=torch.int64)
        k_cache.view(-1, nkv, hd)[slots] = k[:c]
        v_cache.view(-1, nkv, hd)[slots] = v[:c]
    T = sum(n for _, n in seqs)
    q = torch.randn(T, nh, hd, generator=gen)
    attn.write_kv(
        torch.cat([k[c:] for (c, _), k in zip(seqs, full_k)]),
        torch.cat([v[c:] for (c, _), v in zip(seqs, full_v)]),
        k_cache,
        v_cache,
        meta,
    )
    scale = hd**-0.5
    qin = q.to(q_dt)
    out = attn.forward(qin, k_cache, v_cache, meta, scale)
    assert out.shape == (T, nh, hd) and out.dtype == cache_dt
    row = 0
    for (c, n), k, v in zip(seqs, full_k, full_v):
        want = dense_reference(qin[row : row + n].float(), k.float(), v.float(), n, scale)
        err = (out[row : row + n].float() - want).abs().max().item()
        assert err < tol, f"seq cached={c} new={n}: max abs err {err}"
        row += n


def make_attn(kernel, request):
    attn = TorchAttention()
    if kernel == "cpp":
        attn._cpu_kernel = request.getfixturevalue("cpu_kernel")
    return attn


def layout_ids(configs):
    return [f"nh{a}-nkv{b}-hd{c}" for a, b, c in configs]


@pytest.mark.parametrize("kernel", ["torch", "cpp"])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16_q_fp32"])
@pytest.mark.parametrize("nh,nkv,hd", CONFIGS, ids=layout_ids(CONFIGS))
def test_head_layouts(nh, nkv, hd, mode, kernel, request) -> None:
    attn = make_attn(kernel, request)
    for i, seqs in enumerate(batches_for(16)):
        check_batch(seqs, nh, nkv, hd, 16, mode, attn, seed=i)


BS_CONFIGS = [CONFIGS[0], CONFIGS[1], CONFIGS[4]]


@pytest.mark.parametrize("kernel", ["torch", "cpp"])
@pytest.mark.parametrize("bs", [8, 32])
@pytest.mark.parametrize("nh,nkv,hd", BS_CONFIGS, ids=layout_ids(BS_CONFIGS))
def test_block_sizes(nh, nkv, hd, bs, kernel, request) -> None:
    attn = make_attn(kernel, request)
    for i, seqs in enumerate(batches_for(bs)):
        check_batch(seqs, nh, nkv, hd, bs, "bf16_q_fp32", attn, seed=i)


@pytest.mark.parametrize("kernel", ["torch", "cpp"])
def test_fp16_cache(kernel, request) -> None:
    """A float16 KV cache (``--dtype float16`` on CPU): with the C++ kernel loaded, decodes take the
    torch path (the kernel reads float32/bf16 only; it raised on every decode step before)."""
    attn = make_attn(kernel, request)
    for i, seqs in enumerate(batches_for(16)):
        check_batch(seqs, 32, 4, 64, 16, "fp16", attn, seed=i)


@pytest.mark.parametrize("kernel", ["torch", "cpp"])
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("nh,nkv,hd", CONFIGS[:2], ids=["nh32-nkv8-hd64", "nh32-nkv4-hd64"])
def test_long_context(nh, nkv, hd, mode, kernel, request) -> None:
    """Over 2,048 keys: three decodes (one ending mid-block) and a chunk over a long cached prefix."""
    seqs = [(2100, 1), (2047, 1), (2600, 1), (2200, 40)]
    check_batch(seqs, nh, nkv, hd, 16, mode, make_attn(kernel, request))


def test_cpu_kernel_rejects_empty_sequence_and_fp16(cpu_kernel) -> None:
    """A sequence of 0 keys and a float16 cache are errors of the kernel itself (``forward`` never sends them)."""
    k = torch.zeros(2, BS, NKV, HD)
    q = torch.zeros(1, NKV * G, HD)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="length"):
        cpu_kernel.paged_decode(q, k, k, bt, torch.tensor([0], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_kernel.paged_decode(q, k.half(), k.half(), bt, torch.tensor([3], dtype=torch.int32), 0.125)
    assert cpu_kernel.paged_decode(q[:0], k, k, bt, torch.tensor([3], dtype=torch.int32), 0.125).shape == (
        0,
        NKV * G,
        HD,
    )


def test_kernel_disabled_by_env_falls_back(monkeypatch) -> None:
    """``LLM_GATEWAY_CPU_KERNEL=0``: ``load()`` gives None and a kernel-asking ``TorchAttention`` uses torch."""
    from backend import cpu_kernels

    monkeypatch.setenv("LLM_GATEWAY_CPU_KERNEL", "0")
    monkeypatch.setattr(cpu_kernels, "_modules", {})
    monkeypatch.setattr(cpu_kernels, "_default", [])
    assert cpu_kernels.load() is None
    attn = TorchAttention(cpu_kernel=True)
    assert attn._cpu_kernel is None
    check_batch(batches_for(16)[0], 32, 8, 64, 16, "bf16", attn)


def test_load_waits_for_a_build_in_progress(monkeypatch) -> None:
    """A second thread calling ``load()`` during the first one's build gets the module, not None."""
    import threading
    import time

    from backend import cpu_kernels

    built = []
    started = threading.Event()

    def slow_build(isa: str):
        built.append(1)
        started.set()
        time.sleep(0.3)
        return "module"

    monkeypatch.setattr(cpu_kernels, "enabled", lambda: True)
    monkeypatch.setattr(cpu_kernels, "_build", slow_build)
    monkeypatch.setattr(cpu_kernels, "_modules", {})
    monkeypatch.setattr(cpu_kernels, "_default", [])
    got = []
    first = threading.Thread(target=lambda: got.append(cpu_kernels.load()))
    first.start()
    assert started.wait(10)
    got.append(cpu_kernels.load())  # the build is in progress in `first`
    first.join()
    assert got == ["module", "module"] and len(built) == 1


# ---------------------------------------------------------------------------------------------
# The fused element-wise ops of the llama layer against their torch formulas.

LOW = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2**-7, 1e-6)}  # (rtol, atol): one bf16 rounding


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
def test_add_rms_norm(cpu_kernel, delta_dtype, out_dtype) -> None:
    """``x += delta`` in place (exact float32 add), then ``F.rms_norm(x) * w`` rounded once to the output dtype."""
    gen = torch.Generator().manual_seed(1)
    T, H, eps = 5, 100, 1e-5
    x = torch.randn(T, H, generator=gen) * 3
    w = torch.randn(H, generator=gen)
    delta = None if delta_dtype is None else torch.randn(T, H, generator=gen).to(delta_dtype)
    want_x = x if delta is None else x + delta.float()
    want = F.rms_norm(want_x, (H,), w, eps).to(out_dtype)
    got = cpu_kernel.add_rms_norm(x, delta, w, eps, out_dtype == torch.bfloat16)
    assert torch.equal(x, want_x)
    assert got.dtype == out_dtype
    rtol, atol = LOW[out_dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(cpu_kernel, dtype) -> None:
    """``silu(gate) * up`` for ``gu = [gate | up]``, odd width, with very negative and large gates."""
    gen = torch.Generator().manual_seed(2)
    gu = (torch.randn(7, 2 * 37, generator=gen) * 4).to(dtype)
    gu[0, :4] = torch.tensor([-200.0, -90.0, 100.0, 0.0]).to(dtype)
    g, u = gu.float().chunk(2, dim=-1)
    want = (F.silu(g) * u).to(dtype)
    got = cpu_kernel.silu_mul(gu)
    assert got.dtype == dtype and got.shape == (7, 37)
    rtol, atol = LOW[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def hf_rope(x, cos, sin, rd):
    """HF llama rotate-half RoPE on the first ``rd`` dims of ``x [T, heads, hd]`` (the rest passed through)."""
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr.chunk(2, dim=-1)
    return torch.cat([xr * cos + torch.cat((-x2, x1), dim=-1) * sin, xp], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh,nkv,hd,rd", [(6, 2, 64, 64), (6, 2, 64, 32), (4, 4, 80, 80), (8, 2, 128, 64)])
def test_rope_write_kv(cpu_kernel, nh, nkv, hd, rd, dtype) -> None:
    """q and k rotated (HF rotate-half, float32), k and v written at their slots in the cache dtype; a
    negative slot writes nothing (its q is still returned); every other slot is left as it was."""
    gen = torch.Generator().manual_seed(3)
    bs, num_blocks, P = 8, 5, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    freqs = torch.arange(P, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()  # [P, rd]
    positions = torch.tensor([0, 5, 63, 17, 9])
    slots = torch.tensor([0, 13, -1, 39, -7])  # the first, a middle and the last slot; two skipped
    T = positions.numel()
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, generator=gen).to(dtype)
    sentinel = 7.0
    k_cache = torch.full((num_blocks, bs, nkv, hd), sentinel, dtype=dtype)
    v_cache = k_cache.clone()
    q = cpu_kernel.rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, nh, nkv)

    c, s = cos[positions][:, None], sin[positions][:, None]
    x = qkv.float()
    want_q = hf_rope(x[:, : nh * hd].view(T, nh, hd), c, s, rd)
    want_k = hf_rope(x[:, nh * hd : (nh + nkv) * hd].view(T, nkv, hd), c, s, rd).to(dtype)
    want_v = qkv[:, (nh + nkv) * hd :].view(T, nkv, hd)
    assert q.dtype == torch.float32 and q.shape == (T, nh, hd)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    kf, vf = k_cache.view(-1, nkv, hd), v_cache.view(-1, nkv, hd)
    rtol, atol = LOW[dtype]
    written = []
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(kf[slot].float(), want_k[t].float(), rtol=rtol, atol=1e-5)
            assert torch.equal(vf[slot], want_v[t])
            written.append(slot)
    rest = torch.ones(kf.shape[0], dtype=torch.bool)
    rest[written] = False
    assert bool((kf[rest] == sentinel).all()) and bool((vf[rest] == sentinel).all())


def test_rope_write_kv_rejects_bad_slots_and_positions(cpu_kernel) -> None:
    nh, nkv, hd = 2, 1, 64
    cache = torch.zeros(2, 8, nkv, hd)
    cos = torch.ones(4, hd)
    qkv = torch.zeros(1, (nh + 2 * nkv) * hd)
    with pytest.raises(RuntimeError, match="slot"):
        cpu_kernel.rope_write_kv(
            qkv, torch.tensor([0]), cos, cos, cache, cache.clone(), torch.tensor([16]), nh, nkv
        )
    with pytest.raises(RuntimeError, match="position"):
        cpu_kernel.rope_write_kv(
            qkv, torch.tensor([4]), cos, cos, cache, cache.clone(), torch.tensor([0]), nh, nkv
        )
    assert (cache == 0).all()
