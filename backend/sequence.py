"""Sequences: the unit the scheduler and block manager work on.

One ``Sequence`` is one choice of one request: its token ids (prompt, then
generated), how many of them already have K/V in the paged cache
(``num_computed_tokens``), and its block table. The scheduler treats prefill,
chunked prefill, recompute after preemption and forked choices alike: each
step it schedules the next ``k`` uncomputed tokens of a sequence; when a
chunk reaches the end of ``token_ids`` the model's logits for its last row
are sampled and one token is appended (with speculative decoding, a decode
chunk also carries ``draft`` tokens: the accepted ones and the token sampled
after them are appended).

Plain Python, no torch: the scheduler and block manager are tested fast.
Source followed: nano-vllm's ``Sequence`` (https://github.com/GeeeekExplorer/nano-vllm),
vLLM v1's ``Request`` (num_computed_tokens bookkeeping).
"""

from __future__ import annotations

import enum
import itertools
from typing import Any

_seq_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue, holds no blocks
    RUNNING = "running"  # admitted, holds blocks
    FINISHED = "finished"  # done (stop/length/abort); holds nothing


class SeqTimeline:
    """The engine events of one sequence, each a time in seconds since ``arrival`` (``time.monotonic()``).

    ``chunks``: ``(start, end, tokens)`` per prompt (or recompute) chunk; ``first_token``: the first token
    sampled; ``decode``: each later token sampled; ``preemptions``: each preemption. Every list keeps its
    first ``limit`` entries and ``dropped`` counts the rest, so a long generation stays a bounded record.
    The wire form is ``backend.protocol.Timeline``.
    """

    __slots__ = ("arrival", "limit", "chunks", "first_token", "decode", "preemptions", "dropped")

    def __init__(self, arrival: float, limit: int) -> None:
        self.arrival = arrival
        self.limit = limit
        self.chunks: list[tuple[float, float, int]] = []
        self.first_token: float | None = None
        self.decode: list[float] = []
        self.preemptions: list[float] = []
        self.dropped = 0

    def _keep(self, into: list, item: Any) -> None:
        if len(into) < self.limit:
            into.append(item)
        else:
            self.dropped += 1

    def chunk(self, start: float, end: float, tokens: int) -> None:
        """A prompt or recompute chunk of ``tokens`` tokens, computed from ``start`` to ``end`` (monotonic)."""
        self._keep(self.chunks, (start - self.arrival, end - self.arrival, tokens))

    def token(self, now: float) -> None:
        """A token was sampled at ``now`` (monotonic): the first one, else a decode step."""
        if self.first_token is None:
            self.first_token = now - self.arrival
        else:
            self._keep(self.decode, now - self.arrival)

    def preempted(self, now: float) -> None:
        self._keep(self.preemptions, now - self.arrival)

    def fork(self) -> SeqTimeline:
        """A copy for a choice forked off this sequence after its prompt (it shares the prompt chunks)."""
        t = SeqTimeline(self.arrival, self.limit)
        t.chunks = list(self.chunks)
        return t


class Sequence:
    """One choice of one request.

    Attributes:
        seq_id: process-unique int.
        token_ids: prompt then generated token ids (grows by the tokens each step emits: one, or the
            accepted drafts and the token after them).
        num_prompt_tokens: length of the prompt (tokens).
        num_computed_tokens: leading tokens whose K/V are in the cache (tokens).
        block_table: physical KV block ids, ``block_table[i]`` holds tokens
            ``[i*block_size, (i+1)*block_size)``.
        block_hashes: prefix-cache keys of the leading full, computed blocks
            (``len(block_hashes) <= len(block_table)``), chained (see ``block_manager``).
        cache_salt: prefix-cache namespace (tenant id); blocks never match across salts.
        pending_forks: choices still to be forked off this sequence once its
            prompt is computed (n - 1 for choice 0 of an n > 1 request, else 0).
        max_tokens: generation limit of this choice (tokens).
        request: the owning engine-side request object (opaque to the scheduler).
        index: choice index in the request.
        arrival_order: FCFS key; admission keeps it, preemption re-queues by it.
        num_preemptions: times this sequence was preempted (recompute).
        timeline: what the engine did for it and when (``SeqTimeline``), or None (not asked: no cost).
        draft: speculative tokens proposed to follow ``token_ids`` this step (not part of ``token_ids``;
            the scheduler may shorten it, verification appends the accepted ones).
        spec: the engine's drafting state for this sequence (``backend.proposer.DraftPolicy``), or None.
    """

    __slots__ = (
        "seq_id",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "block_table",
        "block_hashes",
        "cache_salt",
        "pending_forks",
        "max_tokens",
        "status",
        "request",
        "index",
        "arrival_order",
        "num_preemptions",
        "num_cached_tokens",
        "sampling_state",
        "timeline",
        "draft",
        "spec",
    )

    def __init__(
        self,
        token_ids: list[int],
        *,
        cache_salt: str = "",
        max_tokens: int = 16,
        pending_forks: int = 0,
        request: Any = None,
        index: int = 0,
        num_prompt_tokens: int | None = None,
    ) -> None:
        if not token_ids:
            raise ValueError("a sequence needs at least one token")
        self.seq_id = next(_seq_ids)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.cache_salt = cache_salt
        self.pending_forks = pending_forks
        self.max_tokens = max_tokens
        self.status = SeqStatus.WAITING
        self.request = request
        self.index = index
        self.arrival_order = self.seq_id
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache at first admission
        self.sampling_state: Any = None
        self.timeline: SeqTimeline | None = None  # only when the request asked to be inspected
        self.draft: list[int] = []
        self.spec: Any = None

    # -------------------------------------------------------------- lengths

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        """Generated tokens so far (tokens)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens still without K/V; 1 for a decode step, more for a (re)prefill."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
