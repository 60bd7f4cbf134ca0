"""The scheduler's inter-token latency target (no torch, no model): the prefill budget rule, the online
step-time model, and a simulated machine whose step time is a known linear function of the plan.

A step of the simulated machine takes ``TRUE.predict(decodes, prefill tokens)`` seconds; the scheduler
only sees those times through ``Scheduler.observe``, as the engine feeds them.
"""

from __future__ import annotations

import random

import pytest

from backend.block_manager import BlockManager
from backend.scheduler import Scheduler, StepCost, prefill_budget
from backend.sequence import Sequence

TRUE = StepCost(base=0.010, per_decode=0.002, per_prefill=0.0009)  # seconds: a 512-token step ~0.47 s


def run_step(sched: Scheduler, machine: StepCost = TRUE) -> tuple[float, int, int]:
    """Plan, "execute" and account one step; returns (seconds, decodes, prefill tokens)."""
    out = sched.schedule()
    decodes = sum(1 for c in out.chunks if c.num_tokens == 1)
    seconds = machine.predict(decodes, out.num_tokens - decodes)
    sched.update_after_step(out)
    for c in out.chunks:
        if c.need_logits:
            c.seq.token_ids.append(7)
            if c.seq.num_generated >= c.seq.max_tokens:
                sched.finish(c.seq)
    sched.observe(out, seconds)
    return seconds, decodes, out.num_tokens - decodes


def start_decodes(sched: Scheduler, n: int, max_tokens: int = 10_000) -> list[Sequence]:
    seqs = [Sequence([1 + i, 2, 3, 4], max_tokens=max_tokens) for i in range(n)]
    for s in seqs:
        sched.add(s)
    run_step(sched)  # their prompts: from now on each is one decode a step
    return seqs


def test_budget_rule():
    cost = StepCost(base=0.01, per_decode=0.002, per_prefill=0.001)
    assert prefill_budget(cost, 0, 0.15, 500, 16) == 500  # no decode: nothing to protect
    assert prefill_budget(cost, 30, 0.0, 482, 16) == 482  # target off
    assert prefill_budget(cost, 30, 0.15, 482, 16) == 80  # (0.15 - 0.01 - 0.06) / 0.001
    assert prefill_budget(cost, 10, 0.15, 60, 16) == 60  # never over the step's token budget
    assert prefill_budget(cost, 80, 0.15, 432, 16) == 16  # decodes alone over the target: the floor
    assert prefill_budget(cost, 80, 0.15, 8, 16) == 8  # the floor never over the token budget


def test_step_cost_learns_a_linear_machine():
    rng = random.Random(0)
    cost = StepCost()  # priors far from TRUE
    for _ in range(400):
        d, p = rng.randint(0, 64), rng.choice([0, 0, 16, 64, 256, 512])
        cost.observe(d, p, TRUE.predict(d, p))
    for d, p in ((1, 0), (32, 0), (32, 128), (8, 512), (64, 64)):
        assert cost.predict(d, p) == pytest.approx(TRUE.predict(d, p), rel=0.05)


def test_step_cost_ignores_empty_steps():
    cost = StepCost()
    before = (cost.base, cost.per_decode, cost.per_prefill)
    cost.observe(0, 0, 0.5)
    cost.observe(4, 0, 0.0)
    assert (cost.base, cost.per_decode, cost.per_prefill) == before and cost.steps == 0


@pytest.mark.parametrize("target", [0.15, 0.10])
def test_decodes_stay_under_target_while_a_long_prompt_flows(target):
    """30 running decodes, then a 2,000-token prompt: with the target every step stays under it (after the
    model has seen a few steps) and the prompt still gets its first token; without it, steps run ~0.5 s."""
    bm = BlockManager(2000, 16)
    sched = Scheduler(bm, max_num_seqs=64, max_num_batched_tokens=512, itl_target_s=target, decode_share=2.0)
    start_decodes(sched, 30)
    for _ in range(20):  # decode-only steps: the model learns base + per_decode
        run_step(sched)
    long = Sequence([9] * 2000, max_tokens=4)
    sched.add(long)
    times = []
    for _ in range(200):
        seconds, decodes, _ = run_step(sched)
        assert decodes == 30
        times.append(seconds)
        if long.num_generated:
            break
    assert long.num_generated == 1, "the long prompt starved"
    assert max(times[5:]) <= target * 1.02, f"steps over the target: {sorted(times)[-3:]}"
    sched.check_invariants()

    off = Scheduler(BlockManager(2000, 16), max_num_seqs=64, max_num_batched_tokens=512)
    start_decodes(off, 30)
    off.add(Sequence([9] * 2000, max_tokens=4))
    assert run_step(off)[0] > 0.4  # the same step without a target: one 482-token chunk


