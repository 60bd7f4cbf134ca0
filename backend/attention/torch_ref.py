"""Paged attention on CPU through the C++ kernel, and a reference in plain torch (CPU and CUDA).

On CPU with a float32 or bfloat16 cache and the extension built, every query row, decode or prefill,
goes to ``cpu_kernels.paged_attention`` (one kernel: each row attends to its own sequence's keys up to
its position, in position order, so its result does not depend on the batch; docs/kernels.md,
"CPU kernels and batch invariance"). The torch paths below serve CUDA, a float16 cache and a CPU
without the extension:

- ``write_kv``: one ``index_copy_`` of the step's new K/V into the flattened cache
  (``[num_blocks * block_size, nkv, hd]``) at ``meta.slot_mapping``.
- decode (the first ``meta.num_decodes`` sequences, one query each): the K/V of all decode
  sequences are gathered at once through their block tables into ``[nd, L, nkv, hd]``
  (``L`` = the longest decode context rounded up to whole blocks), padded keys get a ``-inf``
  bias; float32 then runs SDPA over that (strided) view, bf16/fp16 on CPU two block-diagonal
  ``bmm`` over all heads at once (see ``TorchAttention._decode_blockdiag``). No Python loop per
  sequence or per head.
- prefill chunks (the remaining sequences): per sequence, its cached prefix + its new tokens
  are gathered (``[S, nkv, hd]``) and the ``n`` new queries attend causally with the offset
  ``S - n`` (query ``i`` sees keys ``j <= S - n + i``): SDPA in float32 (and on CUDA),
  query tiles of bf16/fp16 GEMMs on CPU (``TorchAttention._prefill_tiled``).

Accumulation: float32 (decode and CPU bf16 prefill: scores rounded to bf16 once, softmax accumulates in float32; SDPA kernels accumulate
in float32 for bf16/fp16 inputs, CPU flash kernel and CUDA flash/efficient kernels).

Source followed: vLLM PagedAttention semantics (https://arxiv.org/abs/2309.06180),
``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend import cpu_kernels
from backend.attention.base import AttentionMetadata

#: cache dtypes the C++ decode kernel reads (a float16 cache, allowed on CPU, takes the torch path)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _valid_slots(meta: AttentionMetadata) -> bool:
    """True when no slot is negative (computed once per step; cached on the metadata object)."""
    v = getattr(meta, "_torch_ref_all_valid", None)
    if v is None:
        v = bool((meta.slot_mapping >= 0).all()) if meta.slot_mapping.numel() else True
        meta._torch_ref_all_valid = v  # type: ignore[attr-defined]
    return v


class TorchAttention:
    """``AttentionBackend`` in plain torch; see the module docstring."""

    name = "torch"

    def __init__(self, cpu_kernel: bool = False) -> None:
        """``cpu_kernel``: build/load the C++ paged decode kernel (``backend.cpu_kernels``) and
        use it for decode on CPU caches (falls back to the torch code when it is unavailable)."""
        self._cpu_kernel = None
        if cpu_kernel:
            self._cpu_kernel = cpu_kernels.load()
        self._eye: dict = {}  # (dtype, device, nkv, scale) -> block-diagonal scaled identity
        self._tri: dict = {}  # tile -> [tile, tile] bool, True above the diagonal

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store ``key``/``value`` ``[T, nkv, hd]`` at ``meta.slot_mapping [T]`` (negative slots skipped).

        ``k_cache``/``v_cache``: ``[num_blocks, block_size, nkv, hd]``, contiguous.
        """
        slots = meta.slot_mapping
        if not _valid_slots(meta):
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        nkv, hd = k_cache.shape[-2:]
        k_cache.view(-1, nkv, hd).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, nkv, hd).index_copy_(0, slots, value.to(v_cache.dtype))

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of ``query [T, nh, hd]`` over the paged cache; returns ``[T, nh, hd]`` in the cache dtype.

        ``query`` is in the cache dtype, or float32 over a bf16/fp16 cache (the model's float32 RoPE
        output on CPU, used as is by the float32 decode path).
        """
        nd = meta.num_decodes
        if self._cpu_kernel is not None and query.device.type == "cpu" and k_cache.dtype in _KERNEL_DTYPES:
            # one kernel for every row, decode or prefill: each row's result depends on its own
            # query, keys and length only (batch invariance; see backend/cpu_kernels.cpp)
            if nd == meta.num_seqs:
                row_seq, row_lens = None, meta.seq_lens
            else:
                row_seq, row_lens = _row_plan(meta)
            return self._cpu_kernel.paged_attention(
                query.float().contiguous(),
                k_cache,
                v_cache,
                meta.block_tables,
                row_seq,
                row_lens,
                float(scale),
            )
        plan = _plan(meta, query.device)
        if nd == meta.num_seqs:
            return self._decode(query, k_cache, v_cache, plan, scale)
        out = torch.empty(query.shape, dtype=k_cache.dtype, device=query.device)
        if nd:
            out[:nd] = self._decode(query[:nd], k_cache, v_cache, plan, scale)
        tiled = k_cache.dtype != torch.float32 and query.device.type == "cpu"
        for row, n, S, blocks, mask in plan["prefills"]:
            k = k_cache.index_select(0, blocks).flatten(0, 1)[:S].transpose(0, 1)  # [nkv, S, hd]
            v = v_cache.index_select(0, blocks).flatten(0, 1)[:S].transpose(0, 1)
            if tiled:
                out[row : row + n] = self._prefill_tiled(query[row : row + n], k, v, scale)
                continue
            q = query[row : row + n].transpose(0, 1)  # [nh, n, hd]
            # 4-D inputs: with 3-D ones CPU SDPA takes the O(n*S)-memory math path (3x slower at n=500)
            if mask is None:
                o = F.scaled_dot_product_attention(
                    q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                o = F.scaled_dot_product_attention(
                    q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
                )
            o = o[0]
            out[row : row + n] = o.transpose(0, 1)
        return out

    # With the C++ kernel (``backend.cpu_kernels``, AVX-512 for head_dim 64) all CPU decodes go there.
    # Measured, 30 layers x 256 keys from DRAM on the 2-core VM, bf16, torch vs C++: 1 sequence
    # 3.0 vs 0.34 ms, 8: 12.1 vs 4.4, 32: 29.8 vs 15.7 (docs/perf.md).

    #: bf16/fp16 decode batches of at most this many sequences use float32 SDPA (see ``_decode``)
    DECODE_FP32_MAX_SEQS = 2

    #: query rows per tile of ``_prefill_tiled`` (measured, bf16, 512 queries x 2,000 keys per layer:
    #: 64 -> 12.2 ms, 128 -> 13.0, 256 -> 14.8, 512 -> 25.6; SDPA 18.1)
    PREFILL_TILE = 128

    def _prefill_tiled(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of one prefill chunk in bf16/fp16 on CPU, one query tile at a time.

        ``q [n, nh, hd]`` (the chunk's new tokens), ``k``/``v`` ``[nkv, S, hd]`` (strided views of the
        gathered context, the chunk's own keys last); returns ``[n, nh, hd]``. Per tile of
        ``PREFILL_TILE`` queries and per KV head (one ``bmm`` batch over the ``nkv`` heads, the ``g``
        query heads of a group stacked as rows): scores against only the keys up to the tile's last
        query (``Q K^T`` in the compute dtype, i.e. oneDNN's bf16 GEMM), then float32 scale, causal
        mask on the tile's own diagonal block, softmax, probabilities rounded to the compute dtype and
        ``P V``. Tiles keep the score matrix cache-sized. Measured per layer on the 2-core VM against
        CPU SDPA (flash kernel, ~130 GFLOP/s in either dtype here): 512 x 512 keys 2.6 vs 5.0 ms,
        512 x 2,000 13.0 vs 18.1 ms, 2,000 x 2,000 33.7 vs 39 ms (causal). Scores and probabilities
        are rounded to bf16 once each (max abs error ~1e-2 on unit-variance random inputs).
        """
        n, nh, hd = q.shape
        nkv, S, _ = k.shape
        g = nh // nkv
        P = S - n
        # the scale folded into q (in float32, rounded once; exact for hd = 64: 1/8)
        qh = (q.float() * scale).to(k.dtype).view(n, nkv, g, hd).transpose(0, 1).reshape(nkv, n * g, hd)
        out = torch.empty(nkv, n * g, hd, dtype=k.dtype, device=q.device)
        tile = self.PREFILL_TILE
        tri = self._tri.get(tile)
        if tri is None:
            tri = self._tri[tile] = torch.ones(tile, tile, dtype=torch.bool).triu_(1)  # True = masked
        for a in range(0, n, tile):
            b = min(n, a + tile)
            t, e = b - a, P + b
            s = torch.bmm(qh[:, a * g : b * g], k[:, :e].transpose(1, 2)).view(nkv, t, g, e)
            s[..., P + a : e].masked_fill_(tri[:t, :t][None, :, None, :], float("-inf"))
            p = torch.softmax(s, dim=-1).view(nkv, t * g, e)  # float32 inside, compute dtype out
            torch.bmm(p, v[:, :e], out=out[:, a * g : b * g])
        return out.view(nkv, n, g, hd).transpose(0, 1).reshape(n, nh, hd)

    def _decode(self, query, k_cache, v_cache, plan, scale: float) -> torch.Tensor:
        """One query per sequence for the first ``nd`` sequences, all at once: ``[nd, nh, hd]``.

        The decode sequences' blocks are gathered with one ``index_select`` per cache (6x faster
        than advanced indexing here) into ``[nd, L, nkv, hd]``; padded keys get a ``-inf`` bias.
        Then, measured per layer on the 2-core CPU VM (bench in docs/perf.md, 32 sequences x 192
        keys): float32 -> SDPA over the strided gathered view (0.7 ms; a per-head bmm loop took
        4.8 ms); bfloat16/float16 on CPU -> ``_decode_blockdiag`` (0.55 ms; bf16 SDPA took 3.0 ms),
        except for at most ``DECODE_FP32_MAX_SEQS`` sequences, where the few gathered keys are
        converted to float32 for SDPA (1 sequence x 144 keys: 74 us vs 123 us; oneDNN's bf16 GEMM
        costs ~21 us a call at these tiny shapes).
        """
        nd, L, flat_blocks, bias = plan["decode"]
        nkv, hd = k_cache.shape[-2:]
        nh = query.shape[1]
        k = k_cache.index_select(0, flat_blocks).view(nd, L, nkv, hd)
        v = v_cache.index_select(0, flat_blocks).view(nd, L, nkv, hd)
        q = query[:nd]
        dt = k.dtype
        if dt != torch.float32 and q.device.type == "cpu":
            if nkv <= 4 and nd > self.DECODE_FP32_MAX_SEQS:
                return self._decode_blockdiag(q.to(dt), k, v, bias, scale)
            q, k, v = q.float(), k.float(), v.float()
        mask = None if bias is None else bias.unsqueeze(1).to(q.dtype)  # [nd, 1, 1, L]
        o = F.scaled_dot_product_attention(
            q.view(nd, nh, 1, hd),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=nh != nkv,
        )
        return o.view(nd, nh, hd).to(dt)

    def _decode_blockdiag(self, q, k, v, bias, scale: float) -> torch.Tensor:
        """Grouped-query decode as two plain ``bmm`` over all KV heads at once.

        ``q [nd, nh, hd]``, ``k``/``v`` ``[nd, L, nkv, hd]`` (contiguous, compute dtype), ``bias``
        ``[nd, 1, L] float32 | None``. Each query head is placed in the columns of its KV head of a
        block-diagonal ``Q' [nd, nh, nkv*hd]`` (zeros elsewhere), so ``Q' @ K^T`` reads the keys as
        the contiguous ``[nd, L, nkv*hd]`` they are (no per-head copy) at ``nkv`` times the (tiny)
        flops; ``P @ V`` gives every head against every KV head and the diagonal blocks are kept.
        Scores are rounded to the compute dtype by the matmul; the softmax accumulates in float32.
        """
        nd, L, nkv, hd = k.shape
        nh = q.shape[1]
        g = nh // nkv
        key = (q.dtype, q.device, nkv, scale)
        eye = self._eye.get(key)
        if eye is None:
            eye = (
                (torch.eye(nkv, dtype=torch.float32, device=q.device) * scale)
                .to(q.dtype)
                .view(1, nkv, 1, nkv, 1)
            )
            self._eye[key] = eye
        qd = (q.view(nd, nkv, g, 1, hd) * eye).view(nd, nh, nkv * hd)
        s = torch.bmm(qd, k.view(nd, L, nkv * hd).transpose(1, 2))  # [nd, nh, L], compute dtype
        if bias is not None:
            s += bias.to(s.dtype)  # 0 / -inf: exact in any dtype
        p = torch.softmax(s, dim=-1)  # float32 inside, compute dtype out
        o = torch.bmm(p, v.view(nd, L, nkv * hd)).view(nd, nkv, g, nkv, hd)
        return torch.diagonal(o, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(nd, nh, hd)


def _row_plan(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: its sequence (``[T] int32``, a row of ``meta.block_tables``) and the keys it sees
    (``[T] int32``: query ``i`` of a chunk of ``n`` new tokens over ``S`` keys sees ``S - n + 1 + i``).
    Computed once per step (cached on the metadata object)."""
    plan = getattr(meta, "_torch_ref_rows", None)
    if plan is None:
        seqs, lens = [], []
        for i, (n, S) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            seqs += [i] * n
            lens += range(S - n + 1, S + 1)
        dev = meta.seq_lens.device
        plan = (
            torch.tensor(seqs, dtype=torch.int32, device=dev),
            torch.tensor(lens, dtype=torch.int32, device=dev),
        )
        meta._torch_ref_rows = plan  # type: ignore[attr-defined]
    return plan


def _plan(meta: AttentionMetadata, device: torch.device, decode: bool = True) -> dict:
    """Per-step gather indices and masks, shared by every layer (cached on the metadata object).

    ``decode=False``: leave ``decode`` None (the decodes are served elsewhere, e.g. the C++ kernel).

    ``decode``: ``(nd, L, flat block ids [nd * L/bs] int64, bias [nd, 1, L] float32 (0 / -inf) | None)``;
    ``prefills``: per prefill sequence ``(first row, n new tokens, S keys, blocks [ceil(S/bs)] int64,
    mask [n, S] bool | None (None: plain causal, n == S))``.
    """
    plan = getattr(meta, "_torch_ref_plan", None)
    if plan is not None:
        return plan
    bs = meta.block_size
    nd = meta.num_decodes
    bt = meta.block_tables.long()
    plan = {"decode": None, "prefills": []}
    if nd and decode:
        max_len = max(meta.seq_lens_cpu[:nd])
        nblk = -(-max_len // bs)
        L = nblk * bs
        if nd == 1 and meta.seq_lens_cpu[0] == L:
            bias = None
        else:
            keep = torch.arange(L, device=device)[None, :] < meta.seq_lens[:nd, None]
            bias = torch.zeros(nd, L, device=device).masked_fill_(~keep, float("-inf"))[:, None, :]
        plan["decode"] = (nd, L, bt[:nd, :nblk].reshape(-1), bias)
    row = nd
    for i in range(nd, meta.num_seqs):
        n = meta.query_lens_cpu[i]
        S = meta.seq_lens_cpu[i]
        blocks = bt[i, : -(-S // bs)]
        if n == S:
            mask = None
        else:
            qpos = torch.arange(S - n, S, device=device)
            mask = torch.arange(S, device=device)[None, :] <= qpos[:, None]  # [n, S]
        plan["prefills"].append((row, n, S, blocks, mask))
        row += n
    meta._torch_ref_plan = plan  # type: ignore[attr-defined]
    return plan
