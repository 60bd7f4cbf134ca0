"""Block manager unit tests (plain Python, no torch): refcounts, prefix cache, salt, LRU eviction, fork."""

from __future__ import annotations

import pytest

from backend.block_manager import BlockManager, NoFreeBlocks
from backend.sequence import Sequence


def computed(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """Pretend the model computed ``n`` (default all) tokens of ``seq``."""
    n = len(seq.token_ids) if n is None else n
    bm.allocate(seq, n)
    seq.num_computed_tokens = n
    bm.register_computed(seq)


def test_allocate_free_refcounts():
    bm = BlockManager(4, 4)
    s = Sequence(list(range(10)))
    bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 1
    with pytest.raises(NoFreeBlocks):
        bm.allocate(s, 20)
    assert len(s.block_table) == 3  # nothing partially allocated
    bm.free(s)
    assert bm.num_free_blocks == 4 and sum(bm.ref_count) == 0
    bm.check_invariants([])


def test_prefix_hit_leaves_last_token_and_respects_salt():
    bm = BlockManager(16, 4)
    a = Sequence(list(range(12)), cache_salt="t1")
    computed(bm, a)
    assert len(a.block_hashes) == 3
    b = Sequence(list(range(12)), cache_salt="t1")
    hit = bm.match_prefix(b)
    assert len(hit) == 2  # 12 tokens = 3 full blocks, but the last token must be computed
    assert bm.admit(b, hit) == 8 and b.num_computed_tokens == 8
    assert bm.ref_count[hit[0]] == 2
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 12
    c = Sequence(list(range(12)), cache_salt="t2")
    assert bm.match_prefix(c) == []
    d = Sequence(list(range(8)) + [99, 98, 97, 96, 95], cache_salt="t1")
    assert bm.match_prefix(d) == hit  # diverges in block 3
    e = Sequence([0, 1, 2, 3, 9, 9, 9, 9, 9], cache_salt="t1")
    assert len(bm.match_prefix(e)) == 1
    bm.check_invariants([a, b])


def test_lru_eviction_and_verification():
    bm = BlockManager(4, 2)
    a = Sequence([1, 2, 3, 4, 5])
    computed(bm, a)
    bm.free(a)  # 2 full cached blocks + 1 empty go back
    assert bm.num_cached_free_blocks == 2 and bm.num_free_blocks == 4
    b = Sequence([1, 2, 3, 4, 7])
    hit = bm.match_prefix(b)
    assert len(hit) == 2
    # new work takes empty blocks first, then evicts the least recently freed cached block
    other = Sequence([9] * 6)
    bm.allocate(other, 6)
    assert bm.num_cached_free_blocks == 1
    # tail block (freed first) was evicted: only the first block still hits
    assert len(bm.match_prefix(b)) == 1
    # a forged key pointing at different tokens is never served
    blk = bm.match_prefix(b)[0]
    bm.block_tokens[blk] = (1, 999)
    assert bm.match_prefix(b) == []
    bm.check_invariants([other])


def test_fork_shares_full_blocks_only():
    bm = BlockManager(8, 4)
    p = Sequence(list(range(10)), pending_forks=1)
    computed(bm, p)
    c = Sequence(list(range(10)))
    bm.fork(p, c)
    assert c.block_table == p.block_table[:2] and c.num_computed_tokens == 8
    assert bm.ref_count[p.block_table[0]] == 2 and bm.ref_count[p.block_table[2]] == 1
    bm.allocate(c, 11)
    assert c.block_table[2] != p.block_table[2]
    bm.check_invariants([p, c])
    bm.free(p)
    bm.free(c)
    assert bm.num_used_blocks == 0
    bm.check_invariants([])
