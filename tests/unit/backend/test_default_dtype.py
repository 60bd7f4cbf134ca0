"""The served default dtype follows the hardware (``backend.model_path.default_dtype``), and the draft length
follows the weight path (``backend.proposer.default_draft_tokens``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend import cpu_isa
from backend.model_path import EXACT_DTYPE, FAST_DTYPE, default_dtype
from backend.proposer import DRAFT_TOKENS_DENSE, DRAFT_TOKENS_INT4, default_draft_tokens

ROOT = Path(__file__).resolve().parents[3]
ZEN2 = frozenset(
    "fpu sse sse2 avx f16c fma avx2 bmi1 bmi2 movbe".split()
)  # AMD EPYC 7xx2: no AVX-512, no native bf16
ICELAKE = ZEN2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}
SAPPHIRE = ICELAKE | {"avx512_bf16", "amx_bf16", "amx_int8"}
ZEN4 = ICELAKE | {"avx512_bf16"}


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (ZEN2, EXACT_DTYPE),
        (ICELAKE, EXACT_DTYPE),
        (SAPPHIRE, FAST_DTYPE),
        (ZEN4, FAST_DTYPE),
        (frozenset(), EXACT_DTYPE),
    ],
)
def test_cpu_default_by_flags(monkeypatch, flags, want):
    monkeypatch.delenv(cpu_isa.SETTING, raising=False)
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: flags)
    assert default_dtype("cpu") == want


def test_forced_isa_sets_the_default_and_caps_torch(monkeypatch):
    """A run forced to AVX2 on a bf16 machine gets the AVX2 machine's default; the caps follow the ISA."""
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: SAPPHIRE)
    monkeypatch.setenv(cpu_isa.SETTING, "avx2")
    assert default_dtype("cpu") == EXACT_DTYPE
    env = {cpu_isa.SETTING: "avx2"}
    assert cpu_isa.apply(env) == "avx2"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    env = {cpu_isa.SETTING: "auto"}
    assert cpu_isa.apply(env) == "avx512bf16" and "ATEN_CPU_CAPABILITY" not in env
    assert cpu_isa.supported(ICELAKE) == ["avx2", "avx512"]


@pytest.mark.parametrize(("flags", "isa"), [(ZEN2, "avx512"), (ICELAKE, "avx512bf16"), (ZEN2, "sse9")])
def test_isa_the_cpu_lacks_is_an_error_naming_the_setting(monkeypatch, flags, isa):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: flags)
    with pytest.raises(cpu_isa.IsaError, match=f"^{cpu_isa.SETTING}={isa}: "):
        cpu_isa.selected({cpu_isa.SETTING: isa})


def test_cuda_default_is_the_fast_mode(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: ZEN2)
    assert default_dtype("cuda") == default_dtype("cuda:1") == FAST_DTYPE


def test_draft_length_by_weight_path():
    assert default_draft_tokens(True) == DRAFT_TOKENS_INT4 == 5
    assert default_draft_tokens(False) == DRAFT_TOKENS_DENSE == 5


@pytest.mark.parametrize("program", [["gateway", "serve"], ["backend", "--listen", "127.0.0.1:1"]])
def test_programs_refuse_an_isa_the_cpu_lacks(program):
    """One line naming the setting, exit 2, before any model or kernel is loaded (never SIGILL)."""
    lacking = [isa for isa in cpu_isa.ISAS if isa not in cpu_isa.supported()]
    isa = lacking[0] if lacking else "avx10"  # an AVX-512 BF16 CPU runs all three: an unknown name then
    env = {**os.environ, cpu_isa.SETTING: isa}
    r = subprocess.run(
        [sys.executable, "-m", *program], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{cpu_isa.SETTING}={isa}: " in lines[0], r.stderr
