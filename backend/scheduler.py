"""Iteration-level scheduler: continuous batching with chunked prefill and preemption.

Every engine step gets a token budget (``max_num_batched_tokens``) and a
sequence cap (``max_num_seqs``). One call to ``schedule()`` decides, in order:

1. **Running decodes** (running sequences with exactly one uncomputed token),
   oldest admission first. A decode that needs a new block and finds none
   preempts the most recently admitted running sequence (possibly itself).
   A decode that carries speculative draft tokens (``Sequence.draft``, set by the engine) then becomes a
   verify chunk of ``1 + len(draft)`` tokens, once every decode has its token: the drafts count against
   the token budget and are cut to what it and the empty blocks leave (a draft never preempts, never
   takes a decode's place and never evicts a prefix-cache block).
   After verification the engine calls ``accept_draft``: only the accepted drafts become computed
   tokens, the rejected ones' tail blocks go back to the pool, and no rejected token is ever hashed
   into the prefix cache.
2. **Prefill chunks**, first of running sequences whose (re)prefill is not
   done, then of waiting sequences admitted FCFS (the first one that does not
   fit stops admission: no overtaking, so no starvation). Each prefill gets at
   most ``long_prefill_token_threshold`` tokens in a first pass, so a long
   prompt never blocks a short one for more than one step; leftover budget
   then extends the chunks in order (a lone long prompt still uses the whole
   budget).

**Inter-token latency target** (``itl_target_s``, off when 0): each step's length is the gap between two
tokens of every running decode, so once decodes are scheduled the prefill tokens of the step are cut to
what ``StepCost`` predicts still fits under the target (``prefill_budget``), never under
``min_prefill_tokens`` (prompts keep flowing when decodes alone fill the target). With no decode in the
step there is nothing to protect and the whole budget goes to prefill. Admission also waits while the
running sequences plus the next would decode in more than ``decode_share`` of the target (each admitted
sequence makes every later step longer once it decodes; past that share the prefill would be starved),
unless ``min_admit_seqs`` decodes alone already take more than that share: then the target is out of this
machine's reach at any useful concurrency, and waiting would only serialize the requests (every queued one
paying in TTFT for an ITL the running ones miss anyway), so admission does not wait.
A prefix-cache hit is charged at
its real cost: admission schedules only the tokens after the cached blocks, so only uncached tokens count
against the budget. ``StepCost`` learns the step time from every step the engine ran (``observe``).

Preemption is by recompute: the victim's blocks are freed (full computed
blocks stay in the prefix cache when it is on), it keeps its token ids
(prompt + generated so far) and goes back to the front of the waiting queue
in admission order; re-admission recomputes them. Sampled tokens are never
re-emitted (the engine only emits newly sampled tokens).

After the model ran, ``update_after_step`` advances ``num_computed_tokens``
and registers new full blocks in the prefix cache.

Plain Python, no torch. Source followed: Orca (Yu et al., OSDI 2022) for
iteration-level scheduling; Sarathi-Serve (Agrawal et al., OSDI 2024,
https://arxiv.org/abs/2403.02310) for chunked prefills with decodes first;
vLLM v1's scheduler and nano-vllm's for preemption by recompute; Sarathi-Serve's stall-free batching for
sizing the prefill chunk to a latency target (there from an offline profile, here learned online).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from backend.block_manager import BlockManager
from backend.sequence import SeqStatus, Sequence


class StepCost:
    """Online linear model of one step's wall time: ``base + per_decode * decodes + per_prefill * tokens``.

    Fitted by normalized least mean squares (NLMS: one gradient step of size ``rate`` per observation,
    normalized by the squared feature norm, features scaled to about 1 at 32 decodes and 256 prefill
    tokens), so it tracks a machine whose speed changes (other processes taking the cores) and never
    winds up the way recursive least squares does on steps that all look alike. Coefficients stay at or
    above ``1e-6`` s. The priors are a bf16 step of the 135M model on 2 CPU cores; a few dozen steps
    replace them. Times in seconds.

    Source followed: Haykin, *Adaptive Filter Theory*, ch. 6 (NLMS).
    """

    __slots__ = ("base", "per_decode", "per_prefill", "rate", "steps")

    D_SCALE = 32.0
    P_SCALE = 256.0

    def __init__(
        self, base: float = 0.008, per_decode: float = 0.0015, per_prefill: float = 0.0008, rate: float = 0.3
    ) -> None:
        self.base, self.per_decode, self.per_prefill, self.rate = base, per_decode, per_prefill, rate
        self.steps = 0

    def predict(self, decodes: int, prefill_tokens: int) -> float:
        """Predicted wall time (s) of a step with ``decodes`` decode rows and ``prefill_tokens`` others."""
        return self.base + self.per_decode * decodes + self.per_prefill * prefill_tokens

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        """Move the model toward one measured step (``seconds`` of wall time)."""
        if seconds <= 0 or decodes + prefill_tokens <= 0:
            return
        x = (1.0, decodes / self.D_SCALE, prefill_tokens / self.P_SCALE)
        err = seconds - self.predict(decodes, prefill_tokens)
        g = self.rate * err / (x[0] ** 2 + x[1] ** 2 + x[2] ** 2)
        self.base = max(1e-6, self.base + g * x[0])
        self.per_decode = max(1e-6, self.per_decode + g * x[1] / self.D_SCALE)
        self.per_prefill = max(1e-6, self.per_prefill + g * x[2] / self.P_SCALE)
        self.steps += 1


def prefill_budget(
    cost: StepCost, decodes: int, target_s: float, max_tokens: int, min_prefill_tokens: int
) -> int:
    """Prefill tokens a step with ``decodes`` decode rows may add and still be predicted under ``target_s``.

    ``max_tokens``: what the step's token budget leaves after the decodes. With ``target_s <= 0`` or no
    decode: all of it. Otherwise ``(target_s - cost.predict(decodes, 0)) / cost.per_prefill`` tokens,
    clamped to ``[min(min_prefill_tokens, max_tokens), max_tokens]``.
    """
    if target_s <= 0 or decodes == 0:
        return max_tokens
    room = (target_s - cost.predict(decodes, 0)) / cost.per_prefill
    return max(min(min_prefill_tokens, max_tokens), min(max_tokens, int(room)))


@dataclass
class ScheduledChunk:
    """The next ``num_tokens`` uncomputed tokens of ``seq``, starting at ``start``.

    ``need_logits`` is true when the chunk reaches the end of ``seq.token_ids``
    (a token is sampled after it). A verify chunk (``num_draft > 0``) is the sequence's last token
    followed by its ``num_draft`` draft tokens (``seq.draft``): ``num_tokens = 1 + num_draft``, and
    each of its rows needs logits.
    """

    seq: Sequence
    start: int
    num_tokens: int
    num_draft: int = 0

    @property
    def need_logits(self) -> bool:
        return self.start + self.num_tokens - self.num_draft == len(self.seq.token_ids)

    @property
    def token_ids(self) -> list[int]:
        ids = self.seq.token_ids[self.start : self.start + self.num_tokens - self.num_draft]
        return ids + self.seq.draft[: self.num_draft] if self.num_draft else ids


@dataclass
class SchedulerOutput:
    """One step's plan: decodes (one token each) first, then the longer chunks: verify chunks (a decode and
    its drafts) and prefill chunks."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    """Waiting queue + running list over one ``BlockManager``.

    Args:
        block_manager: the pool's bookkeeping.
        max_num_seqs: most running sequences (including forked choices).
        max_num_batched_tokens: token budget of one step (tokens).
        long_prefill_token_threshold: first-pass cap of one prefill chunk
            (tokens); default ``max(block_size, max_num_batched_tokens // 4)``.
        watermark_blocks: free blocks admission leaves untouched so running
            decodes can grow (default 1% of the pool).
        itl_target_s: predicted step time the prefill of a step with decodes is cut to (seconds; 0: off).
        min_prefill_tokens: prefill tokens a step may always take under the target (default block size).
        decode_share: with the target on, a waiting sequence is admitted only while the running sequences
            plus it would decode in at most this share of the target (the rest is left for prefill).
        min_admit_seqs: the concurrency the target must allow for admission to wait on it at all: when
            this many decodes alone are predicted over the share, admission does not wait (sequences).
        cost: the step-time model (default a fresh ``StepCost``).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        long_prefill_token_threshold: int | None = None,
        watermark_blocks: int | None = None,
        itl_target_s: float = 0.0,
        min_prefill_tokens: int | None = None,
        decode_share: float = 0.6,
        min_admit_seqs: int = 4,
        cost: StepCost | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold or max(
            block_manager.block_size, max_num_batched_tokens // 4
        )
        self.watermark_blocks = (
            int(0.01 * block_manager.num_blocks) if watermark_blocks is None else watermark_blocks
        )
        self.itl_target_s = itl_target_s
        self.min_prefill_tokens = min_prefill_tokens or block_manager.block_size
        self.decode_share = decode_share
        self.min_admit_seqs = min_admit_seqs
        self.cost = cost or StepCost()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._reserved = 0  # running sequences + their pending forks

    # ------------------------------------------------------------------ queue ops

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FCFS)."""
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` (finished or aborted) wherever it is and free its blocks. Idempotent."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._reserved -= 1 + seq.pending_forks
        elif seq.status is SeqStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.bm.free(seq)
        seq.status = SeqStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        seq.draft = []
        self.running.remove(seq)
        self._reserved -= 1 + seq.pending_forks
        self.bm.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # back to the front, keeping FCFS order among the waiting
        i = 0
        while i < len(self.waiting) and self.waiting[i].arrival_order < seq.arrival_order:
            i += 1
        self.waiting.insert(i, seq)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see module docstring). Allocates the blocks of every chunk."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.bm
        scheduled: dict[int, ScheduledChunk] = {}  # seq_id -> chunk

        def preempt_last(keep: Sequence) -> bool:
            """Preempt the newest running sequence; False when that is ``keep`` itself."""
            nonlocal budget
            victim = self.running[-1]
            if victim is keep:
                return False
            ch = scheduled.pop(victim.seq_id, None)
            if ch is not None:
                budget += ch.num_tokens
            self._preempt(victim)
            out.preempted.append(victim)
            return True

        # 1. running decodes, oldest first
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.num_uncomputed != 1:
                continue
            target = seq.num_computed_tokens + 1
            while not bm.can_allocate(seq, target):
                if not preempt_last(seq):
                    break
            if not bm.can_allocate(seq, target):
                self._preempt(seq)
                out.preempted.append(seq)
                continue
            bm.allocate(seq, target)
            scheduled[seq.seq_id] = ScheduledChunk(seq, seq.num_computed_tokens, 1)
            budget -= 1

        # 1b. drafts of the scheduled decodes: from what the budget and the empty blocks leave once every
        # decode has its token (a draft never preempts, starves a decode or evicts a prefix-cache block)
        for ch in list(scheduled.values()):
            seq = ch.seq
            if not seq.draft:
                continue
            d = min(len(seq.draft), max(0, budget))
            while d > 0 and bm.num_new_blocks(seq, ch.start + 1 + d) > len(bm.free_empty):
                d -= 1
            seq.draft = seq.draft[:d]
            if d:
                bm.allocate(seq, ch.start + 1 + d)
                ch.num_tokens, ch.num_draft = 1 + d, d
                budget -= d

        # the latency target: what the decodes leave of the step's time goes to prefill (a verify chunk counts
        # as one decode: its few rows share one pass over the weights, as observe() learns it)
        decodes = len(scheduled)
        budget = prefill_budget(self.cost, decodes, self.itl_target_s, budget, self.min_prefill_tokens)

        # 2a. running prefills (partially computed or forked), first pass capped
        thr = self.long_prefill_token_threshold
        prefills: list[ScheduledChunk] = []
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.num_uncomputed <= 1 or seq.seq_id in scheduled:
                continue
            want = min(seq.num_uncomputed, thr, budget)
            n = self._fit(seq, want)
            while n == 0 and preempt_last(seq):
                n = self._fit(seq, want)
            if seq.status is not SeqStatus.RUNNING:
                continue
            if n == 0:
                self._preempt(seq)
                out.preempted.append(seq)
                continue
            bm.allocate(seq, seq.num_computed_tokens + n)
            ch = ScheduledChunk(seq, seq.num_computed_tokens, n)
            scheduled[seq.seq_id] = ch
            prefills.append(ch)
            budget -= n

        # 2b. admit waiting sequences FCFS (not in a step that had to preempt)
        if not out.preempted:
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                if self._reserved + 1 + seq.pending_forks > self.max_num_seqs:
                    break
                if self._over_decode_share(self._reserved + 1 + seq.pending_forks):
                    break
                cached = bm.match_prefix(seq)
                start = len(cached) * bm.block_size
                n = min(len(seq.token_ids) - start, thr, budget)
                revived = sum(1 for b in cached if bm.ref_count[b] == 0)
                # with nothing running the watermark would only block progress
                avail = bm.num_free_blocks - revived - (self.watermark_blocks if self.running else 0)
                n = min(n, (len(cached) + avail) * bm.block_size - start)
                if n <= 0:
                    break
                self.waiting.popleft()
                got = bm.admit(seq, cached)
                if seq.num_cached_tokens < 0:
                    seq.num_cached_tokens = min(got, seq.num_prompt_tokens)
                bm.allocate(seq, start + n)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                self._reserved += 1 + seq.pending_forks
                out.admitted.append(seq)
                ch = ScheduledChunk(seq, start, n)
                scheduled[seq.seq_id] = ch
                prefills.append(ch)
                budget -= n

        # 2c. leftover budget extends prefill chunks in order
        for ch in prefills:
            if budget <= 0:
                break
            if ch.seq.seq_id not in scheduled:
                continue
            seq = ch.seq
            extra = min(len(seq.token_ids) - (ch.start + ch.num_tokens), budget)
            if extra <= 0:
                continue
            extra = self._fit(seq, ch.num_tokens + extra) - ch.num_tokens
            if extra <= 0:
                continue
            bm.allocate(seq, ch.start + ch.num_tokens + extra)
            ch.num_tokens += extra
            budget -= extra

        for seq in self.running:  # a decode the budget did not reach verifies nothing
            if seq.seq_id not in scheduled:
                seq.draft = []
        # decodes (1 token) first, then longer chunks, each group in running order
        chunks = [c for c in scheduled.values()]
        out.chunks = [c for c in chunks if c.num_tokens == 1] + [c for c in chunks if c.num_tokens > 1]
        return out

    def _over_decode_share(self, num_seqs: int) -> bool:
        """With the latency target on and something running: would ``num_seqs`` decodes alone take more
        than ``decode_share`` of the target? (Then admission waits: a sequence admitted now would make every
        later step slower than the target allows once it decodes.) Never while ``min_admit_seqs`` decodes
        alone are predicted over the share (the target is out of reach; see the module docstring)."""
        if self.itl_target_s <= 0 or not self.running:
            return False
        share = self.decode_share * self.itl_target_s
        if self.cost.predict(self.min_admit_seqs, 0) > share:
            return False
        return self.cost.predict(num_seqs, 0) > share

    def _fit(self, seq: Sequence, want: int) -> int:
        """Largest ``n <= want`` new tokens of ``seq`` whose blocks the pool can supply now."""
        bm = self.bm
        have = len(seq.block_table) * bm.block_size - seq.num_computed_tokens
        if want <= have:
            return want
        extra_blocks = min(bm.num_new_blocks(seq, seq.num_computed_tokens + want), bm.num_free_blocks)
        return min(want, have + extra_blocks * bm.block_size)

    # ------------------------------------------------------------------ after the model ran

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """Feed one executed plan's wall time (s) to the step-time model (a verify chunk counts as one decode:
        its rows share one pass over the weights)."""
        decodes = sum(1 for c in out.chunks if c.num_tokens == 1 or c.num_draft)
        prefill = sum(c.num_tokens for c in out.chunks if c.num_tokens > 1 and not c.num_draft)
        self.cost.observe(decodes, prefill, seconds)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` of every chunk and register full blocks (of a verify chunk,
        only its first token: its drafts count once accepted, ``accept_draft``)."""
        for ch in out.chunks:
            seq = ch.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_computed_tokens = ch.start + ch.num_tokens - ch.num_draft
            self.bm.register_computed(seq)

    def accept_draft(self, seq: Sequence, accepted: int) -> None:
        """After verification: the first ``accepted`` draft tokens of ``seq`` were accepted.

        The caller has appended the accepted drafts (and the token sampled after them, if the sequence
        goes on) to ``seq.token_ids``. Their K/V, written by the verify pass, become computed tokens;
        the blocks past what the sequence now holds are given back (``BlockManager.trim``); ``draft`` is
        cleared. No-op for a sequence that is no longer running.
        """
        seq.draft = []
        if seq.status is not SeqStatus.RUNNING:
            return
        if accepted:
            seq.num_computed_tokens += accepted
            self.bm.register_computed(seq)
        self.bm.trim(seq, len(seq.token_ids))

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Turn ``parent``'s pending forks into running ``children`` (n > 1 choices).

        Call after the step that computed the parent's prompt. Each child shares
        the parent's full computed blocks (``BlockManager.fork``) and takes one
        of the sequence slots the parent reserved at admission.
        """
        if parent.status is not SeqStatus.RUNNING:
            raise ValueError("fork of a sequence that is not running")
        if len(children) > parent.pending_forks:
            raise ValueError("more children than pending forks")
        for child in children:
            child.arrival_order = parent.arrival_order
            self.bm.fork(parent, child)
            child.status = SeqStatus.RUNNING
            self.running.append(child)
        self._reserved -= parent.pending_forks - len(children)
        parent.pending_forks = 0

    def check_invariants(self) -> None:
        """Assert block/queue consistency (tests)."""
        self.bm.check_invariants(self.running + list(self.waiting))
        for s in self.waiting:
            assert s.status is SeqStatus.WAITING and not s.block_table
        for s in self.running:
            assert s.status is SeqStatus.RUNNING
        assert self._reserved == sum(1 + s.pending_forks for s in self.running)
        assert len(self.running) <= self.max_num_seqs
