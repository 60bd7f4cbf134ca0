"""The attention interface every backend implements (torch reference, CuPy kernels).

One engine step runs a *mixed batch*: ``num_decodes`` decode sequences (one
new token each) first, then prefill chunks (one or more new tokens each, of
possibly different lengths), flattened into ``T`` tokens. Per layer the model
runner calls ``write_kv`` (store the step's new K/V into the paged cache) and
then ``forward`` (attend each new token to its sequence's cached context and
to the new tokens before it, causally).

KV cache layout (per layer): ``k_cache, v_cache: [num_blocks, block_size,
num_kv_heads, head_dim]`` in the compute dtype. Token ``p`` of a sequence
lives at slot ``block_table[p // block_size] * block_size + p % block_size``.

Source followed: vLLM's PagedAttention (Kwon et al., SOSP 2023,
https://arxiv.org/abs/2309.06180) and its flash-attn varlen metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-step batch description, built once per step by the model runner.

    All tensors live on the model's device.

    Attributes:
        slot_mapping: ``[T] int64``, cache slot of each new token; ``< 0`` = do not write.
        query_start_loc: ``[B+1] int32``, cumulative new-token counts (``q`` rows of
            sequence ``i`` are ``query_start_loc[i]:query_start_loc[i+1]``).
        seq_lens: ``[B] int32``, context length of each sequence after this step
            (cached tokens + new tokens), i.e. the number of keys it attends to at its last row.
        block_tables: ``[B, max_blocks] int32``, physical block ids, padded with 0.
        num_decodes: the first ``num_decodes`` sequences have exactly one new token.
        max_query_len: max new tokens of any sequence (tokens).
        max_seq_len: max of ``seq_lens`` (tokens).
        block_size: tokens per KV block.
        seq_lens_cpu / query_lens_cpu: the same lengths as Python lists (no device sync needed).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


class AttentionBackend(Protocol):
    """Paged attention over a block-table KV cache.

    Implementations: ``backend.attention.torch_ref.TorchAttention`` (CPU/GPU reference,
    vectorized over the batch) and ``kernels_cupy.attention.CupyAttention`` (CUDA).
    """

    name: str

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store new keys/values ``[T, num_kv_heads, head_dim]`` at ``meta.slot_mapping`` (slots < 0 skipped)."""
        ...

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``query [T, num_heads, head_dim]`` against the paged cache.

        The new tokens' K/V must already be written (``write_kv``). Grouped-query:
        query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

        Returns:
            ``[T, num_heads, head_dim]`` in the KV cache's dtype (fp32 accumulation). The query is in
            that dtype too, except that the torch reference also takes a float32 query over a bf16/fp16
            cache (the model's float32 RoPE output on CPU).
        """
        ...
