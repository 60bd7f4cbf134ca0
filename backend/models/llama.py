"""Llama-family decoder forward over a flattened, paged-KV batch (llama, qwen2, qwen3, phi3).

The model computes one engine step: ``T`` new tokens of several sequences,
flattened (decode tokens first, then prefill chunks), with their absolute
positions. Per layer it writes the new K/V into the paged cache through an
``AttentionBackend`` and attends (``write_kv`` then ``forward``).

Weights arrive as a ``LlamaWeights``: a ``LlamaConfig`` plus a dict of float32
CPU tensors in Hugging Face ``LlamaForCausalLM`` naming and layout (Q/K rows in
HF "rotate-half" order, i.e. GGUF weights already un-permuted by the loader).
The families differ only by config flags: ``qkv_bias`` (qwen2: biases on the q/k/v
projections), ``qk_norm`` (qwen3: per-head RMSNorm of q and k before RoPE),
``tie_word_embeddings``, ``rope_dim < head_dim`` (partial rotary); phi3's fused
``qkv_proj`` / ``gate_up_proj`` are split by the loaders into the llama tensors.
``LlamaModel`` fuses them (QKV into one matrix, gate/up into one matrix), casts
them to the compute dtype and moves them to the device.

Numerics: RMSNorm and RoPE are computed in float32 (as HF does), the residual
stream is kept in float32 for every compute dtype, matmuls run in the compute
dtype (float32 / bfloat16 / float16), attention accumulates in float32.

Sources followed: HF transformers ``modeling_llama.py`` (RMSNorm, rotate-half
RoPE, ``_compute_llama3_parameters``), ``modeling_qwen2.py`` (q/k/v bias),
``modeling_qwen3.py`` (q/k norm), ``modeling_phi3.py`` (fused projections), llama.cpp ``convert_hf_to_gguf.py``
(Q/K permutation, ``rope_freqs.weight``), nano-vllm's model runner.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from backend import cpu_kernels, probe_cache
from backend.attention.base import AttentionBackend, AttentionMetadata

#: compute dtypes whose generated rows can take the packed int4 / int8 weights (``q4_gemm`` takes
#: bfloat16 or float32 activations)
_Q_DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class LlamaConfig:
    """Hyperparameters of a llama-architecture model (read from GGUF metadata or HF config.json).

    Attributes:
        vocab_size: tokens in the vocabulary (rows of the embedding).
        hidden_size: model width ``H``.
        intermediate_size: MLP width.
        num_layers: decoder blocks.
        num_heads / num_kv_heads: query and key/value heads (grouped-query attention).
        head_dim: per-head width (``hidden_size // num_heads`` unless given).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE frequency base.
        rope_dim: rotated dims per head (== head_dim for every known llama model).
        context_length: maximum positions (tokens) the model was trained for.
        rope_scaling: ``None``, ``{"type": "linear", "factor": f}`` or
            ``{"type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"}``.
        tie_word_embeddings: the LM head reuses ``embed_tokens`` (no separate output matrix).
        qkv_bias: the q/k/v projections have biases (``self_attn.{q,k,v}_proj.bias``; qwen2).
        qk_norm: q and k are RMS-normalized per head (weights ``self_attn.{q,k}_norm.weight [head_dim]``,
            epsilon ``rms_norm_eps``) before RoPE (qwen3).
        rope_attention_factor: multiplies RoPE's cos and sin (HF ``attention_scaling``; LongRoPE's
            ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``), 1.0 for every other rope type.
        architecture: the family name (``llama``, ``qwen2``, ``qwen3``, ``phi3``), for the card only.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_dim: int = 0  # 0: head_dim
    context_length: int = 2048
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_attention_factor: float = 1.0
    architecture: str = "llama"

    def __post_init__(self) -> None:
        if self.rope_dim == 0:
            self.rope_dim = self.head_dim
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(f"bad rope_dim {self.rope_dim} for head_dim {self.head_dim}")


