"""Sampler semantics on the real model's logits (CPU, fp32).

Seeds reproducible across batch compositions, fresh seeds differ, penalties count
generated tokens only, EOS/stop never penalised, logprobs from the raw distribution,
min_tokens, logit_bias, greedy never touching a generator.
"""

from __future__ import annotations

import json

import pytest
import torch

from backend import cpu_kernels
from backend.batch import SeqChunk
from backend.engine import Engine, collect_tokens, final_output
from backend.model_runner import ModelRunner
from backend.protocol import SamplingParams, Submit
from backend.sampling import ChoiceState, process_logits, sample

pytestmark = pytest.mark.slow
EOS = 2


@pytest.fixture(scope="module")
def runner(model_path):
    """float32, every row through the row-invariant int4 kernel where it is built (else the exact mode)."""
    int4 = cpu_kernels.q4_ready()
    return ModelRunner(model_path, num_kv_blocks=128, generated_int4=int4, prompt_int4=int4)


@pytest.fixture(scope="module")
def prompt(chat_fixtures):
    c = chat_fixtures[0]
    return json.loads(c["prompt_ids"]) if isinstance(c["prompt_ids"], str) else c["prompt_ids"]


@pytest.fixture(scope="module")
def apple_prompt(prompt):
    # the ChatML prompt (contains <|im_end|> = 2) with one word repeated 20 times in the user turn
    return prompt[:-5] + [30404] * 20 + prompt[-5:]


