"""The default model's tokenizer on tiny weights: a fixture for tests that need a served model but not its text.

``tiny_smollm2`` (session): a GGUF file written once per run into a temporary folder by
:func:`plugins.tiny_models.write_tiny_gguf` -- a random-weight ``llama`` (``TinySpec`` defaults: hidden 64,
2 layers, 4 heads of 16, float32 tensors) carrying every ``tokenizer.*`` key of the default model's GGUF
(SmolLM2-135M-Instruct), its chat template among them, and a ``context_length`` of 2048. Prompts render to the
default model's token ids, so prompt-token counts, prefix-cache hits and KV block use are the real model's;
a backend serving it starts in a fraction of the time (no 135M weights to load, repack and probe). Its
generated text is random tokens: tests assert its structure, never its words.
"""

from __future__ import annotations

import pytest

#: the tiny file's own ``llama.context_length`` (what ``/v1/models`` reports when nothing overrides it)
TINY_CONTEXT = 2048


@pytest.fixture(scope="session")
def tiny_smollm2(tmp_path_factory, model_path: str) -> str:
    """The tiny file's path (str); see the module docstring."""
    from plugins.tiny_models import write_tiny_gguf

    path = tmp_path_factory.mktemp("tiny-smollm2") / "tiny-smollm2.gguf"
    return str(write_tiny_gguf(path, "llama", vocab=model_path, context_length=TINY_CONTEXT))
