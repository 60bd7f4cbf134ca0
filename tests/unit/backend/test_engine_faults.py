"""A failure midway through a step's sampling must not swallow outputs already produced in that step."""

from __future__ import annotations

import pytest

from backend import cpu_kernels
from backend.engine import Engine
from backend.model_runner import ModelRunner
from backend.protocol import RequestError, RequestOutput, SamplingParams, Submit


@pytest.fixture(scope="module")
def runner(model_path):
    """float32, every row through the row-invariant int4 kernel where it is built (else the exact mode)."""
    int4 = cpu_kernels.q4_ready()
    return ModelRunner(model_path, num_kv_blocks=64, generated_int4=int4, prompt_int4=int4)


def test_finished_request_keeps_its_final_output_when_a_later_one_fails(runner, chat_fixtures):
    ids = chat_fixtures[0]["prompt_ids"]
    eng = Engine(runner)
    greedy = dict(temperature=0.0, ignore_eos=True)
    assert (
        eng.add_request(
            Submit(request_id="a", prompt_ids=ids, sampling=SamplingParams(max_tokens=1, **greedy))
        )
        is None
    )
    assert (
        eng.add_request(
            Submit(request_id="b", prompt_ids=ids, sampling=SamplingParams(max_tokens=8, **greedy))
        )
        is None
    )

    state = eng.requests["b"].states[0]

    class Broken(type(state)):  # fault injection: b's bookkeeping fails after a's final token was produced
        __slots__ = ()

        def append(self, tok):
            raise RuntimeError("injected fault")

    state.__class__ = Broken
    msgs = []
    for _ in range(10):
        msgs += [m for _, m in eng.step()]
        if not eng.has_work():
            break
    finals_a = [
        m
        for m in msgs
        if isinstance(m, RequestOutput) and m.request_id == "a" and m.finish_reason is not None
    ]
    assert (
        len(finals_a) == 1 and finals_a[0].finish_reason == "length" and len(finals_a[0].new_token_ids) == 1
    )
    assert any(isinstance(m, RequestError) and m.request_id == "b" for m in msgs)
    st = eng.stats()
    assert st.running == 0 and st.waiting == 0 and st.kv_blocks_used == 0