@pytest.fixture(scope="module")
def logits(runner, apple_prompt):
    n = len(apple_prompt)
    return runner.execute([SeqChunk(apple_prompt, 0, list(range(-(-n // 16))), True)])[0:1].clone()


def st(p, prompt_ids, **kw):
    return ChoiceState(SamplingParams(**kw), 0, prompt_ids, 49152, [EOS])


def test_presence_frequency_count_generated_only(logits, apple_prompt):
    """Penalties ignore the prompt: first-step logits identical with frequency/presence penalty 2 vs 0."""
    base = process_logits(logits, [st(None, apple_prompt, temperature=0)])
    pen = process_logits(
        logits, [st(None, apple_prompt, temperature=0, frequency_penalty=2.0, presence_penalty=2.0)]
    )
    assert torch.equal(base, pen)
    s = st(None, apple_prompt, temperature=0, frequency_penalty=2.0, presence_penalty=1.0)
    s.append(30404)
    s.append(30404)
    s.append(EOS)  # EOS is never penalised
    out = process_logits(logits, [s])
    diff = (logits - out)[0]
    assert diff[30404].item() == pytest.approx(2 * 2.0 + 1.0)
    assert diff[EOS].item() == 0.0
    assert torch.count_nonzero(diff).item() == 1


def test_repetition_penalty_covers_prompt_but_not_eos(logits, apple_prompt):
    s = st(None, apple_prompt, temperature=0, repetition_penalty=1.3)
    out = process_logits(logits, [s])[0]
    l0 = logits[0]
    assert out[EOS].item() == l0[EOS].item()  # <|im_end|> is in the prompt but never penalised
    t = 30404
    exp = l0[t] / 1.3 if l0[t] > 0 else l0[t] * 1.3
    assert out[t].item() == pytest.approx(exp.item())
    not_seen = 12345
    assert out[not_seen].item() == l0[not_seen].item()


def test_greedy_never_touches_a_generator_and_rows_are_independent(logits):
    s_greedy = st(None, [1], temperature=0)
    assert s_greedy.generator is None
    two = logits.repeat(3, 1)
    a = st(None, [1], temperature=0.9, seed=11)
    alone, _ = sample(logits, [a])
    b = st(None, [1], temperature=0.9, seed=11)
    mixed, _ = sample(two, [st(None, [1], temperature=0), b, st(None, [1], temperature=1.5, top_k=5)])
    assert mixed[1] == alone[0]
    assert mixed[0] == int(torch.argmax(logits[0]))
    k1, _ = sample(logits, [st(None, [1], temperature=1.0, top_k=1, seed=3)])
    p0, _ = sample(logits, [st(None, [1], temperature=1.0, top_p=1e-6, seed=3)])
    assert k1[0] == p0[0] == int(torch.argmax(logits[0]))


def test_logprobs_are_raw_top20(runner, prompt):
    n = len(prompt)
    raw = torch.log_softmax(runner.execute([SeqChunk(prompt, 0, list(range(-(-n // 16))), True)])[0], dim=-1)
    eng = Engine(runner)
    sp = SamplingParams(
        temperature=0.7,
        seed=1,
        max_tokens=1,
        logprobs=True,
        top_logprobs=20,
        logit_bias={504: -50.0},
        frequency_penalty=1.0,
        top_k=3,
    )
    res = eng.generate([Submit(request_id="lp", prompt_ids=prompt, sampling=sp)])
    fin = final_output(res["lp"])
    (lp,) = fin.logprobs
    vals, ids = torch.topk(raw, 20)
    assert [t for t, _ in lp.top] == ids.tolist()
    assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-4)
    assert lp.logprob == pytest.approx(raw[lp.token_id].item(), abs=1e-4)
    assert lp.token_id != 504  # the bias applied to sampling, not to the reported distribution


def test_min_tokens_and_logit_bias(runner, prompt):
    eng = Engine(runner)
    sp = SamplingParams(temperature=0, max_tokens=10, min_tokens=3, logit_bias={EOS: 100.0})
    res = eng.generate([Submit(request_id="m", prompt_ids=prompt, sampling=sp)])
    fin = final_output(res["m"])
    toks = collect_tokens(res["m"])
    assert len(toks) == 3 and EOS not in toks
    assert fin.finish_reason == "stop" and fin.stop_token_id == EOS and fin.usage.completion_tokens == 4
    sp = SamplingParams(temperature=0, max_tokens=5, logit_bias={4093: 100.0})
    res = eng.generate([Submit(request_id="b", prompt_ids=prompt, sampling=sp)])
    assert collect_tokens(res["b"]) == [4093] * 5 and final_output(res["b"]).finish_reason == "length"
    # stop_token_ids end a choice like EOS; ignore_eos keeps going through EOS
    sp = SamplingParams(temperature=0, max_tokens=5, logit_bias={4093: 100.0}, stop_token_ids=[4093])
    res = eng.generate([Submit(request_id="s", prompt_ids=prompt, sampling=sp)])
    fin = final_output(res["s"])
    assert collect_tokens(res["s"]) == [] and fin.stop_token_id == 4093 and fin.finish_reason == "stop"
    sp = SamplingParams(temperature=0, max_tokens=4, logit_bias={EOS: 100.0}, ignore_eos=True)
    res = eng.generate([Submit(request_id="i", prompt_ids=prompt, sampling=sp)])
    assert collect_tokens(res["i"]) == [EOS] * 4 and final_output(res["i"]).finish_reason == "length"


def test_seeds_reproducible_across_batches_and_fresh_seeds_differ(runner, prompt, apple_prompt):
    """Same seed -> same tokens whatever the batch; no seed -> different; any int seed accepted."""

    def sp(seed, n=1):
        return SamplingParams(temperature=0.8, max_tokens=8, seed=seed, n=n)

    eng = Engine(runner)
    alone = eng.generate([Submit(request_id="a", prompt_ids=prompt, sampling=sp(7))])
    ref = collect_tokens(alone["a"])
    batch = eng.generate(
        [
            Submit(
                request_id="x",
                prompt_ids=apple_prompt,
                sampling=SamplingParams(temperature=1.0, max_tokens=12),
            ),
            Submit(request_id="a", prompt_ids=prompt, sampling=sp(7)),
            Submit(
                request_id="y", prompt_ids=prompt[:9], sampling=SamplingParams(temperature=0, max_tokens=3)
            ),
            Submit(request_id="neg", prompt_ids=prompt, sampling=sp(-2)),
            Submit(request_id="huge", prompt_ids=prompt, sampling=sp(2**70)),
        ]
    )
    assert collect_tokens(batch["a"]) == ref
    assert final_output(batch["neg"]).finish_reason is not None
    again = eng.generate([Submit(request_id="neg", prompt_ids=prompt, sampling=sp(-2))])
    assert collect_tokens(again["neg"]) == collect_tokens(batch["neg"])
    free = eng.generate(
        [
            Submit(
                request_id=f"f{i}", prompt_ids=prompt, sampling=SamplingParams(temperature=0.8, max_tokens=8)
            )
            for i in range(3)
        ]
    )
    outs = {tuple(collect_tokens(free[f"f{i}"])) for i in range(3)}
    assert len(outs) > 1, "requests without a seed gave identical outputs"
    assert eng.stats().kv_blocks_used == 0


def test_filtered_rows_do_not_depend_on_the_batch():
    """A top-p / min-p row draws the same tokens alone and beside a row with a wide top-k (the candidate
    count was the batch's largest top-k, which changed the row's renormalisation)."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 49152, generator=gen) * 3.0
    for kw in ({"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 40, "top_p": 0.95}):
        alone = st(None, [1], temperature=0.8, seed=5, **kw)
        mixed = st(None, [1], temperature=0.8, seed=5, **kw)
        wide = st(None, [1], temperature=1.0, seed=6, top_k=3000)
        plain = st(None, [1], temperature=1.0, seed=7)
        a, b = [], []
        for i in range(3):
            for _ in range(10):  # each draw at the next position (its own random number)
                (t,), _ = sample(rows[i : i + 1], [alone])
                alone.append(t)
                a.append(t)
                ts, _ = sample(rows[i].repeat(3, 1), [wide, mixed, plain])
                for s, t in zip((wide, mixed, plain), ts):
                    s.append(t)
                b.append(ts[1])
        assert a == b, kw
        assert len(set(a)) > 1, kw  # the positions drew different numbers
