"""Reference paged attention in plain torch (CPU and CUDA), vectorized over the batch.

- ``write_kv``: one ``index_copy_`` of the step's new K/V into the flattened cache
  (``[num_blocks * block_size, nkv, hd]``) at ``meta.slot_mapping``.
- decode (the first ``meta.num_decodes`` sequences, one query each): the K/V of all decode
  sequences are gathered at once through their block tables into ``[nd, nkv, L, hd]``
  (``L`` = the longest decode context rounded up to whole blocks), padded keys are masked,
  and one ``scaled_dot_product_attention`` call (grouped-query) does the rest. No Python loop
  per sequence.
- prefill chunks (the remaining sequences): per sequence, its cached prefix + its new tokens
  are gathered (``[S, nkv, hd]``) and the ``n`` new queries attend causally with the offset
  ``S - n`` (query ``i`` sees keys ``j <= S - n + i``).

Accumulation: torch's SDPA kernels accumulate in float32 for bf16/fp16 inputs
(CPU flash kernel and CUDA flash/efficient kernels).

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


def _long_tables(meta: AttentionMetadata) -> torch.Tensor:
    """``meta.block_tables`` as int64 (converted once per step; cached)."""
    bt = getattr(meta, "_torch_ref_bt64", None)
    if bt is None:
        bt = meta.block_tables.long()
        meta._torch_ref_bt64 = bt  # type: ignore[attr-defined]
    return bt


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
        T, nh, hd = query.shape
        nd = meta.num_decodes
        B = meta.num_seqs
        bs = meta.block_size
        bt = _long_tables(meta)
        if nd == B:
            return self._decode(query, k_cache, v_cache, meta, bt, nd, scale)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = self._decode(query[:nd], k_cache, v_cache, meta, bt, nd, scale)
        row = nd
        for i in range(nd, B):
            n = meta.query_lens_cpu[i]
            S = meta.seq_lens_cpu[i]
            nblk = -(-S // bs)
            k = k_cache[bt[i, :nblk]].flatten(0, 1)[:S].transpose(0, 1)  # [nkv, S, hd]
            v = v_cache[bt[i, :nblk]].flatten(0, 1)[:S].transpose(0, 1)
            q = query[row : row + n].transpose(0, 1)  # [nh, n, hd]
            if n == S:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                qpos = torch.arange(S - n, S, device=query.device)
                kpos = torch.arange(S, device=query.device)
                mask = kpos[None, :] <= qpos[:, None]  # [n, S]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[row : row + n] = o.transpose(0, 1)
            row += n
        return out

    @staticmethod
    def _decode(query, k_cache, v_cache, meta, bt, nd: int, scale: float) -> torch.Tensor:
        """One query per sequence for the first ``nd`` sequences, all at once: ``[nd, nh, hd]``."""
        bs = meta.block_size
        max_len = max(meta.seq_lens_cpu[:nd])
        nblk = -(-max_len // bs)
        L = nblk * bs
        tables = bt[:nd, :nblk]
        nkv, hd = k_cache.shape[-2:]
        k = k_cache[tables].view(nd, L, nkv, hd).transpose(1, 2)  # [nd, nkv, L, hd]
        v = v_cache[tables].view(nd, L, nkv, hd).transpose(1, 2)
        q = query[:nd].unsqueeze(2)  # [nd, nh, 1, hd]
        if nd == 1 and meta.seq_lens_cpu[0] == L:
            mask = None
        else:
            mask = torch.arange(L, device=query.device)[None, :] < meta.seq_lens[:nd, None]
            mask = mask[:, None, None, :]  # [nd, 1, 1, L]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)
