"""The model runner: the only backend module that touches device tensors.

It loads a model (GGUF file or Hugging Face directory; the llama, qwen2, qwen3 and phi3 families), after
checking that its weights fit the memory budget (``backend.loaders.memory``), owns the paged KV pool,
turns the engine's ``SeqChunk`` list into flat device tensors + ``AttentionMetadata``
each step, and runs the llama forward.

KV pool: per layer ONE preallocated tensor ``[2, num_blocks, block_size, nkv, head_dim]``
in the compute dtype; ``[0]`` is the K cache and ``[1]`` the V cache of that layer. Its size
comes from ``num_kv_blocks`` or from a memory budget in bytes (``kv_cache_bytes``; default
512 MiB on CPU, 4 GiB on CUDA).

Source followed: nano-vllm ``engine/model_runner.py`` (prepare_prefill / prepare_decode),
vLLM's slot mapping.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from backend import cpu_kernels
from backend.allocator import release_free_heap, tune_glibc_malloc
from backend.attention.base import AttentionBackend, AttentionMetadata
from backend.batch import SeqChunk
from backend.loaders.memory import MemoryBudget
from backend.models.llama import LlamaModel, LlamaWeights, RowRoles
from backend.protocol import ModelCard

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

DEFAULT_KV_BYTES_CPU = 512 * 1024 * 1024  # fp32: ~11k tokens, more than SmolLM2's 8192 context
DEFAULT_KV_BYTES_CUDA = 4 * 1024 * 1024 * 1024


def load_weights(
    model_path: str | os.PathLike, *, keep_q4: bool = False, budget: MemoryBudget | None = None
) -> tuple[LlamaWeights, ModelCard]:
    """Load a GGUF file or a Hugging Face model directory into float32 weights + a card.

    ``keep_q4``: also keep the raw 4-bit codes of Q4_0/Q4_1/Q4_K GGUF matrices (``LlamaWeights.q4``).
    ``budget``: checked from the tensor shapes before any weight is read.

    Raises:
        FileNotFoundError: the path does not exist, or a file of an HF directory is missing.
        ValueError: unsupported format or architecture, weights over the budget.
    """
    p = Path(model_path)
    if p.is_dir():
        from backend.loaders.hf import load_hf

        return load_hf(p, budget=budget)
    if p.is_file():
        from backend.loaders.gguf import load_gguf

        return load_gguf(p, keep_q4=keep_q4, budget=budget)
    raise FileNotFoundError(f"model not found: {p}")


def make_attention_backend(
    name: str, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> AttentionBackend:
    """``"torch"`` -> ``TorchAttention``; ``"cupy"`` -> ``kernels_cupy.attention.CupyAttention(dtype, device)`` (lazy import).

    Raises:
        ValueError: unknown name.
        ImportError: the cupy backend's dependencies are missing.
    """
    if name == "torch":
        from backend.attention.torch_ref import TorchAttention

        # the C++ paged decode kernel (built on first use) on CPU; CUDA keeps the pure-torch path
        return TorchAttention(cpu_kernel=device is not None and torch.device(device).type == "cpu")
    if name == "cupy":
        from kernels_cupy.attention import CupyAttention  # lazy: cupy only where asked for

        return CupyAttention(dtype=dtype, device=device)
    raise ValueError(f"unknown attention backend {name!r} (torch, cupy)")


class ModelRunner:
    """Loads the model, owns the KV pool, executes engine steps.

    Args:
        model_path: a ``.gguf`` file or an HF directory (``config.json`` + ``*.safetensors``).
        device: ``"cpu"`` or ``"cuda[:n]"``.
        dtype: compute + KV dtype name: ``"float32"``, ``"bfloat16"``, ``"float16"`` (aliases fp32/bf16/fp16).
        attention_backend: ``"torch"`` or ``"cupy"``.
        block_size: tokens per KV block.
        kv_cache_bytes: KV pool budget in bytes over all layers (ignored when ``num_kv_blocks`` is given).
        num_kv_blocks: exact number of KV blocks.
        int4_max_rows: steps of at most this many tokens use packed int4 matmuls (4-bit GGUF on CPU only);
            ``None`` or 0: off, every step takes the oneDNN-prepacked dense path
            (``backend.models.llama.onednn_pack``), so a row's arithmetic never depends on the batch (batch
            invariance, docs/kernels.md); a positive value trades that for speed. Measured numbers in
            ``LlamaModel``'s docstring.
        memory_budget: host-memory bytes the load may take (``None``: ``$GATEWAY_MEMORY_BUDGET`` or the
            available RAM minus a margin; ``0``: no check). See ``backend.loaders.memory``.
        generated_int4: rows of generated tokens (``SeqChunk.prompt_len``) use the packed int4 matmuls and
            an int8 LM head, prompt rows the dense ones: batch-invariant (the format follows the token's role)
            at a third of dense bf16's bytes per decode step (``backend.models.llama.RowRoles``). ``None``: on
            for bfloat16 on CPU with a 4-bit GGUF when the C++ extension has ``q4_gemm`` (AVX2 + FMA or
            AVX-512 VNNI: ``backend.cpu_kernels.q4_ready``), off otherwise (torch's int4 kernel is linear in
            rows); ``True`` also turns it on in float32 (float32 activations through the same kernel). Measured,
            whole decode step, 1 thread, Xeon with AMX: 1/8/32 sequences 11.8/19.1/45.2 ms vs dense
            30.9/34.3/53.1 ms (docs/perf.md, "Batch invariance").
        prompt_int4: with ``generated_int4``, prompt rows take the int4 kernel too and no dense copy of the
            weights is kept (the all-int4 mode; generated blocks become prefix-cacheable again); ``None``:
            whichever prompt-row path measures faster at load (``backend.models.llama.q4_prompt_rows``);
            False: prompt rows dense.
        num_threads: ``torch.set_num_threads`` for this process (``None``: leave torch's default, one per
            core). On a CPU shared with other busy processes, 1 thread was ~3x faster than 2 (OpenMP
            barriers stall when a thread is descheduled); on an idle machine all cores are faster.

    Attributes:
        card: the ``ModelCard`` (dtype/device/attention_backend filled in).
        config: the ``LlamaConfig``.
        num_kv_blocks / block_size / vocab_size: ints.
        kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_kv_blocks, block_size, nkv, head_dim]``.

    Raises:
        ValueError: bad dtype, block size or KV size (fewer than 1 block), a model that cannot load (see
            ``load_weights``) or does not fit the memory budget (one line naming its size and the budget).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        attention_backend: str = "torch",
        block_size: int = 16,
        kv_cache_bytes: int | None = None,
        num_kv_blocks: int | None = None,
        int4_max_rows: int | None = None,
        num_threads: int | None = None,
        memory_budget: int | None = None,
        generated_int4: bool | None = None,
        prompt_int4: bool | None = False,
    ) -> None:
        if num_threads:
            torch.set_num_threads(int(num_threads))
        if torch.device(device).type == "cpu":
            tune_glibc_malloc()  # measured 2x at 64 decode sequences: see backend/allocator.py
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} (float32, bfloat16, float16)")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.block_size = block_size
        if int4_max_rows is None or self.device.type != "cpu":
            int4_max_rows = 0
        if generated_int4 is None:  # on where the row-invariant int4 kernel is built (cpu_kernels.q4_gemm)
            generated_int4 = (
                self.device.type == "cpu" and self.dtype == torch.bfloat16 and cpu_kernels.q4_ready()
            )
        budget = None
        if memory_budget != 0:
            on_cpu = self.device.type == "cpu"
            kv = 0 if (num_kv_blocks is not None or not on_cpu) else (kv_cache_bytes or DEFAULT_KV_BYTES_CPU)
            elem = torch.tensor([], dtype=self.dtype).element_size() if on_cpu else 0
            budget = MemoryBudget.for_load(dtype=_DTYPE_NAMES[self.dtype], compute_bytes=elem, extra_bytes=kv)
            if memory_budget is not None:
                budget.limit, budget.source = int(memory_budget), "the memory_budget given"
        weights, card = load_weights(model_path, keep_q4=int4_max_rows > 0 or generated_int4, budget=budget)
        self.config = weights.config
        self.model = LlamaModel(
            weights,
            device=self.device,
            dtype=self.dtype,
            int4_max_rows=int4_max_rows,
            generated_int4=generated_int4,
            prompt_int4=prompt_int4,
        )
        self.generated_int4 = self.model.generated_int4
        self.prompt_int4 = self.model.prompt_int4
        #: generated tokens take another weight format than prompt tokens (see ``RowRoles``): their blocks
        #: then hold other K/V than a prompt of the same tokens would, so they are not prefix-cached
        self.roles_differ = self.generated_int4 and not self.prompt_int4
        self._roles: tuple[RowRoles | None, RowRoles | None] = (None, None)
        del weights
        if self.device.type == "cpu":
            release_free_heap()  # the load's float32 staging copies (and dropped dense packs) are freed
        self.attn = make_attention_backend(attention_backend, self.dtype, self.device)
        cfg = self.config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        self.kv_block_bytes = cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem
        if num_kv_blocks is None:
            budget = kv_cache_bytes
            if budget is None:
                budget = DEFAULT_KV_BYTES_CUDA if self.device.type == "cuda" else DEFAULT_KV_BYTES_CPU
            num_kv_blocks = int(budget) // self.kv_block_bytes
        if num_kv_blocks < 1:
            raise ValueError(f"KV budget too small: one block needs {self.kv_block_bytes} bytes")
        self.num_kv_blocks = int(num_kv_blocks)
        self.kv_pools = [
            torch.zeros(
                2,
                self.num_kv_blocks,
                block_size,
                cfg.num_kv_heads,
                cfg.head_dim,
                dtype=self.dtype,
                device=self.device,
            )
            for _ in range(cfg.num_layers)
        ]
        self.kv_caches = [(p[0], p[1]) for p in self.kv_pools]
        self.vocab_size = cfg.vocab_size
        self.max_model_len = cfg.context_length
        card.dtype = _DTYPE_NAMES[self.dtype]
        card.device = str(self.device)
        card.attention_backend = getattr(self.attn, "name", attention_backend)
        card.weights = "int4" if self.prompt_int4 else "mixed" if self.generated_int4 else "dense"
        self.card = card

    # ------------------------------------------------------------------ inputs
    def prepare(
        self, chunks: list[SeqChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None, int]:
        """Flatten ``chunks`` into device tensors.

        Returns:
            ``(token_ids [T] int64, positions [T] int64, meta, logit_rows [R] int64 | None, max_pos)``.

        Raises:
            ValueError: an empty chunk, a negative start, a token id outside the vocabulary, a position
                beyond the model's context length, a block table too short, or a block id out of range.
        """
        bs = self.block_size
        nblocks = self.num_kv_blocks
        V = self.vocab_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        qlens: list[int] = []
        rows: list[int] = []
        gen: list[bool] = []  # per row: a generated token (position >= the sequence's prompt length)
        gen_logit: list[bool] = []
        num_decodes = 0
        decoding = True
        max_blocks = 1
        for c in chunks:
            n = len(c.token_ids)
            s = c.start_pos
            if n == 0:
                raise ValueError("SeqChunk with no tokens")
            if s < 0:
                raise ValueError(f"negative start_pos {s}")
            end = s + n
            if end > self.max_model_len:
                raise ValueError(f"position {end - 1} beyond the context length {self.max_model_len}")
            need = -(-end // bs)
            bt = c.block_table
            if len(bt) < need:
                raise ValueError(
                    f"block table of {len(bt)} blocks cannot hold {end} tokens (block size {bs})"
                )
            if n == 1 and decoding:
                num_decodes += 1
            else:
                decoding = False
            tokens.extend(c.token_ids)
            if n == 1:
                positions.append(s)
                slots.append(bt[s // bs] * bs + s % bs)
            else:
                positions.extend(range(s, end))
                slots.extend(bt[p // bs] * bs + p % bs for p in range(s, end))
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            qlens.append(n)
            nl = min(max(1, c.num_logits), n) if c.need_logits else 0
            rows.extend(range(qsl[-1] - nl, qsl[-1]))
            if self.roles_differ:
                p_len = end if c.prompt_len is None else c.prompt_len
                gen.extend(p >= p_len for p in range(s, end))
                gen_logit.extend(p >= p_len for p in range(end - nl, end))
            max_blocks = max(max_blocks, need)
        if tokens and (min(tokens) < 0 or max(tokens) >= V):
            raise ValueError(f"token id outside [0, {V})")
        table_rows = []
        for c in chunks:
            bt = c.block_table[:max_blocks]
            table_rows.append(bt + [0] * (max_blocks - len(bt)))
        bt_all = [b for r in table_rows for b in r]
        if bt_all and (min(bt_all) < 0 or max(bt_all) >= nblocks):
            raise ValueError(f"block id outside [0, {nblocks})")
        dev = self.device
        pin = dict(device=dev)
        tok_t = torch.tensor(tokens, dtype=torch.int64, **pin)
        pos_t = torch.tensor(positions, dtype=torch.int64, **pin)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, **pin),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, **pin),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, **pin),
            block_tables=torch.tensor(table_rows, dtype=torch.int32, **pin),
            num_decodes=num_decodes,
            max_query_len=max(qlens) if qlens else 0,
            max_seq_len=max(seq_lens) if seq_lens else 0,
            block_size=bs,
            seq_lens_cpu=seq_lens,
            query_lens_cpu=qlens,
        )
        rows_t = torch.tensor(rows, dtype=torch.int64, **pin) if rows else None
        if self.roles_differ:  # read by execute (the tuple prepare returns keeps its shape)
            self._roles = (RowRoles.of(gen, dev), RowRoles.of(gen_logit, dev))
        return tok_t, pos_t, meta, rows_t, max(positions) if positions else 0

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Compute one step: write the chunks' K/V into the pool and return the wanted logits.

        Args:
            chunks: decode chunks (one token) first, then the longer ones (verify and prefill chunks); see
                ``SeqChunk``.

        Returns:
            ``[R, vocab_size] float32`` on the runner's device: per chunk with ``need_logits`` (in chunk
            order) its ``num_logits`` last rows (one: the logits after its last token).
            ``[0, vocab_size]`` for an empty list or when no chunk needs logits.

        Raises:
            ValueError: malformed chunks (see ``prepare``).
        """
        if not chunks:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        tok, pos, meta, rows, max_pos = self.prepare(chunks)
        roles, logit_roles = self._roles
        return self.model.forward(
            tok, pos, self.kv_caches, self.attn, meta, rows, max_pos, roles, logit_roles
        )
