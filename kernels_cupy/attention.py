"""``CupyAttention``: the CUDA implementation of ``backend.attention.base.AttentionBackend``.

Kernels (``kernels_cupy/paged_attention.cu``, compiled at run time by NVRTC via ``cupy.RawModule``):

- ``write_kv``: new K/V rows into the paged cache at ``meta.slot_mapping`` (slots < 0 skipped);
- ``paged_decode`` (+ ``paged_decode_reduce``): the first ``meta.num_decodes`` sequences (one query token
  each), grouped-query, block tables, context split into partitions for long sequences (vLLM
  PagedAttention v1/v2);
- ``paged_prefill``: the remaining sequences (chunks of new tokens), causal attention against the cached
  context plus the chunk, all sequences in one launch (FlashAttention-2 online softmax).

Tensors are shared with CuPy through DLPack (``cupy.from_dlpack``: no copies) and every kernel is
launched on torch's current CUDA stream (``cupy.cuda.ExternalStream``), so it orders with the model's
torch ops without synchronisation. CuPy is imported lazily: importing this module needs no CuPy/GPU.

Usage (the model runner picks it with ``attention_backend="cupy"``)::

    attn = CupyAttention()            # no required arguments
    attn.write_kv(k, v, k_cache, v_cache, meta)
    out = attn.forward(q, k_cache, v_cache, meta, scale)

Supported: fp16/bf16, head_dim 64/128, 1..8 query heads per KV head, any block size.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from kernels_cupy.compile import (
    PREFILL_THREADS,
    PREFILL_WARPS,
    WRITE_KV_THREADS,
    KernelConfig,
    get_function,
)

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
MAX_PARTITION = 512
MIN_PARTITION = 64
SMEM_DEFAULT_LIMIT = 48 * 1024


def choose_partition_size(
    num_kv_heads: int, num_seqs: int, max_seq_len: int, block_size: int, num_sms: int = 132
) -> int:
    """Tokens per decode partition (a multiple of ``block_size``).

    512 (vLLM v2's size) unless the grid ``num_kv_heads * num_seqs * num_partitions`` would hold fewer
    than two CTAs per multiprocessor; then halve it (down to 64) so small batches still fill the GPU.
    """
    ps = MAX_PARTITION
    while ps > MIN_PARTITION and num_kv_heads * num_seqs * math.ceil(max_seq_len / ps) < 2 * num_sms:
        ps //= 2
    return max(1, math.ceil(ps / block_size)) * block_size


def default_tuning(gqa: int) -> dict[str, int]:
    """Decode-kernel tuning per group size (measured on H200, docs/perf-gpu.md).

    Up to 4 query heads per KV head: the ``KernelConfig`` defaults (4 key / 8 value rows in flight per lane:
    84 % of copy bandwidth at 256 x 2048 vs 73 % with 2 / 4). Larger groups keep 2 / 4: with 8 heads per KV
    head the deeper unroll needs 226 registers per thread and measured 46 % vs 49 %.
    """
    return {} if gqa <= 4 else {"k_unroll": 2, "v_unroll": 4}


def decode_smem_bytes(
    partition_size: int, gqa: int, head_dim: int, block_size: int, decode_warps: int = 4
) -> int:
    """Dynamic shared memory of ``paged_decode`` (bytes): logits, cross-warp partial sums, block-table slice."""
    return 4 * (partition_size * gqa + decode_warps * gqa * head_dim) + 4 * (partition_size // block_size + 1)


def build_prefill_tiles(query_lens: list[int], num_decodes: int, rows: int = PREFILL_WARPS) -> list[int]:
    """Flat ``[seq, first_row]`` pairs: each prefill sequence's query rows cut into tiles of ``rows`` rows.

    Rows are global token indices (``query_start_loc`` numbering). Sequences with no new token get none.
    """
    tiles: list[int] = []
    start = 0
    for i, n in enumerate(query_lens):
        if i >= num_decodes:
            for r in range(start, start + n, rows):
                tiles += (i, r)
        start += n
    return tiles


class CupyAttention:
    """Paged attention with CUDA kernels compiled by NVRTC (see module docstring).

    Args:
        dtype: optional expected compute dtype (``torch.float16``/``torch.bfloat16``); checked at call.
        device: optional CUDA device; default: the tensors' device.

    Raises (at call):
        ValueError: unsupported dtype/head size/group size, or mismatched shapes.
        ImportError: CuPy is not installed.
    """

    name = "cupy"

    def __init__(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        if dtype is not None and dtype not in _DTYPE_NAMES:
            raise ValueError(f"CupyAttention supports float16/bfloat16, not {dtype}")
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self.poison_scratch = False  # checks: fill decode scratch with NaN so an unwritten element shows
        self.partition_size: int | None = None  # tuning/checks: force the decode partition size (tokens)
        self.tuning: dict[str, int] = {}  # tuning/checks: KernelConfig decode_warps / k_unroll / v_unroll
        self._arrays: OrderedDict[tuple, Any] = OrderedDict()  # DLPack views of long-lived tensors (caches)
        self._meta: Any = None
        self._meta_arrays: dict[str, Any] = {}
        self._streams: dict[int, Any] = {}
        self._num_sms: dict[int, int] = {}
        self._dummy: dict[int, Any] = {}
        self._cfgs: dict[tuple, KernelConfig] = {}

    # ------------------------------------------------------------------ helpers
    # Hooks overridden by the CPU emulator (kernels_cupy/emu.py): kernel lookup, argument conversion,
    # launch context, device check.
    def _fn(self, cfg: KernelConfig, name: str):
        return get_function(cfg, name)

    def _arg(self, t: torch.Tensor):
        return self._cp(t)

    def _launch_ctx(self, dev: torch.device):
        import cupy

        stack = contextlib.ExitStack()
        stack.enter_context(cupy.cuda.Device(dev.index))
        stack.enter_context(self._stream(dev))
        return stack

    def _check_device(self, k_cache: torch.Tensor) -> None:
        if not k_cache.is_cuda:
            raise ValueError("CupyAttention needs CUDA tensors")

    @staticmethod
    def _cp(t: torch.Tensor):
        import cupy

        if t.dtype in (torch.float16, torch.bfloat16):
            t = t.view(torch.int16)  # CuPy need not know bf16: kernels take raw 16-bit words
        return cupy.from_dlpack(t)

    def _cached(self, t: torch.Tensor):
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        arr = self._arrays.get(key)
        if arr is None:
            arr = self._arg(t)
            self._arrays[key] = arr
            if len(self._arrays) > 256:
                self._arrays.popitem(last=False)
        else:
            self._arrays.move_to_end(key)
        return arr

    def clear_cache(self) -> None:
        """Drop the cached DLPack views (they keep their tensors alive)."""
        self._arrays.clear()
        self._meta = None
        self._meta_arrays = {}

    def _stream(self, device: torch.device):
        import cupy

        ptr = torch.cuda.current_stream(device).cuda_stream
        s = self._streams.get(ptr)
        if s is None:
            # CuPy 14 deprecates ExternalStream (Stream.from_external); it still works
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                s = cupy.cuda.ExternalStream(
                    ptr, device.index if device.index is not None else torch.cuda.current_device()
                )
            self._streams[ptr] = s
        return s

    def _sms(self, device: torch.device) -> int:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._num_sms:
            self._num_sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        return self._num_sms[idx]

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, D]`` with heads/dims contiguous, 16-byte aligned rows (copies only if not)."""
        D = x.shape[-1]
        if x.stride(-1) != 1 or x.stride(-2) != D or x.stride(0) % 8 or x.data_ptr() % 16:
            x = x.contiguous()
        return x

    def _meta_views(self, meta, device: torch.device) -> dict[str, Any]:
        if self._meta is meta:
            return self._meta_arrays

        def i32(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device=device, dtype=torch.int32)
            return t if t.stride(-1) == 1 else t.contiguous()

        bt = i32(meta.block_tables)
        views = {
            "slot_mapping": self._arg(meta.slot_mapping.to(device=device, dtype=torch.int64).contiguous()),
            "seq_lens": self._arg(i32(meta.seq_lens).contiguous()),
            "query_start_loc": self._arg(i32(meta.query_start_loc).contiguous()),
            "block_tables": self._arg(bt),
            "bt_stride": int(bt.stride(0)) if bt.dim() == 2 and bt.shape[0] > 0 else 0,
        }
        tiles = build_prefill_tiles(list(meta.query_lens_cpu), meta.num_decodes)
        views["num_tiles"] = len(tiles) // 2
        if tiles:
            views["tiles"] = self._arg(torch.tensor(tiles, dtype=torch.int32).to(device, non_blocking=True))
        self._meta, self._meta_arrays = meta, views
        return views

    def _config(self, dtype: torch.dtype, D: int, bs: int, G: int) -> KernelConfig:
        """The kernel specialisation (cached: built once per shape and tuning)."""
        tuning = self.tuning or default_tuning(G)
        key = (dtype, D, bs, G, tuple(sorted(tuning.items())))
        cfg = self._cfgs.get(key)
        if cfg is None:
            cfg = self._cfgs[key] = KernelConfig(_DTYPE_NAMES[dtype], D, bs, G, **tuning)
        return cfg

    def _check(self, dtype: torch.dtype, k_cache: torch.Tensor) -> None:
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"CupyAttention supports float16/bfloat16, not {dtype}")
        if self.dtype is not None and dtype != self.dtype:
            raise ValueError(f"CupyAttention built for {self.dtype}, got {dtype}")
        if k_cache.dtype != dtype:
            raise ValueError(f"cache dtype {k_cache.dtype} != {dtype}")
        self._check_device(k_cache)
        if not k_cache.is_contiguous():
            raise ValueError("KV cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]")

    # ------------------------------------------------------------------ interface
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta
    ) -> None:
        """Store ``key, value [T, num_kv_heads, head_dim]`` at ``meta.slot_mapping [T] int64`` (< 0 skipped).

        Cache layout ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype as key/value.
        """
        self._check(key.dtype, k_cache)
        T, Hkv, D = key.shape
        if T == 0:
            return
        if k_cache.shape[2:] != (Hkv, D) or v_cache.shape != k_cache.shape:
            raise ValueError(f"key {tuple(key.shape)} does not match cache {tuple(k_cache.shape)}")
        cfg = self._config(key.dtype, D, k_cache.shape[1], 1)
        key, value = self._rows(key), self._rows(value)
        dev = key.device
        with self._launch_ctx(dev):
            mv = self._meta_views(meta, dev)
            self._fn(cfg, "write_kv")(
                (T,),
                (WRITE_KV_THREADS,),
                (
                    self._arg(key),
                    np.int64(key.stride(0)),
                    self._arg(value),
                    np.int64(value.stride(0)),
                    self._cached(k_cache),
                    self._cached(v_cache),
                    mv["slot_mapping"],
                    np.int32(Hkv),
                ),
            )

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal paged attention for a mixed batch (decodes first, then prefill chunks).

        Args:
            query: ``[T, num_heads, head_dim]`` fp16/bf16 (token stride free, heads/dims contiguous).
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, new K/V already written.
            meta: ``AttentionMetadata`` (decode rows are rows ``0 .. num_decodes-1``).
            scale: softmax scale (usually ``head_dim ** -0.5``).
            out: optional contiguous ``[T, num_heads, head_dim]`` output buffer (every element is written).

        Returns:
            ``[T, num_heads, head_dim]`` in the query's dtype (fp32 accumulation inside).
        """
        self._check(query.dtype, k_cache)

        T, H, D = query.shape
        Hkv, bs = k_cache.shape[2], k_cache.shape[1]
        if H % Hkv:
            raise ValueError(f"{H} query heads not a multiple of {Hkv} KV heads")
        cfg = self._config(query.dtype, D, bs, H // Hkv)
        query = self._rows(query)
        if out is None:
            out = torch.empty((T, H, D), dtype=query.dtype, device=query.device)
        elif not out.is_contiguous() or tuple(out.shape) != (T, H, D) or out.dtype != query.dtype:
            raise ValueError("out must be a contiguous [T, num_heads, head_dim] tensor of the query dtype")
        if T == 0:
            return out
        dev = query.device
        with self._launch_ctx(dev):
            for fn, grid, block, args, smem in self._plan(cfg, query, k_cache, v_cache, meta, scale, out):
                fn(grid, block, args, shared_mem=smem)
        return out

    # ------------------------------------------------------------------ launch plans
    def _plan(self, cfg: KernelConfig, query, k_cache, v_cache, meta, scale, out) -> list[tuple]:
        """The kernel launches of one ``forward``: ``[(RawKernel, grid, block, args, shared_mem)]``.

        Must run inside the CuPy device/stream context. Used by ``forward`` and by the benchmark
        (``scripts/gpu_check.py``) to time the kernels without the per-call Python work.
        """
        dev = query.device
        mv = self._meta_views(meta, dev)
        Hkv, bs = k_cache.shape[2], k_cache.shape[1]
        H, D = query.shape[1], query.shape[2]
        q_c, o_c = self._arg(query), self._arg(out)
        kc, vc = self._cached(k_cache), self._cached(v_cache)
        plans: list[tuple] = []
        nd = meta.num_decodes
        if nd:
            # once per step (metadata) and shape: partition size, kernels and the v2 scratch, which every
            # layer reuses (layer l+1's decode runs after layer l's reduce on the same stream)
            key = ("decode", cfg, H, D, Hkv, bs, self.partition_size)
            dec = mv.get(key)
            if dec is None:
                dec = mv[key] = self._decode_setup(cfg, nd, H, D, Hkv, bs, meta, dev)
            fn, ps, parts, smem, tmp_c, ml_c, es_c = dec
            plans.append(
                (
                    fn,
                    (Hkv, nd, parts),
                    (32 * cfg.decode_warps,),
                    (
                        o_c,
                        np.int64(out.stride(0)),
                        tmp_c,
                        ml_c,
                        es_c,
                        q_c,
                        np.int64(query.stride(0)),
                        kc,
                        vc,
                        mv["block_tables"],
                        np.int32(mv["bt_stride"]),
                        mv["seq_lens"],
                        np.int32(Hkv),
                        np.float32(scale),
                        np.int32(ps),
                    ),
                    smem,
                )
            )
            if parts > 1:
                plans.append(
                    (
                        self._fn(cfg, "paged_decode_reduce"),
                        (H, nd),
                        (128,),
                        (
                            o_c,
                            np.int64(out.stride(0)),
                            tmp_c,
                            ml_c,
                            es_c,
                            mv["seq_lens"],
                            np.int32(parts),
                            np.int32(ps),
                        ),
                        4 * parts,
                    )
                )
        if mv["num_tiles"]:
            plans.append(
                (
                    self._fn(cfg, "paged_prefill"),
                    (mv["num_tiles"], Hkv),
                    (PREFILL_THREADS,),
                    (
                        o_c,
                        np.int64(out.stride(0)),
                        q_c,
                        np.int64(query.stride(0)),
                        kc,
                        vc,
                        mv["block_tables"],
                        np.int32(mv["bt_stride"]),
                        mv["seq_lens"],
                        mv["query_start_loc"],
                        mv["tiles"],
                        np.int32(Hkv),
                        np.float32(scale),
                    ),
                    0,
                )
            )
        return plans

    def _decode_setup(
        self, cfg: KernelConfig, nd: int, H: int, D: int, Hkv: int, bs: int, meta, dev
    ) -> tuple:
        """``(kernel, partition_size, num_parts, shared_mem, tmp_out, max_logits, exp_sums)`` for a step.

        Scratch (fp32, one allocation): ``tmp_out [nd, H, parts, D]``, ``max_logits/exp_sums [nd, H, parts]``;
        NaN-filled when ``poison_scratch``; a 1-element dummy when one partition suffices.
        """
        max_len = max(meta.seq_lens_cpu[:nd])
        ps = self.partition_size or choose_partition_size(Hkv, nd, max_len, bs, self._sms(dev))
        ps = max(1, math.ceil(ps / bs)) * bs
        parts = math.ceil(max_len / ps)
        smem = decode_smem_bytes(ps, cfg.gqa, D, bs, cfg.decode_warps)
        fn = self._fn(cfg, "paged_decode")
        if smem > SMEM_DEFAULT_LIMIT:
            fn.max_dynamic_shared_size_bytes = smem
        if parts > 1:
            n_tmp, n_ml = nd * H * parts * D, nd * H * parts
            buf = torch.empty(n_tmp + 2 * n_ml, dtype=torch.float32, device=dev)
            if self.poison_scratch:
                buf.fill_(float("nan"))
            tmp = buf[:n_tmp].view(nd, H, parts, D)
            ml = buf[n_tmp : n_tmp + n_ml].view(nd, H, parts)
            es = buf[n_tmp + n_ml :].view(nd, H, parts)
            tmp_c, ml_c, es_c = self._arg(tmp), self._arg(ml), self._arg(es)
        else:
            tmp_c = ml_c = es_c = self._dummy_array(dev)
        return fn, ps, parts, smem, tmp_c, ml_c, es_c

    def _dummy_array(self, dev: torch.device):
        idx = dev.index
        if idx not in self._dummy:
            self._dummy[idx] = self._arg(torch.zeros(1, dtype=torch.float32, device=dev))
        return self._dummy[idx]
