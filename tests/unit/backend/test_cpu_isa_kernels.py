"""The C++ CPU kernels on every ISA this CPU runs (``backend.cpu_isa``: avx2, avx512, avx512bf16), each ISA's
build loaded side by side (``cpu_kernels.load(isa)``):

- ``q4_gemm`` and its row quantization give exactly the bits of an independent reference (numpy: exact integer
  dots, then the documented float32 sequence ``fma(isum, d_w*d_x, acc)``, ``fma(m_w, s_x, acc)`` per group,
  each fma rounded once), so every ISA gives the same bits as every other; the 8-bit LM head's dot does not
  saturate on inputs chosen to saturate a plain VPMADDUBSW (codes 255, activations +-127);
- every kernel's rows are bit-identical at row counts 1..16, 31-33, 63, 64 and permuted, on 1 and 2 threads;
- each kernel is within its bound of the torch float32 formula, and the kernels that call a vector ``expf``
  (SiLU, attention's softmax) are within that bound of each other across ISAs.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from backend import cpu_isa, cpu_kernels

ISAS = cpu_isa.supported()
ROW_COUNTS = (*range(1, 17), 31, 32, 33, 63, 64)
NROWS = 64

pytestmark = pytest.mark.skipif(not ISAS, reason="no AVX2 on this CPU: the generic build only")


@pytest.fixture(scope="module")
def mods() -> dict[str, object]:
    out = {isa: cpu_kernels.load(isa) for isa in ISAS}
    if any(m is None for m in out.values()):
        pytest.skip("the C++ kernels do not build here")
    return out


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that changes it."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def rows_invariant(fn, n: int = NROWS) -> torch.Tensor:
    """``fn(idx)`` computes rows ``idx`` (an int64 index tensor) together; asserts each row's bits equal that
    row computed alone, at every count of ``ROW_COUNTS`` and permuted, on 1 and 2 threads. Returns the rows."""
    torch.set_num_threads(1)
    alone = torch.cat([fn(torch.tensor([i])) for i in range(n)])
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(5))
    for t in (1, 2):
        torch.set_num_threads(t)
        for m in ROW_COUNTS:
            assert torch.equal(fn(torch.arange(m)), alone[:m]), (m, t)
        assert torch.equal(fn(perm), alone[perm]), t
    return alone


# ------------------------------------------------------------------------------------------------
# q4_gemm against an exact reference


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``a*b + c`` rounded once (round to nearest even), elementwise. The float64 product of two
    float32s is exact; the float64 sum can round, and that rounding matters only when it lands exactly on a
    float32 midpoint, where the exact sum (``Fraction``) decides."""
    a64, b64, c64 = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    a64, b64, c64 = np.broadcast_arrays(a64, b64, c64)
    s = a64 * b64 + c64
    out = s.astype(np.float32)
    mid = (s.view(np.uint64) & np.uint64((1 << 29) - 1)) == np.uint64(1 << 28)
    for i in zip(*np.nonzero(mid), strict=True):
        exact = Fraction(float(a64[i])) * Fraction(float(b64[i])) + Fraction(float(c64[i]))
        if exact == Fraction(float(s[i])):
            continue
        up = np.nextafter(np.float32(s[i]), np.float32(np.inf), dtype=np.float32)
        down = np.nextafter(np.float32(s[i]), np.float32(-np.inf), dtype=np.float32)
        lo, hi = (out[i], up) if out[i] < s[i] else (down, out[i])
        out[i] = hi if exact > Fraction(float(s[i])) else lo
    return out


