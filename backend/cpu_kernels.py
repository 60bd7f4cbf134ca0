"""C++ CPU kernels, built on first use with ``torch.utils.cpp_extension``: paged attention (decode and
prefill rows in one kernel), the llama layer's fused element-wise ops and the row-invariant int4 matmul
``q4_gemm``, batch invariant in explicit AVX2 or AVX-512.

``paged_decode`` reads each decode sequence's keys and values in place from the block pool
through its block table (the torch reference first gathers them into a dense copy), computes
in float32 and runs one (sequence, KV head) pair per task on torch's intra-op thread pool. The
source is ``cpu_kernels.cpp`` beside this file; it also holds ``add_rms_norm`` (residual add +
RMSNorm + cast), ``silu_mul`` (SwiGLU) and ``rope_write_kv`` (RoPE on q/k + K/V cache write), each
replacing 3-10 small torch ops per layer (see ``backend.models.llama``).

One source, one build per ISA (``backend.cpu_isa``: ``avx2`` = ``-march=x86-64-v3``, ``avx512``,
``avx512bf16``; the ``#if`` blocks of the source pick each ISA's bodies), and ``load()`` gives the build of
the ISA that ``LLM_GATEWAY_CPU_ISA`` selects (default: the best the CPU runs); ``load(isa)`` gives another
(tests compare them). ``python -m backend.cpu_kernels`` (``make install``) builds every ISA the CPU runs. The
compiled modules are cached by torch under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``),
so only the first process on a machine pays each ~1 minute build. A module's name carries its ISA and a hash
of what the binary depends on (``_build_tag``: the source, torch build and location, compiler flags), so
two environments (or two versions of the source) sharing that cache each keep their own build, and a build
is loaded only on a CPU that has its ISA's flags (never ``SIGILL``).

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

from backend import cpu_isa

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("cpu_kernels.cpp")
_lock = threading.Lock()
_modules: dict[str, object | None] = {}  # per ISA ("" = generic): the module, or None when it failed
_default: list[str] = []  # the selected ISA's key in _modules, once load() has resolved it

_CFLAGS = ["-O3", "-fopenmp", "-ffast-math"]
_GENERIC = ""  # the build for a CPU without AVX2 (or not x86): generic C++ bodies only

_FUNCTIONS = [
    "paged_decode",
    "paged_attention",
    "add_rms_norm",
    "silu_mul",
    "rope_write_kv",
    "apply_token_bitmask",
    "q4_gemm",
    "q4_gemm_supported",
    "q4_gemm_isa",
    "q8_quantize",
]


def _flags(isa: str) -> list[str]:
    """Compiler flags of one ISA's build (``backend.cpu_isa.CFLAGS``; the generic build: ``-march=x86-64``)."""
    return _CFLAGS + (cpu_isa.CFLAGS[isa] if isa else ["-march=x86-64"] if _x86() else [])


def _x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def _build_tag(isa: str) -> str:
    """Short hash of the build's inputs, the source and the ISA's flags included: processes started before
    and after an edit of the source each load their own build instead of rebuilding one shared name in turn
    (one of them found the other's binary, without the functions it expected), and each ISA has its own."""
    key = "\n".join(
        [torch.__version__, os.path.dirname(torch.__file__), " ".join(_flags(isa)), _SRC.read_text()]
    )
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def enabled() -> bool:
    """False when ``LLM_GATEWAY_CPU_KERNEL`` is ``0``/``false``/``off`` or the platform is not Linux x86-64."""
    if os.environ.get("LLM_GATEWAY_CPU_KERNEL", "1").lower() in ("0", "false", "off", "no"):
        return False
    return platform.system() == "Linux" and _x86()


def isa() -> str | None:
    """The ISA whose build ``load()`` returns (``backend.cpu_isa.selected``; None: the generic build).

    Raises:
        backend.cpu_isa.IsaError: ``LLM_GATEWAY_CPU_ISA`` names an ISA this CPU cannot run.
    """
    return cpu_isa.selected()


def load(isa_name: str | None = None):
    """The compiled extension module for ``isa_name`` (default: the selected ISA, ``isa()``), or None if
    unavailable; built (or found in torch's cache) once per process and ISA.

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
    ``rows[j]`` keeps the tokens whose bit is set in ``bitmask[j]``, the others become ``-inf``);
    ``q4_gemm`` (below), ``q4_gemm_isa() -> "avx2" | "avx512" | ""``, ``q8_quantize(x [M, K]) -> (q [M, K] i8,
    d [M, K/32] f32, s [M, K/32] f32)`` (``q4_gemm``'s row quantization, for tests).

    Raises:
        backend.cpu_isa.IsaError: ``isa_name`` (or the setting) names an ISA this CPU cannot run.
    """
    if isa_name is None and _default:  # the hot path: q4_gemm and paged_decode call load() per call
        return _modules[_default[0]]
    name = (isa() if isa_name is None else isa_name) or _GENERIC
    if name and name not in cpu_isa.supported():
        raise cpu_isa.IsaError(f"{cpu_isa.SETTING}={name}: this CPU cannot run it")
    if name in _modules:
        return _modules[name]
    with _lock:
        if name not in _modules:  # another thread may have built it while this one waited
            _modules[name] = _build(name) if enabled() else None
        if isa_name is None and not _default:
            _default.append(name)
    return _modules[name]