@dataclass
class LlamaWeights:
    """A loaded model: config + float32 CPU tensors in HF naming (a ``dict``, or the loaders'
    ``LazyTensors``, which makes each tensor when it is first read).

    ``tensors`` keys: ``model.embed_tokens.weight [V, H]``, ``model.norm.weight [H]``,
    optional ``lm_head.weight [V, H]`` (absent when tied), and per layer ``i``
    ``model.layers.{i}.input_layernorm.weight [H]``,
    ``.self_attn.{q,k,v,o}_proj.weight`` (``[nh*hd, H]``, ``[nkv*hd, H]``, ``[nkv*hd, H]``, ``[H, nh*hd]``),
    ``.post_attention_layernorm.weight [H]``, ``.mlp.{gate,up}_proj.weight [I, H]``, ``.mlp.down_proj.weight [H, I]``;
    with ``qkv_bias`` also ``.self_attn.{q,k,v}_proj.bias`` (``[nh*hd]``, ``[nkv*hd]``, ``[nkv*hd]``), with
    ``qk_norm`` ``.self_attn.{q,k}_norm.weight [hd]``.
    ``rope_freqs`` (optional, ``[rope_dim/2]``): llama.cpp's per-frequency divisors (llama3 scaling in GGUF;
    LongRoPE's ``short_factor``).
    ``q4`` (optional): for 4-bit GGUF matrices, tensor name -> ``(codes [N, K] uint8, scale [N, K/32] f32,
    zero [N, K/32] f32)`` with ``w = (code - 8) * scale + zero`` (``backend.loaders.gguf.q4_groups``).
    """

    config: LlamaConfig
    tensors: MutableMapping[str, torch.Tensor]
    rope_freqs: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)
    q4: MutableMapping[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def rope_inv_freq(config: LlamaConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies ``[rope_dim/2] float32`` (HF ``_compute_default_rope_parameters`` + scaling).

    Raises:
        ValueError: an unsupported ``rope_scaling`` type.
    """
    dim = config.rope_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
    )
    sc = config.rope_scaling
    if rope_freqs is not None:
        # llama.cpp: theta = pos * base^(-2i/d) / freq_factor[i]
        inv_freq = inv_freq / rope_freqs.to(torch.float32)
    elif sc:
        kind = sc.get("type") or sc.get("rope_type")
        if kind in (None, "default", "none"):
            pass
        elif kind == "linear":
            inv_freq = inv_freq / float(sc["factor"])
        elif kind == "llama3":
            factor = float(sc["factor"])
            low = float(sc.get("low_freq_factor", 1.0))
            high = float(sc.get("high_freq_factor", 4.0))
            old_ctx = float(sc.get("original_max_position_embeddings", 8192))
            low_wl, high_wl = old_ctx / low, old_ctx / high
            wavelen = 2 * math.pi / inv_freq
            out = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * out / factor + smooth * out
            medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
            inv_freq = torch.where(medium, smoothed, out)
        else:
            raise ValueError(f"unsupported rope scaling type {kind!r}")
    return inv_freq


def onednn_pack(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-prepacked copy of a weight ``w [N, K]`` (float32 or bfloat16, CPU), or None.

    The packed (blocked-layout) weight feeds ``torch.ops.mkldnn._linear_pointwise``, the op
    torch's inductor emits for frozen CPU linears. Measured on the 2-core CPU VM, bfloat16, per
    call: ``[3072, 576]`` at 1/8/32 rows 0.052/0.097/0.286 ms vs ``torch.mm`` 0.148/0.173/0.381 ms;
    the ``[49152, 576]`` LM head at 1/32 rows 2.8/5.8 ms vs 4.9/8.3 ms; float32 at 32 rows 0.53 vs
    0.84 ms. Returns None (the caller keeps ``torch.mm``) when oneDNN is unavailable or the pack or
    a probe matmul fails (e.g. a CPU without bfloat16 support in oneDNN).
    """
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        probe = torch.ones(2, w.shape[1], dtype=w.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        want = torch.mm(probe, w.t())
        if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=1e-2):
            return None
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    return packed


#: row counts tried for the oneDNN calls of a matmul, largest first (see ``row_tiles``)
ROW_TILE_CANDIDATES = (64, 32, 16, 8, 4, 2, 1)
#: one large row count tried beside the small ones, for long prefill chunks
ROW_TILE_LARGE = 512
#: row counts checked against a candidate ``c`` (those under ``c``, and ``c``): the smallest, and each
#: multiple of 16 with its neighbours, where oneDNN's blocking changes (every count 1..64 was checked at
#: first: only 1 differed, the float32 GEMV; the bf16 down projection's other bits were at 96 and 127-129).
#: Each call reads the whole weight (the 49152 x 576 LM head: 5-20 ms), so the probe costs what it calls.
ROW_PROBE_COUNTS = (1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64)


def _onednn_mm(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ packed`` (+ ``b``) through oneDNN; a single row is sent as two (the row twice).

    oneDNN serves one row with a GEMV kernel whose reduction order differs from its GEMM's (measured:
    float32, every SmolLM2 shape, 1 and 2 threads: 1 row gave other bits than the same row among 2..64),
    so a lone row takes the GEMM path like every other row count."""
    if x.shape[0] == 1:
        return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), packed, b, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


@torch.inference_mode()
def row_tiles(packed: torch.Tensor, k: int, dtype: torch.dtype, b: torch.Tensor | None) -> tuple[int, ...]:
    """The row counts a oneDNN-prepacked matmul may be called with so that every output row is
    computed the same way whatever the number of rows (batch invariance).

    oneDNN picks its blocking (and so the reduction order over ``K``) from the shape and the thread
    count: measured on the 2-core Xeon VM (AVX512-BF16 + AMX), bf16, the ``[576, 1536]`` down projection
    gave other bits for 96-129 rows (1 thread) and 200-256 rows (2 threads) than for 1-69, 257-2048;
    the other shapes of SmolLM2 were row-invariant everywhere. So each shape is probed once per
    process and machine (``backend.probe_cache``, by shape, dtype, bias and thread count), on random rows against the real packed
    weight: the largest ``c`` of ``ROW_TILE_CANDIDATES`` whose row counts of ``ROW_PROBE_COUNTS`` up to ``c``
    give the rows of the ``c``-row call bit for bit, plus ``ROW_TILE_LARGE`` when its rows equal those too; each on
    one thread and on the thread count at load (the backend may change between the two under
    contention), which must agree as well. The answer is kept on disk for the next process
    (``backend.probe_cache``, keyed by the machine, the library versions and the call).

    Returns:
        ``(ROW_TILE_LARGE, c)`` or ``(c,)``; ``Linear`` splits a batch into calls of these sizes
        (large ones first), the last call taking the remainder (at most ``c`` rows).
    """
    threads = torch.get_num_threads()
    key = f"row_tiles|{tuple(packed.shape)}|{k}|{dtype}|{b is not None}|{threads}"
    stored = probe_cache.get(key)  # this process's answers, then the machine's file
    if stored is not None:
        return tuple(stored)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(ROW_TILE_LARGE, k, generator=gen).to(dtype)
    counts = sorted({1, threads})  # the backend may drop to one thread under contention (and back)

    def same_rows(m: int, ref: torch.Tensor) -> bool:
        """``m`` rows give the first ``m`` rows of ``ref`` on every thread count in ``counts``."""
        try:
            for n in counts:
                torch.set_num_threads(n)
                if not torch.equal(_onednn_mm(x[:m], packed, b), ref[:m]):
                    return False
            return True
        finally:
            torch.set_num_threads(threads)

    small = 1
    for c in ROW_TILE_CANDIDATES:
        ref = _onednn_mm(x[:c], packed, b)
        if all(same_rows(m, ref) for m in (*(m for m in ROW_PROBE_COUNTS if m < c), c)):
            small = c
            break
    full = _onednn_mm(x, packed, b)
    large_ok = torch.equal(full[:small], _onednn_mm(x[:small], packed, b)) and same_rows(ROW_TILE_LARGE, full)
    tiles = (ROW_TILE_LARGE, small) if large_ok else (small,)
    probe_cache.put(key, list(tiles))
    return tiles


class RowRoles:
    """Which rows of a step hold generated tokens (positions at or past their sequence's prompt length).

    With ``generated_int4`` the model computes generated rows with the packed int4 matmuls (an int8 LM
    head) and prompt rows with the dense ones, so a row's arithmetic is a function of its token's role and
    never of the rest of the step: a prompt computes the same K/V cold, chunked or from the prefix cache,
    and a generated token the same in a decode step, a recompute after preemption, or a batch of 64. Both
    kernel families give each row identical bits for every row count and thread count (measured:
    ``tests/unit/backend/test_invariance.py``).

    Attributes:
        generated: ``[G] int64`` indices of the generated rows, or None (none); prompt: ``[P] int64`` of the
            prompt rows, or None. At least one is not None.
    """

    __slots__ = ("generated", "prompt")

    def __init__(self, generated: torch.Tensor | None, prompt: torch.Tensor | None) -> None:
        self.generated = generated
        self.prompt = prompt

    @classmethod
    def of(cls, flags: list[bool], device: torch.device) -> RowRoles | None:
        """From one flag per row (True: generated); None when no row is generated (all dense)."""
        if not any(flags):
            return None
        if all(flags):
            return cls(torch.arange(len(flags), device=device), None)
        gen = [i for i, f in enumerate(flags) if f]
        prompt = [i for i, f in enumerate(flags) if not f]
        return cls(
            torch.tensor(gen, dtype=torch.int64, device=device),
            torch.tensor(prompt, dtype=torch.int64, device=device),
        )


class Linear:
    """``y = x @ W.T`` with ``W [N, K]``: oneDNN-prepacked on CPU, optionally packed int4 for few rows.

    Dense weights are kept as ``W`` ``[N, K]`` in the compute dtype or, on CPU, only as a oneDNN
    prepacked copy (``onednn_pack``; used for every row count; ``W`` is then dropped), called with the
    row counts of ``row_tiles`` only, so each output row's bits do not depend on the batch. With ``q4``
    (``codes [N, K] uint8, scale [N, K/32], zero [N, K/32]``) on CPU, inputs of at most
    ``int4_max_rows`` rows use ``torch.ops.aten._weight_int4pack_mm_for_cpu`` instead (reads 4 bits
    per weight; the same matmul against the same dequantized weights up to float rounding; off by
    default since the prepacked bf16 path measured as fast at 1 row and faster at 8).

    The quantized path (``_quantized``: the generated rows of ``RowRoles``, or ``int4_max_rows``), in bfloat16
    (or float32 with ``float32_q4``, the float32 int4 mode) on CPU with the C++ extension's ``q4_gemm`` (AVX2
    + FMA or AVX-512 VNNI: ``cpu_kernels.q4_ready``): ``qg = (wq, ws,
    bits)`` for ``cpu_kernels.q4_gemm``, the 4-bit groups repacked at load (``cpu_kernels.q4_pack``; bits 4) or,
    for the LM head, the per-row int8 copy ``w8`` (``cpu_kernels.q8_pack``; bits 8): ggml's Q4_1 x Q8_1 dot
    (llama.cpp; x quantized to int8 per 32 values, row by row), each output row's bits independent of the
    row count, the other rows and the thread count, and sub-linear in rows (one weight load serves 4 rows).
    torch's ``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm`` are the fallback (``packed`` is built
    only then, or with ``int4_max_rows``). ``N % 16`` and ``K % 32`` must be 0 for ``qg``, else the fallback.
    """

    __slots__ = (
        "w",
        "b",
        "n",
        "onednn",
        "tiles",
        "packed",
        "sz",
        "group",
        "int4_max_rows",
        "k",
        "w8",
        "w8_scale",
        "qg",
    )

    def __init__(
        self,
        w: torch.Tensor,
        q4=None,
        *,
        dtype: torch.dtype,
        device: torch.device,
        int4_max_rows: int = 0,
        prepack: bool = True,
        int8_small: bool = False,
        bias: torch.Tensor | None = None,
        float32_q4: bool = False,
    ):
        self.w = w.to(device=device, dtype=dtype).contiguous()
        self.n, self.k = w.shape
        self.b = None if bias is None else bias.to(device=device, dtype=dtype).contiguous()
        self.onednn = onednn_pack(self.w) if prepack else None
        self.tiles = row_tiles(self.onednn, w.shape[1], dtype, self.b) if self.onednn is not None else ()
        self.w8 = self.w8_scale = None
        # bfloat16 activations take the quantized weights wherever asked; float32 ones only in the float32
        # int4 mode (``float32_q4``: ``generated_int4``), not for ``int4_max_rows``, whose float32 fallback
        # (torch's int4pack) is exact
        quant_dtype = dtype == torch.bfloat16 or (dtype == torch.float32 and float32_q4)
        if int8_small and quant_dtype and torch.device(device).type == "cpu":
            # per-row symmetric int8 (for the LM head, whose GGUF type is not 4-bit): half the bytes of bf16
            wf = w.to(torch.float32)
            scale = wf.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            self.w8 = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
            self.w8_scale = scale.to(dtype)
        self.qg = None  # (wq, ws, bits) for cpu_kernels.q4_gemm: the row-invariant Q4_1/Q8_1 VNNI matmul
        use_q4_gemm = int8_small or q4 is not None
        if use_q4_gemm and quant_dtype and torch.device(device).type == "cpu" and self.n % 16 == 0:
            if w.shape[1] % 32 == 0 and cpu_kernels.q4_ready():
                if q4 is not None and q4[1].shape[1] * 32 == w.shape[1]:
                    self.qg = (*cpu_kernels.q4_pack(*q4), 4)
                elif q4 is None and self.w8 is not None:
                    self.qg = (*cpu_kernels.q8_pack(self.w8, self.w8_scale), 8)
        if self.onednn is not None:
            self.w = None  # the packed copy is all the matmul needs: do not keep the weight twice
        self.packed = self.sz = None
        self.group = 32
        self.int4_max_rows = int4_max_rows
        if q4 is not None and (self.qg is None or int4_max_rows > 0):  # torch's int4pack: the fallback
            codes, scale, zero = q4
            n, k = codes.shape
            self.group = k // scale.shape[1]
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32).contiguous(), 2
            )
            self.sz = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()  # [K/G, N, 2]

    @property
    def dense(self) -> bool:
        """Whether dense weights are kept (False after ``drop_dense``: every row takes ``_quantized``)."""
        return self.onednn is not None or self.w is not None

    def drop_dense(self) -> bool:
        """Free the dense weights when the row-invariant ``q4_gemm`` weights (``qg``) can serve every row
        (prompt rows included: the all-int4 mode); returns whether they were dropped."""
        if self.qg is None:
            return False
        self.onednn = self.w = None
        self.tiles = ()
        return True

    def __call__(self, x: torch.Tensor, roles: RowRoles | None = None) -> torch.Tensor:
        """``x [M, K]`` (compute dtype) -> ``[M, N]`` (compute dtype), plus the bias ``b [N]`` if any.

        ``roles``: the generated rows take the packed int4 (or int8) weights when this layer has them,
        the others the dense ones (see ``RowRoles``); None: every row is a prompt row. Without dense
        weights (``drop_dense``) every row takes the quantized ones."""
        if self.onednn is None and self.w is None:
            return self._quantized(x)
        quant = self.packed is not None or self.w8 is not None or self.qg is not None
        if roles is not None and quant:
            if roles.prompt is None:
                return self._quantized(x)
            y = torch.empty(x.shape[0], self.n, dtype=x.dtype, device=x.device)
            y.index_copy_(0, roles.generated, self._quantized(x.index_select(0, roles.generated)))
            y.index_copy_(0, roles.prompt, self._dense(x.index_select(0, roles.prompt)))
            return y
        if x.shape[0] <= self.int4_max_rows and quant:
            return self._quantized(x)
        return self._dense(x)

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]`` from the quantized weights: ``cpu_kernels.q4_gemm`` (row-invariant, ggml's
        Q4_1 x Q8_1 dot; int8 for the LM head) when built, else torch's int4pack / int8pack kernels."""
        if self.qg is not None:
            wq, ws, bits = self.qg
            y = cpu_kernels.q4_gemm(x, wq, ws, self.n, bits)
        elif self.packed is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.sz)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.w8, self.w8_scale)
        return y if self.b is None else y.add_(self.b)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn is not None:
            m = x.shape[0]
            small = self.tiles[-1]
            if m <= small or m in self.tiles:
                return _onednn_mm(x, self.onednn, self.b)
            parts, a = [], 0
            for t in self.tiles:
                while m - a > small and m - a >= t:
                    parts.append(_onednn_mm(x[a : a + t], self.onednn, self.b))
                    a += t
            if a < m:
                parts.append(_onednn_mm(x[a:], self.onednn, self.b))
            return torch.cat(parts)
        return torch.mm(x, self.w.t()) if self.b is None else torch.addmm(self.b, x, self.w.t())


