"""Reference paged attention in plain torch (CPU and CUDA), vectorized over the batch.

- ``write_kv``: one ``index_copy_`` of the step's new K/V into the flattened cache
  (``[num_blocks * block_size, nkv, hd]``) at ``meta.slot_mapping``.
- decode (the first ``meta.num_decodes`` sequences, one query each): the K/V of all decode
  sequences are gathered at once through their block tables into ``[nd, L, nkv, hd]``
  (``L`` = the longest decode context rounded up to whole blocks), padded keys get a ``-inf``
  bias, and grouped float32 matmuls + softmax do the rest. No Python loop per sequence.
- prefill chunks (the remaining sequences): per sequence, its cached prefix + its new tokens
  are gathered (``[S, nkv, hd]``) and the ``n`` new queries attend causally with the offset
  ``S - n`` (query ``i`` sees keys ``j <= S - n + i``).

Accumulation: float32 (decode: explicit float32 math; prefill: torch's SDPA kernels accumulate
in float32 for bf16/fp16 inputs, CPU flash kernel and CUDA flash/efficient kernels).

Source followed: vLLM PagedAttention semantics (https://arxiv.org/abs/2309.06180),
``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.attention.base import AttentionMetadata


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
        """Attention of ``query [T, nh, hd]`` over the paged cache; returns ``[T, nh, hd]`` in ``query.dtype``."""
        plan = _plan(meta, query.device)
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return self._decode(query, k_cache, v_cache, plan, scale)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = self._decode(query[:nd], k_cache, v_cache, plan, scale)
        for row, n, S, blocks, mask in plan["prefills"]:
            k = k_cache.index_select(0, blocks).flatten(0, 1)[:S].transpose(0, 1)  # [nkv, S, hd]
            v = v_cache.index_select(0, blocks).flatten(0, 1)[:S].transpose(0, 1)
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

    @staticmethod
    def _decode(query, k_cache, v_cache, plan, scale: float) -> torch.Tensor:
        """One query per sequence for the first ``nd`` sequences, all at once: ``[nd, nh, hd]``.

        The decode sequences' blocks are gathered with one ``index_select`` per cache (6x faster
        than advanced indexing here), then per KV head (a loop over ``nkv``, not over sequences)
        one float32 ``bmm`` ``[nd, g, hd] @ [nd, hd, L]`` reads the gathered keys in place (strided,
        no transpose copy), an additive ``-inf`` bias masks padding, softmax, and one ``bmm`` with
        the values. torch's CPU flash kernel took ~9 ms for a 32-sequence step that this does in
        well under 1 ms.
        """
        nd, L, flat_blocks, bias = plan["decode"]
        nkv, hd = k_cache.shape[-2:]
        nh = query.shape[1]
        g = nh // nkv
        f32 = torch.float32
        k = k_cache.index_select(0, flat_blocks).view(nd, L, nkv, hd)
        v = v_cache.index_select(0, flat_blocks).view(nd, L, nkv, hd)
        if k.dtype != f32:
            k, v = k.to(f32), v.to(f32)
        q = query[:nd].to(f32).mul(scale).view(nd, nkv, g, hd)
        s = torch.empty(nkv, nd, g, L, dtype=f32, device=query.device)
        for h in range(nkv):
            torch.bmm(q[:, h], k[:, :, h].transpose(1, 2), out=s[h])
        if bias is not None:
            s += bias
        p = torch.softmax(s, dim=-1)
        o = torch.empty(nd, nkv, g, hd, dtype=f32, device=query.device)
        for h in range(nkv):
            o[:, h] = torch.bmm(p[h], v[:, :, h])
        return o.view(nd, nh, hd).to(query.dtype)


def _plan(meta: AttentionMetadata, device: torch.device) -> dict:
    """Per-step gather indices and masks, shared by every layer (cached on the metadata object).

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
    if nd:
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