def _build(name: str):
    """Build (or find in torch's cache) and import one ISA's extension; None on any failure (logged)."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name=f"llm_gateway_cpu_kernels_{name or 'generic'}_{_build_tag(name)}",
            cpp_sources=[_SRC.read_text()],
            functions=_FUNCTIONS,
            extra_cflags=_flags(name),
            extra_ldflags=["-fopenmp"],
            with_cuda=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        log.warning("CPU kernels (%s) unavailable, using the torch reference: %s", name or "generic", exc)
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


def q4_ready() -> bool:
    """True when the loaded extension has a ``q4_gemm`` body (AVX2 + FMA, or AVX-512 VNNI, at compile time)."""
    mod = load()
    return mod is not None and hasattr(mod, "q4_gemm") and bool(mod.q4_gemm_supported())


def q4_pack(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Repack 4-bit groups for ``q4_gemm`` (the VNNI layout: one 64-byte vector = 16 columns x 4 consecutive k).

    Args:
        codes: ``[N, K] uint8`` in ``0..15``; ``scale``, ``zero``: ``[N, K/32] float32`` with
            ``w = (code - 8) * scale + zero`` (``backend.loaders.gguf.q4_groups``). ``N % 16 == 0``, ``K % 32 == 0``.

    Returns:
        ``(wq [N*K/2] uint8, ws [N/16, K/32, 2, 16] float32)``: per 16-column block and group, 4 vectors whose
        byte ``4*col + j`` holds ``code[col][32g + 8v + j]`` (low nibble) and ``code[col][32g + 8v + 4 + j]``
        (high nibble); ``ws`` holds ``d_w = scale`` and ``m_w = zero - 8*scale`` (Q4_1: ``w = d_w*code + m_w``).

    Raises:
        ValueError: ``N`` not a multiple of 16 or ``K`` of 32.
    """
    n, k = codes.shape
    if n % 16 or k % 32 or scale.shape != (n, k // 32):
        raise ValueError(f"q4_pack: N={n} must be a multiple of 16, K={k} of 32 (one scale per 32 k)")
    g = k // 32
    c = codes.to(torch.uint8).reshape(n // 16, 16, g, 8, 4).permute(0, 2, 3, 1, 4)  # [NB, G, 8 chunks, 16, 4]
    wq = (c[:, :, 0::2] | (c[:, :, 1::2] << 4)).contiguous().reshape(-1)
    return wq, _scales(scale.float(), zero.float() - 8.0 * scale.float())


def q8_pack(w8: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Repack per-row symmetric int8 weights (``w = scale[n] * w8[n, k]``, ``w8 [N, K] int8``, ``scale [N]``) for
    ``q4_gemm(..., bits=8)``: codes ``w8 + 128`` as uint8, 8 vectors of 16 columns x 4 k per group, and
    ``ws [N/16, K/32, 2, 16] float32`` = ``(scale, -128*scale)``, so the same Q8_1 dot applies.

    Raises:
        ValueError: ``N`` not a multiple of 16 or ``K`` of 32.
    """
    n, k = w8.shape
    if n % 16 or k % 32:
        raise ValueError(f"q8_pack: N={n} must be a multiple of 16, K={k} of 32")
    g = k // 32
    c = (w8.to(torch.int16) + 128).to(torch.uint8).reshape(n // 16, 16, g, 8, 4).permute(0, 2, 3, 1, 4)
    s = scale.float()[:, None].expand(n, g)
    return c.contiguous().reshape(-1), _scales(s, -128.0 * s)


def _scales(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``d, m [N, G]`` -> ``[N/16, G, 2, 16]`` float32 (per 16-column block and group: 16 d's, then 16 m's)."""
    n, g = d.shape
    return torch.stack([d, m], 0).reshape(2, n // 16, 16, g).permute(1, 3, 0, 2).contiguous()


def q4_gemm(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, n: int, bits: int = 4) -> torch.Tensor:
    """``x [M, K] (bfloat16 or float32) @ W.T -> [M, N]`` (x's dtype) for weights packed by ``q4_pack``
    (``bits=4``) or ``q8_pack`` (``bits=8``); row-invariant: a row's bits depend only on that row.

    Each row of ``x`` is quantized to int8 per 32 values (Q8_1: ``d_x = max|x|/127``, ``q_x = rne(x *
    (127/max|x|))``, ``s_x = d_x*sum(q_x)``), each (row, group) dot is an exact int32 (``VPDPBUSD`` on AVX-512,
    ``VPMADDUBSW``/``VPMADDWD`` on AVX2, without saturation), and the groups are folded in float32 in k order:
    ``acc = fma(isum, d_w*d_x, acc); acc = fma(m_w, s_x, acc)``. Every ISA gives the same bits (bf16 output
    rounded as ``VCVTNEPS2BF16``). Source followed: ggml's ``ggml_vec_dot_q4_1_q8_1`` and
    ``mul_sum_i8_pairs`` (llama.cpp). Threads split N only, so the result does not depend on the thread
    count either.

    Raises:
        RuntimeError: the kernel is unavailable (``q4_ready()`` false) or bad shapes/dtypes.
    """
    mod = load()
    if mod is None or not hasattr(mod, "q4_gemm"):
        raise RuntimeError("CPU q4_gemm kernel unavailable")
    return mod.q4_gemm(x.contiguous(), wq, ws, int(n), int(bits))


if (
    __name__ == "__main__"
):  # `python -m backend.cpu_kernels`: build (or find) every ISA's extension; never fails
    logging.basicConfig(level=logging.INFO)
    for name in cpu_isa.supported() or [_GENERIC]:
        mod = load(name)
        print(
            f"backend.cpu_kernels [{name or 'generic'}]:",
            "ready" if mod is not None else "unavailable (the torch reference path will be used)",
        )