#: rows of the synthetic prompt chunk ``q4_prompt_rows`` times (a typical chunked-prefill piece)
PROMPT_PROBE_ROWS = 256


@torch.inference_mode()
def q4_prompt_rows(lins: list[Linear], dtype: torch.dtype) -> bool:
    """Whether prompt rows are faster through ``q4_gemm`` than through the dense oneDNN matmuls on this
    machine: one layer's ``lins`` (both paths built, compute ``dtype``) on ``PROMPT_PROBE_ROWS`` random rows, each path's best
    of 3 calls after a warm-up, summed over the layer. Kept on disk (``backend.probe_cache``, keyed by the
    ISA of the kernels, the thread count and the shapes) so every later process makes the same choice.

    Measured on the 2-core EPYC VM (AVX2), one SmolLM2 layer at 512 rows, 1 thread: dense float32 59 ms,
    ``q4_gemm`` 42 ms (docs/perf.md). Returns False when a layer lacks either path."""
    if not lins or any(lin.qg is None or not lin.dense for lin in lins):
        return False
    from backend import cpu_isa  # noqa: PLC0415  (cached CPU flags; no torch state)

    threads = torch.get_num_threads()
    shapes = tuple((lin.n, lin.k) for lin in lins)
    key = f"prompt_int4|{cpu_isa.selected()}|{dtype}|{threads}|{shapes}"
    stored = probe_cache.get(key)
    if stored is not None:
        return bool(stored[0])
    import time  # noqa: PLC0415

    gen = torch.Generator().manual_seed(0)
    dense = quant = 0.0
    for lin in lins:
        x = torch.randn(PROMPT_PROBE_ROWS, lin.k, generator=gen).to(dtype)
        for f in (lin._dense, lin._quantized):
            f(x)
            best = math.inf
            for _ in range(3):
                t0 = time.perf_counter()
                f(x)
                best = min(best, time.perf_counter() - t0)
            if f == lin._dense:
                dense += best
            else:
                quant += best
    faster = quant < dense
    probe_cache.put(key, [int(faster), round(dense * 1e6), round(quant * 1e6)])
    return faster


