"""``Submit.inspect``: each choice's last output carries its ``Timeline`` (prompt chunks, first token, decode
steps, preemptions, finish), consistent with its ``Timings`` and ``Usage``; nothing without the flag; every
list bounded."""

from __future__ import annotations

import pytest

from backend import cpu_kernels
from backend.engine import Engine, final_output
from backend.model_runner import ModelRunner
from backend.protocol import SamplingParams, Submit
from backend.sequence import SeqTimeline


@pytest.fixture(scope="module")
def runner(model_path):
    """float32, every row through the row-invariant int4 kernel where it is built (else the exact mode)."""
    int4 = cpu_kernels.q4_ready()
    return ModelRunner(model_path, num_kv_blocks=64, generated_int4=int4, prompt_int4=int4)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def test_timeline_of_chunked_prefill_and_n2(runner, chat_fixtures):
    ids = chat_fixtures[0]["prompt_ids"]
    eng = Engine(runner, max_num_seqs=4, max_num_batched_tokens=16, long_prefill_token_threshold=16)
    res = eng.generate(
        [
            Submit(request_id="a", prompt_ids=ids, sampling=_greedy(max_tokens=4, n=2), inspect=True),
            Submit(request_id="b", prompt_ids=ids, sampling=_greedy(max_tokens=3)),
        ]
    )
    assert final_output(res["b"]).timeline is None  # not asked: nothing recorded
    for index in (0, 1):
        fin = final_output(res["a"], index)
        tl, tm = fin.timeline, fin.timings
        assert tl is not None and fin.finish_reason == "length"
        # the prompt was computed in chunks of at most 16 tokens, in order, each after the last; the forked
        # choice shares them and computes the tail of the partial block again with its first token
        computed = sum(n for _, _, n in tl.chunks)
        if index == 0:
            assert computed == len(ids) - fin.usage.cached_tokens
        else:
            assert computed == len(ids) + 1 + len(ids) % runner.block_size
        assert len(tl.chunks) >= (len(ids) - fin.usage.cached_tokens + 15) // 16 and len(tl.chunks) > 1
        assert all(0 <= s <= e for s, e, _ in tl.chunks)
        assert all(a[1] <= b[0] for a, b in zip(tl.chunks, tl.chunks[1:]))
        assert tl.chunks[0][0] == pytest.approx(tm.queue)
        assert len(tl.decode) == fin.usage.completion_tokens - 1
        times = [tl.first_token, *tl.decode, tl.finish]
        shared = tl.chunks if index == 0 else tl.chunks[:-1]  # the parent's chunks, before the first token
        assert times == sorted(times) and shared[-1][1] <= tl.first_token
        assert tl.preemptions == [] and tl.dropped == 0
    assert final_output(res["a"], 0).timeline.first_token == final_output(res["a"], 0).timings.ttft


def test_timeline_lists_preemptions(runner, chat_fixtures):
    bs = runner.block_size
    ids = chat_fixtures[0]["prompt_ids"][: bs - 2]  # one block each at first, a second one after 2 tokens
    # two sequences of two blocks do not fit; no prefix cache: a preempted sequence computes everything again
    eng = Engine(runner, max_num_seqs=4, num_kv_blocks=3, enable_prefix_caching=False)
    subs = [
        Submit(request_id=r, prompt_ids=ids, sampling=_greedy(max_tokens=4), cache_salt=r, inspect=True)
        for r in ("a", "b")
    ]
    res = eng.generate(subs)
    fins = [final_output(res[r]) for r in ("a", "b")]
    pre = [f.timeline.preemptions for f in fins]
    assert sum(f.timings.preemptions for f in fins) >= 1
    assert [len(p) for p in pre] == [f.timings.preemptions for f in fins]
    # a preempted choice's tokens are computed again after its preemption, in a chunk
    victim = next(f.timeline for f in fins if f.timeline.preemptions)
    assert victim.first_token < victim.preemptions[0] < victim.finish
    assert [n for s, _, n in victim.chunks if s >= victim.preemptions[0]][0] > len(ids)
    assert all(len(f.timeline.decode) == 3 for f in fins)


def test_timeline_lists_are_bounded():
    t = SeqTimeline(arrival=10.0, limit=3)
    for i in range(5):
        t.token(10.0 + i)
        t.chunk(10.0 + i, 10.5 + i, 4)
    assert t.first_token == 0.0 and t.decode == [1.0, 2.0, 3.0]
    assert t.chunks == [(0.0, 0.5, 4), (1.0, 1.5, 4), (2.0, 2.5, 4)]
    assert t.dropped == 3  # one decode step, two chunks
    child = t.fork()
    assert child.chunks == t.chunks and child.chunks is not t.chunks and child.first_token is None