def test_floor_keeps_prompts_flowing_when_decodes_fill_the_target():
    sched = known_machine(itl_target_s=0.05, decode_share=3.0, max_num_seqs=128)
    start_decodes(sched, 40)  # 0.09 s of decodes alone, over the 0.05 s target
    s = Sequence([5] * 100, max_tokens=2)
    sched.add(s)
    steps = 0
    while not s.num_generated:
        _, _, prefill = run_step(sched)
        assert prefill <= 16
        steps += 1
    assert steps == 7  # ceil(100 / 16)


def test_prefix_cache_hit_is_charged_only_for_uncached_tokens():
    """A request whose 608-token document is cached gets its first token in one step although the latency
    target leaves only ~50 prefill tokens: the cached blocks cost nothing, its 20 new tokens fit."""
    bm = BlockManager(2000, 16)
    cost = StepCost(**vars_of(TRUE))
    doc = [11] * 608  # 38 full blocks
    sched = Scheduler(bm, max_num_seqs=64, max_num_batched_tokens=512)
    first = Sequence(doc + [1] * 20, max_tokens=1, cache_salt="t")
    sched.add(first)
    while not first.num_generated:
        run_step(sched)
    sched = Scheduler(
        bm, max_num_seqs=64, max_num_batched_tokens=512, itl_target_s=0.11, decode_share=1.0, cost=cost
    )
    start_decodes(sched, 25)  # 0.06 s of decodes: room for (0.11 - 0.06) / 0.0009 = 55 prefill tokens
    second = Sequence(doc + [2] * 20, max_tokens=3, cache_salt="t")
    sched.add(second)
    out = sched.schedule()
    (chunk,) = [c for c in out.chunks if c.seq is second]
    assert chunk.start == 608 and chunk.num_tokens == 20 and chunk.need_logits
    sched.update_after_step(out)
    for c in out.chunks:
        c.seq.token_ids.append(7)
    uncached = Sequence([3] * 628, max_tokens=3, cache_salt="u")  # the same length, nothing cached
    sched.add(uncached)
    out = sched.schedule()
    (chunk,) = [c for c in out.chunks if c.seq is uncached]
    assert chunk.num_tokens <= 55


def test_admission_waits_while_the_decodes_would_fill_their_share():
    """Target 0.1 s, share 0.61: at most (0.061 - 0.010) / 0.002 = 25 decodes; the 26th waits until one ends."""
    sched = known_machine(itl_target_s=0.1, decode_share=0.61)
    seqs = [Sequence([1 + i, 2, 3, 4], max_tokens=5 if i == 0 else 10_000) for i in range(30)]
    for s in seqs:
        sched.add(s)
    for _ in range(3):
        run_step(sched)
    assert sched.num_running == 25 and sched.num_waiting == 5
    for _ in range(3):  # seqs[0] finishes after 5 tokens: one more is admitted
        run_step(sched)
    assert sched.num_running == 25 and sched.num_waiting == 4 and seqs[0].is_finished
    sched.check_invariants()


def test_admission_does_not_wait_on_a_machine_too_slow_for_the_target():
    """Four decodes alone take 0.4 s against a 0.15 s target (share 0.6): the target is out of reach, so
    waiting would only serialize the requests; all 30 are admitted at once (within ``max_num_seqs``)."""
    slow = StepCost(base=0.2, per_decode=0.05, per_prefill=0.001)
    sched = Scheduler(
        BlockManager(2000, 16), max_num_seqs=64, max_num_batched_tokens=512, itl_target_s=0.15, cost=slow
    )
    seqs = [Sequence([1 + i, 2, 3, 4], max_tokens=10_000) for i in range(30)]
    for s in seqs:
        sched.add(s)
    for _ in range(3):
        run_step(sched, slow)
    assert sched.num_running == 30 and sched.num_waiting == 0
    sched.check_invariants()


def known_machine(max_num_seqs: int = 64, **kw: float) -> Scheduler:
    """A scheduler over a fresh pool whose step-time model already knows ``TRUE``."""
    return Scheduler(
        BlockManager(2000, 16),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=512,
        cost=StepCost(**vars_of(TRUE)),
        **kw,
    )


def vars_of(cost: StepCost) -> dict[str, float]:
    return {"base": cost.base, "per_decode": cost.per_decode, "per_prefill": cost.per_prefill}