def _cat_q4(parts):
    """Concatenate ``q4`` triples along N (None if any part lacks one)."""
    if any(p is None for p in parts):
        return None
    return tuple(torch.cat([p[i] for p in parts], 0) for i in range(3))


class LlamaModel:
    """Llama decoder on one device, in one compute dtype; no autograd.

    Args:
        weights: float32 weights from ``backend.loaders`` (consumed: the dict is emptied
            layer by layer to bound peak memory).
        device: ``"cpu"`` or ``"cuda[:n]"``.
        dtype: compute dtype of the matmuls (``torch.float32``, ``torch.bfloat16``, ``torch.float16``).
        int4_max_rows: on CPU with ``weights.q4`` (4-bit GGUF), steps of at most this many new tokens use
            the packed int4 matmul (0 disables), and the LM head a per-row int8 copy. ``None``: 0, so every
            row count takes the same dense matmuls (batch invariance; a positive value gives that up).
            Measured, whole bf16 step on the 2-core EPYC VM: 1/2/4/8 rows int4 15.0/17.2/20.3/31.1 ms
            vs oneDNN-prepacked bf16 24/26.8/27.9/29.5 ms (a decode step streams every weight from DRAM, and
            int4 reads a quarter of the bytes); the fp32 int4 kernel is far slower than dense.
        prepack: on CPU, use oneDNN-prepacked weights (``onednn_pack``) for every matmul, LM head included.
        fused: on CPU in float32/bfloat16, run each layer's element-wise work through the C++ fused ops of
            ``backend.cpu_kernels`` when they build (``cpu_kernels`` attribute; None = the torch path).
            Measured, bf16 single-sequence decode step on the 2-core VM: 12.5 ms torch ops -> see
            docs/perf.md for the fused number.
        generated_int4: on CPU in bfloat16 or float32 with ``weights.q4``: rows of generated tokens use the packed int4
            matmuls and an int8 LM head, prompt rows the dense ones (``RowRoles``; the caller passes the
            roles to ``forward``). Batch-invariant, since the format follows the token, not the step; a
            decode step then streams a third of the bytes of dense bf16.
        prompt_int4: with ``generated_int4``, prompt rows take ``q4_gemm`` too and the dense weights are
            freed (``Linear.drop_dense``; the all-int4 mode: one kernel per layer for every row, so a block of
            generated tokens holds the K/V a prompt would give and is prefix-cacheable). ``None``: whichever
            of the two prompt-row paths ``q4_prompt_rows`` measures faster on this machine at load (stored in
            ``backend.probe_cache``), fixed for the process, never chosen per batch.

    Attributes:
        config: the ``LlamaConfig``.
        kv_dtype: dtype of the KV cache (== the compute dtype).
        generated_int4 / prompt_int4: the row formats in force (``prompt_int4`` implies ``generated_int4``).
    """

    #: steps with at most this many tokens build per-token RoPE matrices and rotate Q and K with one bmm
    #: (measured, 1 thread: fp32 T=1 bmm 6.6 us vs elementwise 18.4 us; from T=32 elementwise wins)
    ROPE_BMM_MAX_TOKENS = 8

    def __init__(
        self,
        weights: LlamaWeights,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        int4_max_rows: int | None = None,
        prepack: bool = True,
        fused: bool = True,
        generated_int4: bool = False,
        prompt_int4: bool | None = False,
    ):
        cfg = weights.config
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = dtype
        if int4_max_rows is None or self.device.type != "cpu":
            int4_max_rows = 0
        self.int4_max_rows = int4_max_rows if weights.q4 else 0
        self.generated_int4 = bool(
            generated_int4 and weights.q4 and self.device.type == "cpu" and dtype in _Q_DTYPES
        )
        quantized = bool(self.int4_max_rows or self.generated_int4)
        self.cpu_kernels = None
        if fused and self.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            self.cpu_kernels = cpu_kernels.load()
        t = weights.tensors
        q4 = weights.q4
        dev = self.device

        def lin(names: list[str], bias: bool = False) -> Linear:
            w = torch.cat([t.pop(n) for n in names], 0) if len(names) > 1 else t.pop(names[0])
            q = _cat_q4([q4.pop(n, None) for n in names]) if quantized else None
            b = torch.cat([t.pop(n[: -len("weight")] + "bias") for n in names], 0) if bias else None
            return Linear(
                w,
                q,
                dtype=dtype,
                device=dev,
                int4_max_rows=self.int4_max_rows,
                prepack=prepack,
                bias=b,
                float32_q4=self.generated_int4,
            )

        def vec(x: torch.Tensor) -> torch.Tensor:  # norm weights stay float32
            return x.to(device=dev, dtype=torch.float32).contiguous()

        self.embed = t["model.embed_tokens.weight"].to(device=dev, dtype=dtype).contiguous()
        self.layers: list[tuple] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                (
                    vec(t.pop(p + "input_layernorm.weight")),
                    lin(
                        [
                            p + "self_attn.q_proj.weight",
                            p + "self_attn.k_proj.weight",
                            p + "self_attn.v_proj.weight",
                        ],
                        bias=cfg.qkv_bias,
                    ),
                    lin([p + "self_attn.o_proj.weight"]),
                    vec(t.pop(p + "post_attention_layernorm.weight")),
                    lin([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    lin([p + "mlp.down_proj.weight"]),
                    (vec(t.pop(p + "self_attn.q_norm.weight")), vec(t.pop(p + "self_attn.k_norm.weight")))
                    if cfg.qk_norm
                    else None,
                )
            )
        self.norm = vec(t["model.norm.weight"])
        if "lm_head.weight" in t and not cfg.tie_word_embeddings:
            head = t["lm_head.weight"]
        else:
            head = self.embed
        self.lm_head = Linear(
            head,
            None,
            dtype=dtype,
            device=dev,
            prepack=prepack,
            int4_max_rows=self.int4_max_rows,
            int8_small=quantized,
            float32_q4=self.generated_int4,
        )
        lins = [lin for layer in self.layers for lin in layer[1:6] if isinstance(lin, Linear)]
        lins.append(self.lm_head)
        if not self.generated_int4:
            prompt_int4 = False
        elif prompt_int4 is None:
            prompt_int4 = q4_prompt_rows(list(self.layers[0][1:3]) + list(self.layers[0][4:6]), dtype)
        if prompt_int4:
            for lin in lins:
                lin.drop_dense()
        self.prompt_int4 = bool(prompt_int4)
        self.inv_freq = rope_inv_freq(cfg, weights.rope_freqs)
        self._cos = self._sin = None
        self._rope_len = 0
        hd, rd = cfg.head_dim, cfg.rope_dim
        # rotate_half as a matrix: rotate_half(x) == x @ P on the first rope_dim dims
        P = torch.zeros(hd, hd)
        h = rd // 2
        for i in range(h):
            P[i + h, i] = -1.0
            P[i, i + h] = 1.0
        self._rot_p = P.to(dev)
        self._eye_pass = torch.diag(torch.cat([torch.zeros(rd), torch.ones(hd - rd)])).to(dev)
        self.q_size = cfg.num_heads * hd
        self.kv_size = cfg.num_kv_heads * hd
        self.scale = hd**-0.5

    # ------------------------------------------------------------------ rope
    def _rope_tables(self, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables ``[n, rope_dim] float32`` on the device, grown to cover ``max_pos``."""
        if max_pos >= self._rope_len:
            n = max(self.config.context_length, 1 << max_pos.bit_length(), 256)
            pos = torch.arange(n, dtype=torch.int64).to(torch.float32)
            freqs = pos[:, None] * self.inv_freq[None, :]  # same fp32 product as HF's matmul
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if self.config.rope_attention_factor != 1.0:  # LongRoPE (phi3): HF scales cos and sin
                cos, sin = cos * self.config.rope_attention_factor, sin * self.config.rope_attention_factor
            self._cos = cos.to(self.device)
            self._sin = sin.to(self.device)
            self._rope_len = n
        return self._cos, self._sin

    def rope_cos_sin(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos/sin ``[T, 1, rope_dim] float32`` for ``positions [T] int64`` (device)."""
        cos, sin = self._rope_tables(max_pos)
        return cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1)

    def rope_matrices(self, positions: torch.Tensor, max_pos: int) -> torch.Tensor:
        """Per-token RoPE matrices ``[T, hd, hd]`` (float32 on CPU, else the compute dtype): ``rope(x) == x @ M[t]``.

        On CPU the rotation runs in float32 (the ``bmm`` of one token's 12 heads took 4.6 us in float32
        vs 16 us in bfloat16 on the 2-core VM; the result is rounded to the compute dtype after).

        ``M = diag(cos) + P * sin`` on the rotated dims (identity on the others), with ``P`` the
        rotate-half matrix; each output element is ``x_i cos_i +- x_j sin_i`` (exact zeros elsewhere).
        """
        cos, sin = self._rope_tables(max_pos)
        rd, hd = self.config.rope_dim, self.config.head_dim
        c, s = cos.index_select(0, positions), sin.index_select(0, positions)  # [T, rd]
        if rd < hd:
            pad = torch.zeros(c.shape[0], hd - rd, device=c.device)
            c, s = torch.cat([c, pad], 1), torch.cat([s, pad], 1)
        eye = torch.eye(hd, device=c.device)
        m = eye * c[:, None, :] + self._rot_p * s[:, None, :] + self._eye_pass
        return m if self.device.type == "cpu" else m.to(self.dtype)

    def _apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """HF rotate-half RoPE on ``x [T, heads, head_dim]`` in float32; returns the compute dtype."""
        rd = self.config.rope_dim
        xf = x.float()
        if rd == self.config.head_dim:
            x1, x2 = xf.chunk(2, dim=-1)
            out = xf * cos + torch.cat((-x2, x1), dim=-1) * sin
        else:
            xr, xp = xf[..., :rd], xf[..., rd:]
            x1, x2 = xr.chunk(2, dim=-1)
            out = torch.cat([xr * cos + torch.cat((-x2, x1), dim=-1) * sin, xp], dim=-1)
        return out.to(self.dtype)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionBackend,
        meta: AttentionMetadata,
        logit_rows: torch.Tensor | None,
        max_pos: int,
        roles: RowRoles | None = None,
        logit_roles: RowRoles | None = None,
    ) -> torch.Tensor:
        """Run all layers over ``T`` new tokens and return logits of the selected rows.

        Args:
            token_ids: ``[T] int64`` on the device.
            positions: ``[T] int64`` absolute positions on the device.
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, nkv, head_dim]``
                in ``kv_dtype``; the new tokens' K/V are written into them.
            attn: the attention backend.
            meta: the step's ``AttentionMetadata``.
            logit_rows: ``[R] int64`` rows of the batch whose logits are wanted (``None``: none).
            max_pos: the largest value in ``positions`` (Python int; sizes the RoPE table).
            roles, logit_roles: the generated rows among the ``T`` rows and among the ``R`` logit rows
                (``RowRoles``; None: none). Used only with ``generated_int4``.

        Returns:
            ``[R, vocab] float32`` logits (``[0, vocab]`` when ``logit_rows`` is None or empty).
        """
        cfg = self.config
        T = token_ids.shape[0]
        dtype = self.dtype
        eps = cfg.rms_norm_eps
        H = cfg.hidden_size
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qs, ks = self.q_size, self.kv_size
        x = self.embed.index_select(0, token_ids).float()  # residual stream in fp32: [T, H]
        if not self.generated_int4:
            roles = logit_roles = None
        kern = self.cpu_kernels
        if kern is not None and getattr(attn, "name", "") == "torch":
            self._layers_fused(kern, x, positions, kv_caches, attn, meta, max_pos, roles)
            return self._logits(x, logit_rows, logit_roles)
        use_bmm = T <= self.ROPE_BMM_MAX_TOKENS
        if use_bmm:
            rot = self.rope_matrices(positions, max_pos)  # [T, hd, hd]
        else:
            cos, sin = self.rope_cos_sin(positions, max_pos)
        for (ln1, qkv_w, o_w, ln2, gu_w, down_w, qk_w), (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = F.rms_norm(x, (H,), ln1, eps).to(dtype)
            qkv = qkv_w(h, roles) if qk_w is None else self._qk_norm(qkv_w(h, roles), qk_w)
            if use_bmm:
                # float32 on CPU: q stays float32 (the attention takes it as is), k is rounded on write
                qk = torch.bmm(qkv[:, : qs + ks].view(T, nh + nkv, hd).to(rot.dtype), rot)
                q, k = qk[:, :nh], qk[:, nh:]
            else:
                q = self._apply_rope(qkv[:, :qs].view(T, nh, hd), cos, sin)
                k = self._apply_rope(qkv[:, qs : qs + ks].view(T, nkv, hd), cos, sin)
            v = qkv[:, qs + ks :].view(T, nkv, hd)
            attn.write_kv(k, v, k_cache, v_cache, meta)
            o = attn.forward(q, k_cache, v_cache, meta, self.scale)
            x = x + o_w(o.reshape(T, qs), roles)
            h = F.rms_norm(x, (H,), ln2, eps).to(dtype)
            gu = gu_w(h, roles)
            g, u = gu.chunk(2, dim=-1)
            x = x + down_w(F.silu(g) * u, roles)
        return self._logits(x, logit_rows, logit_roles)

    def _qk_norm(self, qkv: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Per-head RMSNorm of the q and k parts of ``qkv [T, (nh + 2 nkv) hd]`` (compute dtype), in float32
        and rounded back to the compute dtype as HF ``Qwen3RMSNorm`` does; v is unchanged. Returns a new
        contiguous ``[T, (nh + 2 nkv) hd]``."""
        cfg = self.config
        T, hd, qs, ks = qkv.shape[0], cfg.head_dim, self.q_size, self.kv_size
        qk = qkv[:, : qs + ks].reshape(T, cfg.num_heads + cfg.num_kv_heads, hd).float()
        q = F.rms_norm(qk[:, : cfg.num_heads], (hd,), norms[0], cfg.rms_norm_eps)
        k = F.rms_norm(qk[:, cfg.num_heads :], (hd,), norms[1], cfg.rms_norm_eps)
        return torch.cat(
            [q.reshape(T, qs).to(qkv.dtype), k.reshape(T, ks).to(qkv.dtype), qkv[:, qs + ks :]], 1
        )

    def _logits(
        self, x: torch.Tensor, logit_rows: torch.Tensor | None, roles: RowRoles | None = None
    ) -> torch.Tensor:
        """Final RMSNorm + LM head of the selected rows of the residual stream ``x [T, H] float32``."""
        cfg = self.config
        if logit_rows is None or logit_rows.numel() == 0:
            return torch.empty(0, cfg.vocab_size, dtype=torch.float32, device=self.device)
        xs = x.index_select(0, logit_rows)
        kern = self.cpu_kernels
        if kern is not None:  # the C++ row kernel: one reduction order per row, whatever the batch
            hl = kern.add_rms_norm(xs, None, self.norm, cfg.rms_norm_eps, self.dtype == torch.bfloat16)
        else:
            hl = F.rms_norm(xs, (cfg.hidden_size,), self.norm, cfg.rms_norm_eps).to(self.dtype)
        return self.lm_head(hl, roles).float()

    def _layers_fused(self, kern, x, positions, kv_caches, attn, meta, max_pos, roles=None) -> None:
        """All layers with the C++ fused ops (``backend.cpu_kernels``), updating ``x [T, H] float32`` in place.

        Per layer: ``add_rms_norm`` (the previous MLP's residual add + RMSNorm + cast), QKV matmul,
        ``rope_write_kv`` (RoPE on q and k in float32, K/V written to the cache; q stays float32 for
        the attention), attention, O matmul, ``add_rms_norm`` (residual + norm), gate/up matmul,
        ``silu_mul``, down matmul. Same math as the torch path; roundings to the compute dtype happen
        at the same points except that ``silu(g) * u`` and the RoPE output are rounded once.
        Measured: see ``LlamaModel`` (cpu_kernels).
        """
        cfg = self.config
        eps = cfg.rms_norm_eps
        nh, nkv = cfg.num_heads, cfg.num_kv_heads
        T = x.shape[0]
        bf16 = self.dtype == torch.bfloat16
        cos, sin = self._rope_tables(max_pos)
        slots = meta.slot_mapping
        delta = None
        for (ln1, qkv_w, o_w, ln2, gu_w, down_w, qk_w), (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = kern.add_rms_norm(x, delta, ln1, eps, bf16)
            qkv = qkv_w(h, roles) if qk_w is None else self._qk_norm(qkv_w(h, roles), qk_w)
            q = kern.rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, nh, nkv)
            o = attn.forward(q, k_cache, v_cache, meta, self.scale)
            h = kern.add_rms_norm(x, o_w(o.reshape(T, self.q_size), roles), ln2, eps, bf16)
            delta = down_w(kern.silu_mul(gu_w(h, roles)), roles)
        x += delta
