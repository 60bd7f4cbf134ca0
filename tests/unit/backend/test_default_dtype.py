"""The served default dtype follows the hardware (``backend.model_path.default_dtype``), and the draft length
follows the weight path (``backend.proposer.default_draft_tokens``)."""

from __future__ import annotations

import pytest

from backend import model_path
from backend.model_path import EXACT_DTYPE, FAST_DTYPE, default_dtype
from backend.proposer import DRAFT_TOKENS_DENSE, DRAFT_TOKENS_INT4, default_draft_tokens

ZEN2 = frozenset("fpu sse sse2 avx f16c fma avx2".split())  # AMD EPYC 7xx2: no AVX-512, no native bf16
SAPPHIRE = ZEN2 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"}
ZEN4 = ZEN2 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}


@pytest.mark.parametrize(
    ("flags", "want"),
    [(ZEN2, EXACT_DTYPE), (SAPPHIRE, FAST_DTYPE), (ZEN4, FAST_DTYPE), (frozenset(), EXACT_DTYPE)],
)
def test_cpu_default_by_flags(monkeypatch, flags, want):
    monkeypatch.setattr(model_path, "cpu_flags", lambda: flags)
    assert default_dtype("cpu") == want


def test_cuda_default_is_the_fast_mode(monkeypatch):
    monkeypatch.setattr(model_path, "cpu_flags", lambda: ZEN2)
    assert default_dtype("cuda") == default_dtype("cuda:1") == FAST_DTYPE


def test_draft_length_by_weight_path():
    assert default_draft_tokens(True) == DRAFT_TOKENS_INT4 == 5
    assert default_draft_tokens(False) == DRAFT_TOKENS_DENSE == 5
