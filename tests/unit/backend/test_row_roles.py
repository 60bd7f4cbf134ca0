"""Generated rows in the packed int4 format, prompt rows dense (``generated_int4``, ``RowRoles``): a row's
bits follow its token's role, never the step.

Through the real ``ModelRunner`` and the real model (bfloat16, one thread): the logits of one generated
token are identical computed alone in a decode step, beside other decodes and a prefill chunk, and
recomputed inside a prefill after preemption; the block manager then keeps generated blocks out of the
prefix cache.
"""

from __future__ import annotations

import pytest
import torch

from backend.batch import SeqChunk
from backend.block_manager import BlockManager
from backend.model_runner import ModelRunner
from backend.sequence import Sequence

BS = 16


@pytest.fixture(scope="module")
def runner(model_path):
    threads = torch.get_num_threads()
    yield ModelRunner(
        model_path, dtype="bfloat16", block_size=BS, num_kv_blocks=96, num_threads=1, generated_int4=True
    )
    torch.set_num_threads(threads)


def _blocks(i: int) -> list[int]:
    return list(range(i * 8, (i + 1) * 8))


def test_generated_row_is_the_same_alone_batched_and_recomputed(runner, chat_fixtures):
    assert runner.generated_int4 and runner.model.lm_head.w8 is not None
    prompt = chat_fixtures[0]["prompt_ids"][:40]
    P = len(prompt)
    nxt = 1234  # the "sampled" first token, at position P
    runner.execute([SeqChunk(token_ids=prompt, start_pos=0, block_table=_blocks(0), prompt_len=P)])
    alone = runner.execute([SeqChunk(token_ids=[nxt], start_pos=P, block_table=_blocks(0), prompt_len=P)])

    # the same token again (its K/V slot rewritten with the same bits), beside 4 decodes and a prefill chunk
    others = [
        SeqChunk(token_ids=[100 + i], start_pos=20, block_table=_blocks(i + 2), prompt_len=10)
        for i in range(4)
    ]
    fill = SeqChunk(token_ids=prompt[:30], start_pos=0, block_table=_blocks(7), prompt_len=30)
    mine = SeqChunk(token_ids=[nxt], start_pos=P, block_table=_blocks(0), prompt_len=P)
    batched = runner.execute([others[0], mine, *others[1:], fill])
    assert torch.equal(batched[1], alone[0])

    # recompute after preemption: prompt and generated token in one prefill, in fresh blocks
    again = runner.execute(
        [SeqChunk(token_ids=prompt + [nxt], start_pos=0, block_table=_blocks(1), prompt_len=P)]
    )
    assert torch.equal(again[0], alone[0])

    # the role matters: the same row computed as a prompt row takes the dense weights
    dense = runner.execute([SeqChunk(token_ids=prompt + [nxt], start_pos=0, block_table=_blocks(1))])
    assert not torch.equal(dense[0], alone[0])


def test_generated_blocks_stay_out_of_the_prefix_cache():
    bm = BlockManager(8, 4, cache_generated=False)
    seq = Sequence(list(range(10)), num_prompt_tokens=6)  # blocks: [0..3] prompt, [4..7] straddles, [8, 9]
    bm.allocate(seq, 10)
    seq.num_computed_tokens = 10
    bm.register_computed(seq)
    assert len(seq.block_hashes) == 1  # only the block of prompt tokens alone
    both = BlockManager(8, 4)
    seq2 = Sequence(list(range(10)), num_prompt_tokens=6)
    both.allocate(seq2, 10)
    seq2.num_computed_tokens = 10
    both.register_computed(seq2)
    assert len(seq2.block_hashes) == 2
