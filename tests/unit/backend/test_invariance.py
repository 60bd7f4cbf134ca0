"""Batch invariance of the default CPU mode (``default_dtype()``: bfloat16 where the CPU multiplies bf16
natively, float32 elsewhere; generated rows through the int4 kernel, ``--weights auto``) through the real
``Engine`` and the real model. ``LLM_GATEWAY_CPU_ISA=avx2`` runs it with the AVX2 kernels on any x86 CPU.

Every fixture chat plus 8 more prompts (a shared 500-token prefix among them), each greedy and seeded at
temperature 0.8, 24 new tokens (EOS ignored): the tokens must be identical

- alone, prefix caching off (the reference: the alone case and the caching-off case);
- all 28 requests at once (batches of up to 16 rows of mixed lengths, chunked prefill beside decodes),
  prefix caching on (a shared system prompt, and each prompt's greedy twin, already hit it the first time);
- all at once again, the prompts' blocks read from the prefix cache;
- with preemption by recompute forced (a pool of three times the largest request's blocks for the 20
  requests under 200 tokens in one batch, prefix caching off: 28 preemptions).

Each output row is computed the same way whatever else is in the step (see
docs/kernels.md, "Batch invariance"), so these hold exactly, not within a tolerance.

Run: ``.venv/bin/python -m pytest -q tests/unit/backend/test_invariance.py``.
"""

from __future__ import annotations

import pytest

from backend.engine import Engine, collect_tokens
from backend.model_path import default_dtype
from backend.protocol import SamplingParams, Submit

pytestmark = pytest.mark.slow

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def runner(one_thread_runner):
    """The served default mode on one thread (``one_thread_runner``, shared with ``test_speculative``): the
    default dtype, generated rows through the row-invariant int4 kernel where the CPU kernels have it."""
    return one_thread_runner(default_dtype(), "auto")


@pytest.fixture(scope="module")
def prompts(chat_fixtures) -> list[list[int]]:
    """The 6 fixture chats (31..986 tokens) and 8 more built from their ids (20..560 tokens)."""
    base = [c["prompt_ids"] for c in chat_fixtures]
    long = base[5]
    extra = [
        long[:500] + base[0],  # three prompts sharing a 500-token prefix
        long[:500] + base[1],
        long[:500] + base[2][-40:],
        base[2] + base[3],
        base[3] + base[4],
        base[0][:20],
        base[1] + base[0],
        base[4] + base[2] + base[1],
    ]
    return base + extra


def _params(i: int, seeded: bool) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, seed=1000 + i, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _requests(prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    return [(p, _params(i, seeded)) for i, p in enumerate(prompts) for seeded in (False, True)]


def _run(engine: Engine, items: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    res = engine.generate(
        [Submit(request_id=str(i), prompt_ids=p, sampling=s) for i, (p, s) in enumerate(items)]
    )
    return [collect_tokens(res[str(i)]) for i in range(len(items))]


@pytest.fixture(scope="module")
def reference(runner, prompts) -> list[list[int]]:
    """Each request alone, prefix caching off."""
    eng = Engine(runner, enable_prefix_caching=False)
    out = [_run(eng, [item])[0] for item in _requests(prompts)]
    assert all(len(t) == NEW_TOKENS for t in out)
    return out


def test_prompt_cached_and_mixed_batch(runner, prompts, reference) -> None:
    """All 28 at once (batches of up to 16 rows, chunked prefill beside decodes), prefix caching on, twice:
    the second time the prompts' full blocks come from the cache and only their tails are computed."""
    eng = Engine(runner, max_num_seqs=16, enable_prefix_caching=True)
    items = _requests(prompts)
    assert _run(eng, items) == reference
    hits = eng.stats().prefix_cache_hits
    assert _run(eng, items) == reference
    assert eng.stats().prefix_cache_hits - hits >= sum((len(p) - 1) // 16 * 16 for p, _ in items)


def test_preemption_forced(runner, prompts, reference) -> None:
    items = _requests(prompts)
    short = [i for i, (p, _) in enumerate(items) if len(p) < 200]
    need = max(-(-(len(items[i][0]) + NEW_TOKENS) // runner.block_size) for i in short)
    eng = Engine(runner, num_kv_blocks=3 * need, enable_prefix_caching=False)
    got = _run(eng, [items[i] for i in short])
    assert eng.stats().preemptions > 0
    assert got == [reference[i] for i in short]