def q8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-local Q8_1 of ``x [M, K] float32``: ``(q [M, K] int64, d [M, G] f32, s [M, G] f32)`` with IEEE
    float32 ``d = amax/127``, ``q = rne(x * (127/amax))``, ``s = d * sum(q)``."""
    m, k = x.shape
    g = x.reshape(m, k // 32, 32)
    amax = np.abs(g).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((g * inv[..., None]).astype(np.float32)).astype(np.int64)
    d = (amax / np.float32(127)).astype(np.float32)
    s = (d * q.sum(-1).astype(np.float32)).astype(np.float32)
    return q.reshape(m, k), d, s


def q4_reference(x: torch.Tensor, codes: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """``q4_gemm``'s float32 output for ``x [M, K]``, weight codes ``[N, K]`` (u8) and packed scales ``ws``."""
    xf = x.float().numpy()
    q, dx, sx = q8_reference(xf)
    n, k = codes.shape
    g = k // 32
    w = ws.numpy().reshape(n // 16, g, 2, 16).transpose(0, 3, 1, 2).reshape(n, g, 2)  # [N, G, (d_w, m_w)]
    c = codes.numpy().astype(np.int64).reshape(n, g, 32)
    isum = np.einsum("mgk,ngk->mng", q.reshape(-1, g, 32), c).astype(np.float32)  # exact: < 2^24
    acc = np.zeros((x.shape[0], n), np.float32)
    for j in range(g):
        dd = (w[None, :, j, 0] * dx[:, j, None]).astype(np.float32)
        acc = fma32(isum[:, :, j], dd, acc)
        acc = fma32(w[None, :, j, 1], sx[:, j, None], acc)
    return torch.from_numpy(acc)


N, K = 48, 320  # 3 column blocks, 10 groups


def packed(bits: int, seed: int = 0):
    """``(wq, ws, codes [N, K] u8)`` for random 4-bit groups or per-row int8 weights."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=gen)
        scale = torch.rand(N, K // 32, generator=gen) * 0.02 + 1e-3
        zero = torch.randn(N, K // 32, generator=gen) * 0.02
        return (*cpu_kernels.q4_pack(codes, scale, zero), codes)
    w8 = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen)
    s = (torch.rand(N, generator=gen) * 0.01 + 1e-3).bfloat16()
    return (*cpu_kernels.q8_pack(w8, s), (w8.to(torch.int16) + 128).to(torch.uint8))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q4_gemm_bits_are_the_reference_on_every_isa(mods, threads, isa, bits, dtype) -> None:
    mod = mods[isa]
    wq, ws, codes = packed(bits)
    x = (torch.randn(NROWS, K, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    x[3, :32] = 0  # an all-zero group: d_x = 0
    got = rows_invariant(lambda idx: mod.q4_gemm(x[idx].contiguous(), wq, ws, N, bits))
    ref = q4_reference(x, codes, ws)
    assert got.dtype == dtype
    assert torch.equal(got, ref.to(dtype)), (got.float() - ref).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_quantization_is_the_same_on_every_isa(mods, dtype) -> None:
    x = (torch.randn(9, K, generator=torch.Generator().manual_seed(4)) * 5).to(dtype)
    x[0, 32:64] = 0
    q, d, s = q8_reference(x.float().numpy())
    for isa, mod in mods.items():
        gq, gd, gs = mod.q8_quantize(x)
        assert torch.equal(gq.long(), torch.from_numpy(q)), isa
        assert torch.equal(gd, torch.from_numpy(d)) and torch.equal(gs, torch.from_numpy(s)), isa


@pytest.mark.parametrize("isa", ISAS)
def test_int8_head_does_not_saturate(mods, isa) -> None:
    """Codes 255 (w8 = 127) against activations of +-127 after quantization: a pair of products is
    2 * 255 * 127 = 64,770, past VPMADDUBSW's int16 limit; the exact sum is kept."""
    mod = mods[isa]
    w8 = torch.full((N, K), 127, dtype=torch.int8)
    w8[1::2] = -128  # code 0, the other end
    s = torch.full((N,), 0.01).bfloat16()
    wq, ws = cpu_kernels.q8_pack(w8, s)
    x = torch.ones(4, K)
    x[1] = -1
    x[2, ::2] = -1  # alternating signs
    x[3, 1::4] = 0.5
    got = mod.q4_gemm(x, wq, ws, N, 8)
    codes = (w8.to(torch.int16) + 128).to(torch.uint8)
    assert torch.equal(got, q4_reference(x, codes, ws))
    want = x[:3] @ (w8.float() * s.float()[:, None]).t()  # rows of +-1: q_x = +-127 exactly
    assert torch.allclose(got[:3], want, rtol=1e-4, atol=1e-3), (got[:3] - want).abs().max().item()


# ------------------------------------------------------------------------------------------------
# row kernels: invariance per ISA, the torch formula, and each other

H, INTER = 576, 1536


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=gen)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("delta_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("out_bf16", [False, True])
def test_add_rms_norm_rows(mods, threads, isa, delta_dtype, out_bf16) -> None:
    r = _inputs()
    x, w = r(NROWS, H) * 2, r(H)
    x[:, -3:] = 0.5  # H % 16 == 0: the tail path is covered by the silu test's width
    delta = None if delta_dtype is None else r(NROWS, H).to(delta_dtype)
    mod = mods[isa]

    def fn(idx):
        return mod.add_rms_norm(
            x[idx].clone(), None if delta is None else delta[idx].contiguous(), w, 1e-5, out_bf16
        )

    got = rows_invariant(fn)
    xs = x + (0 if delta is None else delta.float())
    ref = w * xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-5)
    tol = (2**-7, 1e-6) if out_bf16 else (1e-5, 1e-6)
    assert torch.allclose(got.float(), ref, rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_rows_and_across_isas(mods, threads, dtype) -> None:
    r = _inputs(1)
    width = INTER + 12  # not a multiple of 8 or 16: the tails
    gu = (r(NROWS, 2 * width) * 4).to(dtype)
    outs = {}
    for isa, mod in mods.items():
        outs[isa] = rows_invariant(lambda idx, mod=mod: mod.silu_mul(gu[idx].contiguous()))
    g, u = gu.float()[:, :width], gu.float()[:, width:]
    ref = torch.nn.functional.silu(g) * u
    tol = (2**-7, 1e-5) if dtype == torch.bfloat16 else (1e-5, 1e-6)
    for isa, got in outs.items():
        assert torch.allclose(got.float(), ref, rtol=tol[0], atol=tol[1]), isa
    first = outs[ISAS[0]].float()
    for isa, got in outs.items():  # glibc's 8- and 16-lane expf: within the bound of each other
        assert torch.allclose(got.float(), first, rtol=2 * tol[0], atol=2 * tol[1]), isa


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rd", [64, 40])
def test_rope_write_kv_rows(mods, threads, isa, rd) -> None:
    r = _inputs(2)
    nh, nkv, hd = 9, 3, 64
    qkv = r(NROWS, (nh + 2 * nkv) * hd)
    pos = torch.randint(0, 500, (NROWS,), generator=torch.Generator().manual_seed(3))
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2).float() / rd))
    ang = torch.arange(512).float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).contiguous(), torch.cat([ang.sin()] * 2, -1).contiguous()
    mod = mods[isa]

    def fn(idx):
        kc = torch.zeros(8, 16, nkv, hd)
        vc = torch.zeros_like(kc)
        slots = torch.arange(len(idx), dtype=torch.int64)
        q = mod.rope_write_kv(qkv[idx].contiguous(), pos[idx].contiguous(), cos, sin, kc, vc, slots, nh, nkv)
        return torch.cat([q.reshape(len(idx), -1), kc.reshape(-1, nkv * hd)[: len(idx)]], 1)

    got = rows_invariant(fn)
    x = qkv[:, : (nh + nkv) * hd].reshape(NROWS, nh + nkv, hd)
    c, s = cos[pos][:, None], sin[pos][:, None]
    xr, rest = x[..., :rd], x[..., rd:]
    rot = torch.cat([-xr[..., rd // 2 :], xr[..., : rd // 2]], -1)
    ref = torch.cat([xr * c + rot * s, rest], -1).reshape(NROWS, -1)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh,nkv", [(9, 3), (8, 2), (4, 4)])
def test_paged_attention_rows_and_across_isas(mods, threads, cache_dtype, nh, nkv) -> None:
    """64 query rows of 6 sequences (runs of consecutive positions, as prefill chunks, and single decode rows),
    keys scattered over a block pool; each row alone vs every batch, on every ISA; vs a dense softmax."""
    hd, bs = 64, 16
    r = _inputs(4)
    nblocks = 96
    kc, vc = r(nblocks, bs, nkv, hd).to(cache_dtype), r(nblocks, bs, nkv, hd).to(cache_dtype)
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(6)).int()
    lens_seq = [300, 17, 1, 64, 129, 211]
    tables = torch.zeros(len(lens_seq), 20, dtype=torch.int32)
    at = 0
    for b, L in enumerate(lens_seq):
        nb = -(-L // bs)
        tables[b, :nb] = perm[at : at + nb]
        at += nb
    row_seq, row_lens = [], []
    for i in range(NROWS):  # runs of 1-7 consecutive positions of one sequence
        b = (i // 7) % len(lens_seq)
        row_seq.append(b)
        row_lens.append(max(1, lens_seq[b] - (6 - i % 7)))
    row_seq, row_lens = torch.tensor(row_seq, dtype=torch.int32), torch.tensor(row_lens, dtype=torch.int32)
    q = r(NROWS, nh, hd)
    scale = hd**-0.5
    outs = {}
    for isa, mod in mods.items():

        def fn(idx, mod=mod):
            return mod.paged_attention(
                q[idx].contiguous(),
                kc,
                vc,
                tables,
                row_seq[idx].contiguous(),
                row_lens[idx].contiguous(),
                scale,
            )

        outs[isa] = rows_invariant(fn)
    ref = torch.empty(NROWS, nh, hd)
    for i in range(NROWS):
        L, t = int(row_lens[i]), tables[int(row_seq[i])]
        slots = (t.long()[torch.arange(L) // bs] * bs + torch.arange(L) % bs).tolist()
        k = kc.reshape(-1, nkv, hd)[slots].float().repeat_interleave(nh // nkv, 1)  # [L, nh, hd]
        v = vc.reshape(-1, nkv, hd)[slots].float().repeat_interleave(nh // nkv, 1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i], k) * scale, -1)
        ref[i] = torch.einsum("hl,lhd->hd", p, v)
    tol = 2e-5 if cache_dtype == torch.float32 else 4e-2
    for isa, got in outs.items():
        assert (got.float() - ref).abs().max().item() < tol, isa
        assert (got.float() - outs[ISAS[0]].float()).abs().max().item() < tol, isa
