"""Property tests of the plain-Python scheduler + block manager (no torch, no model).

The harness plays the model: every scheduled chunk "writes" its token ids
into a simulated KV pool at the slots its block table gives, and a chunk that
needs logits first checks that the pool holds exactly the sequence's tokens at
all its positions (so prefix-cache hits, forks and preemption-recompute must
serve the right content), then appends a deterministic next token (a function
of the sequence so far). Finished outputs must equal a reference run computed
without any scheduler.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.block_manager import BlockManager
from backend.scheduler import Scheduler
from backend.sequence import SeqStatus, Sequence


def next_token(tokens: list[int]) -> int:
    return (tokens[-1] * 31 + len(tokens) * 7 + (tokens[-2] if len(tokens) > 1 else 0)) % 50


def reference(prompt: list[int], max_tokens: int, choice: int) -> list[int]:
    toks = list(prompt)
    for k in range(max_tokens):
        t = next_token(toks)
        if k == 0:
            t = (t + choice) % 50  # choices differ at their first token
        toks.append(t)
    return toks


class Harness:
    def __init__(self, num_blocks: int, block_size: int, caching: bool, max_seqs: int, budget: int) -> None:
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
        self.kv: list[int | None] = [None] * (num_blocks * block_size)
        self.live: dict[int, list[Sequence]] = {}  # request -> its sequences
        self.done: dict[int, list[tuple[list[int], int]]] = {}
        self.aborted: set[int] = set()
        self.meta: dict[int, tuple[list[int], int, int]] = {}
        self.next_req = 0
        self.steps_since_progress = 0

    def submit(self, prompt: list[int], max_tokens: int, n: int, salt: str) -> None:
        rid = self.next_req
        self.next_req += 1
        seq = Sequence(prompt, cache_salt=salt, max_tokens=max_tokens, pending_forks=n - 1, request=rid)
        self.live[rid] = [seq]
        self.meta[rid] = (prompt, max_tokens, n)
        self.done[rid] = []
        self.sched.add(seq)

    def abort(self, rid: int) -> None:
        for s in self.live.pop(rid, []):
            self.sched.finish(s)
        self.aborted.add(rid)

    def _finish(self, seq: Sequence) -> None:
        self.sched.finish(seq)
        rid = seq.request
        self.done[rid].append((list(seq.token_ids), seq.index))
        self.live[rid].remove(seq)
        if not self.live[rid]:
            del self.live[rid]

    def step(self) -> None:
        out = self.sched.schedule()
        bs = self.bm.block_size
        self.sched.check_invariants()
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        assert len(out.chunks) <= self.sched.max_num_seqs
        seen = set()
        for ch in out.chunks:
            s = ch.seq
            assert s.seq_id not in seen
            seen.add(s.seq_id)
            assert ch.start == s.num_computed_tokens and ch.num_tokens >= 1
            assert len(s.block_table) * bs >= ch.start + ch.num_tokens
            for p in range(ch.start, ch.start + ch.num_tokens):
                self.kv[s.block_table[p // bs] * bs + p % bs] = s.token_ids[p]
        if not out.chunks:
            assert not self.sched.has_work() or False, "no progress with work queued"
        self.sched.update_after_step(out)
        for ch in out.chunks:
            s = ch.seq
            if not ch.need_logits or s.status is not SeqStatus.RUNNING:
                continue
            # the cache must hold exactly this sequence's tokens
            for p in range(len(s.token_ids)):
                assert self.kv[s.block_table[p // bs] * bs + p % bs] == s.token_ids[p], (s, p)
            t = next_token(s.token_ids)
            if s.num_generated == 0:
                choices = [s]
                if s.pending_forks:
                    kids = []
                    for i in range(1, s.pending_forks + 1):
                        c = Sequence(
                            s.token_ids,
                            cache_salt=s.cache_salt,
                            max_tokens=s.max_tokens,
                            request=s.request,
                            index=i,
                        )
                        kids.append(c)
                    self.sched.fork(s, kids)
                    self.live[s.request].extend(kids)
                    choices += kids
                for c in choices:
                    c.token_ids.append((t + c.index) % 50)
                    if c.num_generated >= c.max_tokens:
                        self._finish(c)
            else:
                s.token_ids.append(t)
                if s.num_generated >= s.max_tokens:
                    self._finish(s)
        self.sched.check_invariants()


@st.composite
def ops(draw):
    n = draw(st.integers(5, 60))
    out = []
    for _ in range(n):
        kind = draw(st.sampled_from(["submit", "submit", "step", "step", "step", "abort"]))
        if kind == "submit":
            plen = draw(st.integers(1, 70))
            base = draw(st.sampled_from([[1, 2, 3] * 30, [4, 5] * 40, [7] * 80]))
            prompt = base[: plen // 2] + draw(
                st.lists(st.integers(0, 49), min_size=plen - plen // 2, max_size=plen - plen // 2)
            )
            out.append(
                (
                    "submit",
                    prompt,
                    draw(st.integers(1, 20)),
                    draw(st.integers(1, 3)),
                    draw(st.sampled_from(["", "a"])),
                )
            )
        elif kind == "abort":
            out.append(("abort", draw(st.integers(0, 40))))
        else:
            out.append(("step", draw(st.integers(1, 6))))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops(),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 4, 16]),
    caching=st.booleans(),
    max_seqs=st.integers(3, 8),
    budget=st.integers(8, 64),
)
def test_random_traffic_no_leaks_and_exact_outputs(ops, num_blocks, block_size, caching, max_seqs, budget):
    h = Harness(num_blocks, block_size, caching, max_seqs, budget)
    for op in ops:
        if op[0] == "submit":
            _, prompt, max_tokens, n, salt = op
            # the engine rejects what could never fit the pool alone
            if -(-(len(prompt) + max_tokens) // block_size) > num_blocks or n > max_seqs:
                continue
            h.submit(prompt, max_tokens, n, salt)
        elif op[0] == "abort":
            if op[1] in h.live:
                h.abort(op[1])
        else:
            for _ in range(op[1]):
                h.step()
    # drain: everything must finish, no livelock
    for _ in range(20000):
        if not h.sched.has_work():
            break
        h.step()
    assert not h.sched.has_work(), "livelock"
    assert h.bm.num_used_blocks == 0
    assert sum(h.bm.ref_count) == 0
    h.bm.check_invariants([])
    for rid, (prompt, max_tokens, n) in h.meta.items():
        if rid in h.aborted:
            continue
        got = sorted(h.done[rid], key=lambda x: x[1])
        assert [i for _, i in got] == list(range(n))
        for toks, i in got:
            assert toks == reference(prompt, max_tokens, i)


def test_chunked_prefill_does_not_block_decodes_or_short_prompt():
    """Chunked prefill alternates with decodes (scheduler level): a 7,000-token prompt, a running stream and a
    late short request; neither the stream nor the short request waits for the whole long prefill."""
    bm = BlockManager(600, 16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=512)
    stream = Sequence(list(range(20)), max_tokens=1000)
    sched.add(stream)
    out = sched.schedule()
    sched.update_after_step(out)
    stream.token_ids.append(1)
    long = Sequence([3] * 7000, max_tokens=4)
    sched.add(long)
    short = None
    stream_gaps = []
    for step in range(40):
        if step == 3:
            short = Sequence([5] * 10, max_tokens=4)
            sched.add(short)
            arrived = step
        out = sched.schedule()
        assert out.num_tokens <= 512
        ids = {c.seq.seq_id for c in out.chunks}
        stream_gaps.append(stream.seq_id in ids)
        sched.update_after_step(out)
        for c in out.chunks:
            if c.need_logits:
                c.seq.token_ids.append(1)
                if c.seq is short and short.num_generated == 1:
                    short_first = step
    assert all(stream_gaps), "the running stream skipped a step"
    assert short_first - arrived == 0, "short request waited behind the long prefill"
    assert long.num_generated > 0, "the long prompt finished its prefill"
    sched.check_invariants()
