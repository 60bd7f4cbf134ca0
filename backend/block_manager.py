"""Paged KV-cache bookkeeping: a fixed pool of blocks, reference counts, prefix cache.

The model runner preallocates ``num_blocks`` KV blocks of ``block_size``
tokens each; this module decides which sequence owns which block. It never
touches tensors (plain Python, no torch).

* Free list + reference counts: a block is owned by ``ref_count`` sequences
  (more than one after a prefix-cache hit or an ``n > 1`` fork).
* Automatic prefix caching: once a block is full and its K/V computed it is
  registered under a chained key ``hash((parent_key, cache_salt, token_ids))``.
  A new sequence's leading full blocks are looked up by that chain; a hit is
  verified against the stored token ids and parent key (a hash collision can
  never serve wrong K/V). At least the last token of the sequence is always
  left to compute, so the model produces logits for it.
* Eviction: a block whose ``ref_count`` drops to 0 keeps its content and key
  and goes to an LRU list of *cached free* blocks; empty blocks are handed
  out first, then the least recently freed cached block is evicted.

Source followed: vLLM PagedAttention (Kwon et al., SOSP 2023,
https://arxiv.org/abs/2309.06180) and vLLM's automatic prefix caching
(https://docs.vllm.ai/en/latest/design/prefix_caching.html); nano-vllm's
``BlockManager``.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from backend.sequence import Sequence

_ROOT_KEY = 0x5EED  # parent key of a sequence's first block


class NoFreeBlocks(Exception):
    """The pool cannot supply the blocks asked for (the caller preempts or waits)."""


class BlockManager:
    """Owner of the block pool's metadata.

    Args:
        num_blocks: blocks in the pool (the runner's ``num_kv_blocks``).
        block_size: tokens per block.
        enable_prefix_caching: register and look up full blocks.
        cache_generated: register blocks that hold generated tokens too (vLLM does). False when the model
            computes generated tokens in another weight format than prompt tokens: only blocks made of
            prompt tokens alone are registered, so a hit gives a prompt the K/V it would compute itself.

    Counters (tokens): ``prefix_cache_queries`` (tokens looked up at admission),
    ``prefix_cache_hits`` (tokens served from cache); both counted only when
    the admission actually takes the blocks (``admit``).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        cache_generated: bool = True,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_generated = cache_generated
        self.ref_count = [0] * num_blocks
        self.block_key: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.block_parent: list[int | None] = [None] * num_blocks
        self.key_to_block: dict[int, int] = {}
        self.free_empty: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ gauges

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty + evictable cached)."""
        return len(self.free_empty) + len(self.free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.free_cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ internals

    def _take_free(self) -> int:
        if self.free_empty:
            b = self.free_empty.popleft()
        elif self.free_cached:
            b, _ = self.free_cached.popitem(last=False)
            self._uncache(b)
        else:
            raise NoFreeBlocks("KV block pool exhausted")
        self.ref_count[b] = 1
        return b

    def _uncache(self, b: int) -> None:
        key = self.block_key[b]
        if key is not None and self.key_to_block.get(key) == b:
            del self.key_to_block[key]
        self.block_key[b] = None
        self.block_tokens[b] = None
        self.block_parent[b] = None

    def _incref(self, b: int) -> None:
        if self.ref_count[b] == 0:
            del self.free_cached[b]
        self.ref_count[b] += 1

    def _decref(self, b: int) -> None:
        rc = self.ref_count[b] - 1
        if rc < 0:
            raise AssertionError(f"block {b} freed twice")
        self.ref_count[b] = rc
        if rc == 0:
            if self.block_key[b] is not None:
                self.free_cached[b] = None  # most recently used end
            else:
                self.free_empty.append(b)

    def _key(self, parent: int, salt: str, tokens: tuple[int, ...]) -> int:
        return hash((parent, salt, tokens))

    # ------------------------------------------------------------------ prefix cache

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for ``seq``'s leading full blocks (no references taken).

        Leaves at least the last token uncovered. Returns the block ids, in order;
        empty when prefix caching is off. Cost: one hash per full block.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        tokens = seq.token_ids
        max_blocks = (len(tokens) - 1) // bs
        parent = _ROOT_KEY
        out: list[int] = []
        for i in range(max_blocks):
            toks = tuple(tokens[i * bs : (i + 1) * bs])
            key = self._key(parent, seq.cache_salt, toks)
            b = self.key_to_block.get(key)
            if b is None or self.block_tokens[b] != toks or self.block_parent[b] != parent:
                break
            out.append(b)
            parent = key
        return out

    def admit(self, seq: Sequence, cached: list[int]) -> int:
        """Give a waiting ``seq`` the cached blocks ``cached`` (from ``match_prefix``).

        Sets ``block_table``, ``block_hashes`` and ``num_computed_tokens``, counts
        ``prefix_cache_queries/hits``. Returns the number of tokens served from cache.
        """
        assert not seq.block_table, "admit() of a sequence that holds blocks"
        for b in cached:
            self._incref(b)
        seq.block_table = list(cached)
        seq.block_hashes = [self.block_key[b] for b in cached]  # type: ignore[misc]
        n = len(cached) * self.block_size
        seq.num_computed_tokens = n
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(seq.token_ids)
            self.prefix_cache_hits += n
        return n

    # ------------------------------------------------------------------ slots

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` must still get to hold its first ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens.

        Raises:
            NoFreeBlocks: not enough free blocks (nothing is allocated then).
        """
        need = self.num_new_blocks(seq, num_tokens)
        if need > self.num_free_blocks:
            raise NoFreeBlocks(f"need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references (tail first, so tail blocks are evicted first)."""
        for b in reversed(seq.block_table):
            self._decref(b)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back ``seq``'s tail blocks past those holding its first ``num_tokens`` tokens.

        Used after speculative verification: the slots of rejected draft tokens were written but are not
        computed tokens. The blocks given back were never registered (they hold no full computed block).
        """
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._decref(seq.block_table.pop())
        del seq.block_hashes[len(seq.block_table) :]

    def register_computed(self, seq: Sequence) -> None:
        """Register ``seq``'s newly full and computed blocks in the prefix cache.

        Call after the step that computed them. Cost: one hash per new full block.
        If an equal block is already registered, the existing entry is kept.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if not self.cache_generated:
            full = min(full, seq.num_prompt_tokens // bs)
        hashes = seq.block_hashes
        tokens = seq.token_ids
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_KEY
            toks = tuple(tokens[i * bs : (i + 1) * bs])
            key = self._key(parent, seq.cache_salt, toks)
            hashes.append(key)
            b = seq.block_table[i]
            if self.block_key[b] is None and key not in self.key_to_block:
                self.block_key[b] = key
                self.block_tokens[b] = toks
                self.block_parent[b] = parent
                self.key_to_block[key] = b

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share ``parent``'s full computed blocks with ``child`` (copy-on-write).

        The child gets references to the parent's leading *full* computed blocks;
        the partially filled last block is not shared: the child recomputes
        those (< ``block_size``) tokens into a block of its own, which is the
        copy of copy-on-write done by the model instead of a memory copy.
        Sets ``child.num_computed_tokens``.
        """
        assert not child.block_table
        full = min(parent.num_computed_tokens // self.block_size, len(parent.block_table))
        shared = parent.block_table[:full]
        for b in shared:
            self._incref(b)
        child.block_table = list(shared)
        child.block_hashes = list(parent.block_hashes[:full])
        child.num_computed_tokens = full * self.block_size

    # ------------------------------------------------------------------ checks

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Assert refcounts equal the number of owning sequences and no block is lost.

        Raises:
            AssertionError: an inconsistency (used by tests).
        """
        owners = [0] * self.num_blocks
        for s in seqs:
            assert len(set(s.block_table)) == len(s.block_table), f"duplicate block in {s}"
            for b in s.block_table:
                owners[b] += 1
        assert owners == self.ref_count, "refcounts differ from owners"
        free = set(self.free_empty) | set(self.free_cached)
        assert len(free) == len(self.free_empty) + len(self.free_cached), "block on two free lists"
        for b in range(self.num_blocks):
            assert (b in free) == (self.ref_count[b] == 0), f"block {b} free-list/refcount mismatch"
        for b in self.free_cached:
            assert self.block_key[b] is not None
        for key, b in self.key_to_block.items():
            assert self.block_key[b] == key
