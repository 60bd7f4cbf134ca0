"""C++ CPU kernels, built on first use with ``torch.utils.cpp_extension``: paged attention (decode and
prefill rows in one kernel) and the llama layer's fused element-wise ops, batch invariant on AVX-512.

``paged_decode`` reads each decode sequence's keys and values in place from the block pool
through its block table (the torch reference first gathers them into a dense copy), computes
in float32 and runs one (sequence, KV head) pair per task on torch's intra-op thread pool. The
source is ``cpu_kernels.cpp`` beside this file; it also holds ``add_rms_norm`` (residual add +
RMSNorm + cast), ``silu_mul`` (SwiGLU) and ``rope_write_kv`` (RoPE on q/k + K/V cache write), each
replacing 3-10 small torch ops per layer (see ``backend.models.llama``); the compiled module is cached by torch under
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), so only the first process on a
machine pays the ~1 minute build. The module name carries a hash of what the binary depends on
(``_build_tag``: the source, torch build and location, compiler flags, the CPU's ISA flags for
``-march=native``), so two environments (or two versions of the source) sharing that cache each keep
their own build (one name for all was rebuilt ~30 s at every switch) and a cache carried to a CPU
without AVX-512 is never loaded there (``SIGILL``).

``load()`` returns None (callers keep the torch path) when the build fails (no C++ compiler or
ninja), off Linux x86-64, or when ``LLM_GATEWAY_CPU_KERNEL=0`` is set.

Source followed: vLLM PagedAttention semantics (https://arxiv.org/abs/2309.06180); the
``torch.utils.cpp_extension.load_inline`` documentation.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("cpu_kernels.cpp")
_lock = threading.Lock()
_module = None
_tried = False

_CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffast-math"]


def _cpu_isa_flags() -> str:
    """The first ``flags`` line of ``/proc/cpuinfo`` (what ``-march=native`` compiles for); else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[-1].strip()
    except OSError:
        pass
    return platform.processor()


def _build_tag() -> str:
    """Short hash of the build's inputs, the source included: processes started before and after an edit
    of the source each load their own build instead of rebuilding one shared name in turn (one of them
    found the other's binary, without the functions it expected)."""
    key = "\n".join(
        [
            torch.__version__,
            os.path.dirname(torch.__file__),
            " ".join(_CFLAGS),
            _cpu_isa_flags(),
            _SRC.read_text(),
        ]
    )
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def enabled() -> bool:
    """False when ``LLM_GATEWAY_CPU_KERNEL`` is ``0``/``false``/``off`` or the platform is not Linux x86-64."""
    if os.environ.get("LLM_GATEWAY_CPU_KERNEL", "1").lower() in ("0", "false", "off", "no"):
        return False
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def load():
    """The compiled extension module, or None if unavailable; built once per process.

    Its functions (all CPU tensors; errors are ``RuntimeError`` from ``TORCH_CHECK``):
    ``paged_attention(q [R, nh, hd] f32, k_cache, v_cache, block_tables [B, W] i32, row_seq [R] i32 | None,
    row_lens [R] i32, scale) -> [R, nh, hd]`` (query row ``r`` attends to keys ``[0, row_lens[r])`` of
    block-table row ``row_seq[r]``, row ``r`` when None: decode and prefill rows alike, each row's result
    independent of the others; docs/kernels.md); ``paged_decode(q, k_cache, v_cache, block_tables, seq_lens,
    scale)`` (one query per sequence; see ``paged_decode`` below);
    ``add_rms_norm(x [T, H] f32, delta [T, H] f32/bf16 | None, w [H] f32, eps, out_bf16) -> [T, H]``
    (``x += delta`` in place, then ``w * x / sqrt(mean(x^2) + eps)``; HF ``LlamaRMSNorm``);
    ``silu_mul(gu [N, 2I]) -> [N, I]`` (``silu(gate) * up``, float32 math, one rounding);
    ``rope_write_kv(qkv [T, (nh + 2 nkv) hd], positions [T] i64, cos [P, rd] f32, sin [P, rd] f32,
    k_cache, v_cache, slots [T] i64, nh, nkv) -> q [T, nh, hd] f32`` (HF rotate-half RoPE; rotated K
    and V stored at ``slots``, negative slots skipped);
    ``apply_token_bitmask(logits [B, V] f32, bitmask [R, W] i32, rows [R] i64)`` (in place: row
    ``rows[j]`` keeps the tokens whose bit is set in ``bitmask[j]``, the others become ``-inf``).
    """
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:  # another thread built it while this one waited
            return _module
        try:
            if enabled():
                _module = _build()
        finally:
            # set only once the build is over: a concurrent caller waits on the lock instead of
            # seeing ``_tried`` with no module yet and falling back to the torch path for good
            _tried = True
    return _module


def _build():
    """Build (or find in torch's cache) and import the extension; None on any failure (logged)."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name=f"llm_gateway_cpu_kernels_{_build_tag()}",
            cpp_sources=[_SRC.read_text()],
            functions=[
                "paged_decode",
                "paged_attention",
                "add_rms_norm",
                "silu_mul",
                "rope_write_kv",
                "apply_token_bitmask",
            ],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            with_cuda=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        log.warning("CPU decode kernel unavailable, using the torch reference: %s", exc)
        return None


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention of one query per sequence, straight from the paged cache.

    Args:
        query: ``[nd, nh, hd]`` (any float dtype; converted to float32).
        k_cache / v_cache: ``[num_blocks, block_size, nkv, hd]``, float32 or bfloat16, contiguous.
        block_tables: ``[B >= nd, W] int32`` (rows ``0..nd-1`` are used).
        seq_lens: ``[B >= nd] int32``, keys per sequence (tokens), each in ``[1, W * block_size]``.
        scale: softmax scale (``head_dim ** -0.5``).

    Returns:
        ``[nd, nh, hd]`` in the cache dtype.

    Raises:
        RuntimeError: the kernel is unavailable (``load()`` returned None), or bad shapes, dtypes,
            lengths or block ids (checked in C++ before any read).
    """
    mod = load()
    if mod is None:
        raise RuntimeError("CPU decode kernel unavailable")
    return mod.paged_decode(
        query.float().contiguous(), k_cache, v_cache, block_tables, seq_lens, float(scale)
    )


if __name__ == "__main__":  # `python -m backend.cpu_kernels`: build (or find) the extension now; never fails
    logging.basicConfig(level=logging.INFO)
    mod = load()
    print(
        "backend.cpu_kernels:",
        "ready" if mod is not None else "unavailable (the torch reference path will be used)",
    )
