"""The engine: validates requests, runs scheduler -> model -> sampler steps, builds outputs.

``Engine`` is single-threaded by design: whoever calls its methods (the
server's busy loop, a test, the benchmark) owns all its state. One ``step()``
plans a batch (``Scheduler``), executes it (``ModelRunner.execute``), samples
one token for every chunk that reached the end of its sequence
(``sampling.sample``), forks ``n > 1`` requests after their prompt, and
returns the step's ``RequestOutput`` messages (plus ``RequestError`` for
requests that failed inside the step).

Request lifecycle: ``add_request`` (validation; a bad request gets a
``RequestError`` and is never scheduled) -> waiting -> running (possibly
preempted and recomputed) -> finished with ``finish_reason`` "stop" (EOS or a
stop id; ``stop_token_id`` set, the token is not in ``new_token_ids`` but is
counted in ``completion_tokens``), "length" (``max_tokens``), "abort"
(``abort_request``) or an error.

Constrained requests (``Submit.grammar``, ``backend.grammar``): the grammar compiles on a worker thread
while the request waits outside the scheduler (``has_work`` stays true); once compiled each choice gets its
own matcher and the request is queued (at once for a grammar compiled before). Each step the masks of the
constrained rows are computed (beside the forward pass on an accelerator, after it on a CPU) and applied
in the sampler; a choice whose grammar is complete finishes with "stop" (its last
token is in ``new_token_ids``). A grammar that fails to compile, or that the output leaves, ends that
request alone with ``RequestError`` code ``grammar_error``.

Speculative decoding (``num_speculative_tokens > 0``): before each step every decoding sequence of a
request that allows it (``SamplingParams.speculative``, no grammar) gets up to that many draft tokens from
its own context (``backend.proposer``, n-gram prompt lookup), while at most ``speculative_max_batch``
sequences decode (past that a step is bound by compute and the drafts would slow it). The scheduler runs
the sequence's last token and its drafts as one verify chunk; the model returns the logits of each of its
rows. Verification samples position by position with the target's own sampler (every transform, the
position's counter-based uniform number, ``backend.sampling``): a draft token is accepted iff the token
drawn there equals it; the first mismatch is replaced by the drawn token and ends the step's tokens. So the
output is exactly the target's: under greedy decoding the same argmax chain, under sampling the same draws
with the same seed, with speculation on or off, in any batch (Leviathan et al., ICML 2023; Chen et al.,
2023, coupled here through shared random numbers). The accepted drafts' K/V are kept, the rejected ones'
slots given back (``Scheduler.accept_draft``).

Inspected requests (``Submit.inspect``): each sequence keeps a ``SeqTimeline`` (its prompt and recompute
chunks with the step's start and the model pass's end, each sampled token, each preemption, bounded lists);
the last output of each choice carries it as ``Timeline``. Other requests record nothing.

Source followed: nano-vllm ``LLMEngine``; vLLM v1 ``EngineCore`` (busy loop
owning all state, outputs batched per step).
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
import traceback
from collections.abc import Hashable
from typing import Any

import msgspec

from backend import grammar as G
from backend.allocator import ThreadGovernor
from backend.batch import SeqChunk
from backend.block_manager import BlockManager
from backend.proposer import PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN, DraftPolicy
from backend.protocol import (
    FEATURE_GRAMMAR,
    MAX_TIMELINE_EVENTS,
    RequestError,
    RequestOutput,
    SamplingParams,
    Stats,
    Submit,
    Timeline,
    Timings,
    TokenLogprob,
    Usage,
)
from backend.sampling import ChoiceState, sample, verify_draft
from backend.sampling_rules import check_sampling
from backend.scheduler import Scheduler, SchedulerOutput
from backend.sequence import SeqStatus, SeqTimeline, Sequence

Message = RequestOutput | RequestError


class EngineRequest:
    """Engine-side state of one request (all its choices)."""

    __slots__ = (
        "request_id",
        "owner",
        "params",
        "prompt_len",
        "seqs",
        "states",
        "done",
        "arrival",
        "first_scheduled",
        "first_token",
        "cached_tokens",
        "stop_set",
    )

    def __init__(
        self, submit: Submit, owner: Hashable, states: list[ChoiceState], stop_set: frozenset[int]
    ) -> None:
        self.request_id = submit.request_id
        self.owner = owner
        self.params = submit.sampling
        self.prompt_len = len(submit.prompt_ids)
        self.seqs: list[Sequence | None] = [None] * submit.sampling.n
        self.states = states
        self.done = [False] * submit.sampling.n
        self.arrival = time.monotonic()
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.cached_tokens = 0
        self.stop_set = stop_set


class Engine:
    """Continuous-batching engine over one ``ModelRunner``.

    Args:
        runner: a ``backend.model_runner.ModelRunner`` (``execute``, ``card``,
            ``num_kv_blocks``, ``block_size``, ``vocab_size``).
        max_num_seqs: most running sequences per step.
        max_num_batched_tokens: token budget per step (tokens); must be >= max_num_seqs.
        enable_prefix_caching: automatic prefix caching on/off.
        long_prefill_token_threshold: see ``Scheduler``.
        num_kv_blocks: use only this many of the runner's KV blocks (tests: a tiny pool
            without reloading the model); default all.
        grammar: the grammar compiler (``backend.grammar.GrammarCompiler``); default one built on first
            use from the model file's tokenizer (``card.model_path``).
        itl_target_ms: inter-token latency the scheduler sizes the prefill of steps with decodes to
            (milliseconds; default 150; 0: off, every step may take the whole token budget). Each
            step's wall time feeds the scheduler's step-time model.
        threads: adapts torch's thread count to the machine's contention after each step
            (``backend.allocator.ThreadGovernor``); None: the count is left alone.
        num_speculative_tokens: most n-gram draft tokens verified per sequence and step (0: off).
        speculative_max_batch: speculation runs only in steps with at most this many decoding sequences.
        prompt_lookup_min, prompt_lookup_max: n-gram lengths the proposer matches (tokens, longest first).

    Raises:
        ValueError: inconsistent limits.
    """

    def __init__(
        self,
        runner: Any,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: int | None = None,
        num_kv_blocks: int | None = None,
        grammar: G.GrammarCompiler | None = None,
        itl_target_ms: float = 150.0,
        threads: ThreadGovernor | None = None,
        num_speculative_tokens: int = 0,
        speculative_max_batch: int = 4,
        prompt_lookup_min: int = PROMPT_LOOKUP_MIN,
        prompt_lookup_max: int = PROMPT_LOOKUP_MAX,
    ) -> None:
        if num_kv_blocks is not None and not 1 <= num_kv_blocks <= runner.num_kv_blocks:
            raise ValueError(f"num_kv_blocks must be in [1, {runner.num_kv_blocks}]")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if num_speculative_tokens < 0 or speculative_max_batch < 0:
            raise ValueError("num_speculative_tokens and speculative_max_batch must be >= 0")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.num_speculative_tokens = num_speculative_tokens
        self.speculative_max_batch = speculative_max_batch
        self.prompt_lookup = (prompt_lookup_min, prompt_lookup_max)
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * num_speculative_tokens
        self.runner = runner
        self.card = runner.card
        self.vocab_size = int(runner.vocab_size)
        self.context_length = int(getattr(runner, "max_model_len", None) or self.card.context_length)
        self.eos_token_ids = list(self.card.eos_token_ids)
        # generated tokens computed in another weight format than prompt tokens: their K/V must not serve a
        # later prompt from the prefix cache (a cache hit would change that prompt's arithmetic)
        self.block_manager = BlockManager(
            num_kv_blocks or runner.num_kv_blocks,
            runner.block_size,
            enable_prefix_caching,
            cache_generated=not getattr(runner, "roles_differ", False),
        )
        # Served context (vLLM's max_model_len): never more than the KV pool can hold for one sequence,
        # so a request without max_tokens ("up to the context's end") always fits the pool.
        kv_tokens = self.block_manager.num_blocks * runner.block_size
        if kv_tokens < self.context_length:
            self.context_length = kv_tokens
            self.card = msgspec.structs.replace(self.card, context_length=kv_tokens)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            itl_target_s=itl_target_ms / 1000.0,
        )
        self.requests: dict[str, EngineRequest] = {}
        self.threads = threads
        self.grammar = grammar
        self.masks: G.MaskJob | None = None
        self.overlap_masks = str(self.card.device) != "cpu"
        # requests whose grammar is compiling: request_id -> (request, its first sequence, the compile)
        self.compiling: dict[str, tuple[EngineRequest, Sequence, concurrent.futures.Future]] = {}
        self.num_steps = 0
        self.num_aborts = 0
        self.num_finished = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.step_overhead_s = 0.0  # engine-side time (schedule + prepare + sample + outputs), summed
        self.model_time_s = 0.0

    # ------------------------------------------------------------------ properties

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.compiling)

    @property
    def features(self) -> list[str]:
        """Capability flags to announce in ``Ready.features``."""
        return [FEATURE_GRAMMAR] if G.available() and (self.grammar or self.card.model_path) else []

    def _compiler(self) -> G.GrammarCompiler:
        if self.grammar is None:
            path = self.card.model_path

            def tokenizer_json() -> str:
                from templating.tokenizer import load_tokenizer

                return load_tokenizer(path).tokenizer.to_str()

            self.grammar = G.GrammarCompiler(tokenizer_json, self.vocab_size, self.eos_token_ids)
        return self.grammar

    # ------------------------------------------------------------------ validation

    def validate(self, submit: Submit) -> RequestError | None:
        """Check a submit against the model and engine limits; None when it is fine.

        Refused here, before scheduling, so a bad request (out-of-vocab logit_bias, prompt + max_tokens
        over the context length) never reaches the engine step and never fails the other requests.
        """
        rid = submit.request_id

        def err(code: str, message: str, param: str | None = None) -> RequestError:
            return RequestError(request_id=rid, code=code, message=message, param=param)

        if not isinstance(rid, str) or not rid:
            return err("invalid_request_error", "request_id must be a non-empty string", "request_id")
        if rid in self.requests:
            return err("invalid_request_error", f"request_id {rid!r} is already in flight", "request_id")
        V = self.vocab_size
        ids = submit.prompt_ids
        if not ids:
            return err("invalid_request_error", "prompt_ids is empty", "prompt_ids")
        if min(ids) < 0 or max(ids) >= V:
            bad = next(t for t in ids if t < 0 or t >= V)
            return err("invalid_token_id", f"prompt token id {bad} outside [0, {V})", "prompt_ids")
        p: SamplingParams = submit.sampling
        bad = check_sampling(p, V)  # the rules the gateway applies too (backend/sampling_rules.py)
        if bad is not None:
            return err("invalid_parameter", bad.message, bad.param)
        if submit.grammar is not None and FEATURE_GRAMMAR not in self.features:
            return err("unsupported_feature", "this backend does not serve grammars", "grammar")
        if p.n > self.max_num_seqs:
            return err("invalid_parameter", f"n must be at most {self.max_num_seqs}, got {p.n}", "n")
        total = len(ids) + p.max_tokens
        if total > self.context_length:
            return err(
                "context_length_exceeded",
                f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) = {total} exceeds the context length {self.context_length}",
                "messages",
            )
        bm = self.block_manager
        if bm.blocks_for(total) > bm.num_blocks:
            return err(
                "context_length_exceeded",
                f"prompt + max_tokens = {total} tokens exceeds the KV cache capacity ({bm.num_blocks * bm.block_size} tokens)",
                "messages",
            )
        return None

    # ------------------------------------------------------------------ requests

    def add_request(
        self, submit: Submit, owner: Hashable = None, received_at: float | None = None
    ) -> RequestError | None:
        """Validate and queue a request. Returns the ``RequestError`` when it is refused.

        ``received_at``: ``time.monotonic()`` when the process received the Submit (the server's reader
        thread); default now. Queue time and TTFT count from it, so a Submit that waited in the inbox
        for a running step to end is charged to the backend, not to the gateway.
        """
        error = self.validate(submit)
        if error is not None:
            return error
        p = submit.sampling
        eos = [] if p.ignore_eos else self.eos_token_ids
        states = [ChoiceState(p, i, submit.prompt_ids, self.vocab_size, eos) for i in range(p.n)]
        stop_set = frozenset(eos) | frozenset(p.stop_token_ids)
        req = EngineRequest(submit, owner, states, stop_set)
        if received_at is not None:
            req.arrival = min(received_at, req.arrival)
        seq = Sequence(
            submit.prompt_ids,
            cache_salt=submit.cache_salt,
            max_tokens=p.max_tokens,
            pending_forks=p.n - 1,
            request=req,
            index=0,
        )
        seq.sampling_state = states[0]
        if submit.inspect:
            seq.timeline = SeqTimeline(req.arrival, MAX_TIMELINE_EVENTS)
        req.seqs[0] = seq
        self.requests[req.request_id] = req
        self.num_prompt_tokens += len(submit.prompt_ids)
        if submit.grammar is None:
            self.scheduler.add(seq)
            return None
        fut = self._compiler().submit(submit.grammar)
        if not fut.done():
            self.compiling[req.request_id] = (req, seq, fut)
            return None
        return self._admit(req, seq, fut)  # a cached grammar: queued now, in arrival order

    def _admit(
        self, req: EngineRequest, seq: Sequence, fut: concurrent.futures.Future
    ) -> RequestError | None:
        """Give each choice its matcher from a finished compile and queue the request, or fail it."""
        try:
            first = fut.result()
            req.states[0].matcher = first
            for st in req.states[1:]:
                st.matcher = first.deep_copy()  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - GrammarError or an engine fault: this request only
            return self._fail(req, f"grammar: {exc}", code="grammar_error")
        self.scheduler.add(seq)
        return None

    def _admit_compiled(self, wait: bool) -> list[tuple[Hashable, Message]]:
        """Queue the requests whose grammar finished compiling (one matcher per choice); fail those whose
        grammar did not compile. ``wait``: nothing else to do, block up to 5 ms for a compile to end."""
        if not self.compiling:
            return []
        if wait:
            futures = [f for _, _, f in self.compiling.values()]
            concurrent.futures.wait(futures, timeout=0.005, return_when=concurrent.futures.FIRST_COMPLETED)
        out: list[tuple[Hashable, Message]] = []
        for rid, (req, seq, fut) in list(self.compiling.items()):
            if not fut.done():
                continue
            del self.compiling[rid]
            error = self._admit(req, seq, fut)
            if error is not None:
                out.append((req.owner, error))
        return out

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort a request at any moment and free everything it holds; unknown ids -> [].

        Returns the final ``finish_reason="abort"`` output of every unfinished choice.
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        self._drop_compile(request_id)
        self.num_aborts += 1
        now = time.monotonic()
        outs = []
        for i in range(len(req.seqs)):
            if req.done[i]:
                continue
            seq = req.seqs[i]
            if seq is not None:
                self.scheduler.finish(seq)
            req.done[i] = True
            req.states[i].matcher = None
            outs.append(self._final(req, i, "abort", now))
        return outs

    def abort_choice(self, request_id: str, index: int) -> list[RequestOutput]:
        """Stop one choice of a request and free its blocks; the request's other choices go on.

        Returns the choice's final ``finish_reason="abort"`` output, or [] when there is nothing to stop:
        unknown request, index out of range, choice already ended, or the choice is the parent sequence
        still computing the prompt that its not-yet-forked siblings share (stopping it would stop them).
        A choice not forked yet is marked ended, and is then never forked.
        """
        req = self.requests.get(request_id)
        if req is None or not 0 <= index < len(req.done) or req.done[index]:
            return []
        seq = req.seqs[index]
        if seq is not None and seq.pending_forks:
            return []
        now = time.monotonic()
        out = self._final(req, index, "abort", now)
        self._finish_choice(req, index)
        return [out]

    def abort_owner(self, owner: Hashable) -> int:
        """Abort every request of ``owner`` (a closed connection). Returns how many."""
        ids = [rid for rid, r in self.requests.items() if r.owner == owner]
        for rid in ids:
            self.abort_request(rid)
        return len(ids)

    def abort_all(self) -> list[tuple[Hashable, RequestOutput]]:
        out = []
        for rid in list(self.requests):
            owner = self.requests[rid].owner
            out.extend((owner, o) for o in self.abort_request(rid))
        return out

    def owner_of(self, request_id: str) -> Hashable:
        req = self.requests.get(request_id)
        return None if req is None else req.owner

    # ------------------------------------------------------------------ outputs

    def _timings(self, req: EngineRequest, index: int, now: float) -> Timings:
        fs = req.first_scheduled if req.first_scheduled is not None else now
        ft = req.first_token if req.first_token is not None else now
        seq = req.seqs[index]
        return Timings(
            queue=fs - req.arrival,
            prefill=max(0.0, ft - fs),
            decode=max(0.0, now - ft),
            ttft=(ft - req.arrival) if req.first_token is not None else 0.0,
            preemptions=seq.num_preemptions if seq is not None else 0,
            draft_tokens=seq.spec.draft_tokens if seq is not None and seq.spec is not None else 0,
            accepted_tokens=seq.spec.accepted_tokens if seq is not None and seq.spec is not None else 0,
        )

    def _timeline(self, req: EngineRequest, index: int, now: float) -> Timeline | None:
        """Choice ``index``'s recorded ``Timeline`` ending at ``now``; None when it was not asked."""
        seq = req.seqs[index]
        t = seq.timeline if seq is not None else None
        if t is None:
            return None
        return Timeline(
            chunks=t.chunks,
            first_token=t.first_token,
            decode=t.decode,
            preemptions=t.preemptions,
            finish=now - t.arrival,
            dropped=t.dropped,
        )

    def _final(self, req: EngineRequest, index: int, reason: str, now: float, **kw: Any) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            index=index,
            finish_reason=reason,  # type: ignore[arg-type]
            usage=Usage(
                prompt_tokens=req.prompt_len,
                completion_tokens=req.states[index].num_generated,
                cached_tokens=req.cached_tokens,
            ),
            timings=self._timings(req, index, now),
            timeline=self._timeline(req, index, now),
            **kw,
        )

    def _finish_choice(self, req: EngineRequest, index: int) -> None:
        seq = req.seqs[index]
        if seq is not None:
            self.scheduler.finish(seq)
        req.done[index] = True
        req.states[index].matcher = None  # frees the grammar state
        if all(req.done):
            self.requests.pop(req.request_id, None)
            self._drop_compile(req.request_id)  # it may end before its grammar is ready
            self.num_finished += 1

    def _drop_compile(self, request_id: str) -> None:
        """Forget a request's pending compile (its result, if it comes, is never used)."""
        pending = self.compiling.pop(request_id, None)
        if pending is not None:
            pending[2].cancel()

    def _fail(self, req: EngineRequest, message: str, code: str = "internal_error") -> RequestError:
        for i, seq in enumerate(req.seqs):
            if seq is not None:
                self.scheduler.finish(seq)
            req.done[i] = True
            req.states[i].matcher = None
        self.requests.pop(req.request_id, None)
        self._drop_compile(req.request_id)
        param = "grammar" if code == "grammar_error" else None
        return RequestError(request_id=req.request_id, code=code, message=message, param=param)

    # ------------------------------------------------------------------ step

    def step(self) -> list[tuple[Hashable, Message]]:
        """Run one engine step.

        Returns:
            ``(owner, message)`` pairs: a ``RequestOutput`` per choice that got a token
            or finished this step, and a ``RequestError`` per request that failed in it.
            Empty when there was nothing to run.
        """
        t0 = time.perf_counter()
        sched = self.scheduler
        early = self._admit_compiled(wait=not sched.has_work())
        if self.num_speculative_tokens:
            self._propose()
        plan = sched.schedule()
        if not plan.chunks:
            return early
        self.num_steps += 1
        now = time.monotonic()
        for seq in plan.admitted:
            req = seq.request
            if req.first_scheduled is None:
                req.first_scheduled = now
                req.cached_tokens = max(0, seq.num_cached_tokens)
        for seq in plan.preempted:
            if seq.timeline is not None:
                seq.timeline.preempted(now)
        chunks = [
            SeqChunk(
                token_ids=c.token_ids,
                start_pos=c.start,
                block_table=c.seq.block_table,
                need_logits=c.need_logits,
                prompt_len=c.seq.num_prompt_tokens,
                num_logits=1 + c.num_draft,
            )
            for c in plan.chunks
        ]
        rows, targets, verify = self._targets(plan)
        # beside the forward pass when it runs on an accelerator (the CPU is free meanwhile); after it on a
        # CPU, whose cores the forward pass already keeps busy
        mask_job = self._start_masks(targets) if self.overlap_masks else None
        t1 = time.perf_counter()
        try:
            logits = self.runner.execute(chunks)
        except Exception as exc:  # fail only this step's requests; keep serving
            traceback.print_exc(file=sys.stderr)
            if mask_job is not None:
                mask_job.result()  # the worker must not run on while matchers are dropped
            return early + self._fail_plan(plan, f"model step failed: {type(exc).__name__}: {exc}")
        t2 = time.perf_counter()
        self.model_time_s += t2 - t1
        self._record_chunks(plan, now)
        sched.update_after_step(plan)
        if not self.overlap_masks:
            mask_job = self._start_masks(targets)
        out: list[tuple[Hashable, Message]] = early
        try:
            self._sample_and_output(rows, targets, logits, mask_job, out)
            self._verify(verify, logits, out)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            # Keep the final outputs of requests that already finished in this step (they left
            # self.requests, so _fail_plan would skip them and their clients would wait forever);
            # fail the rest.
            done = [
                (o, m) for o, m in out if isinstance(m, RequestOutput) and m.request_id not in self.requests
            ]
            out = done + self._fail_plan(plan, f"sampling failed: {type(exc).__name__}: {exc}")
        t3 = time.perf_counter()
        self.step_overhead_s += (t1 - t0) + (t3 - t2)
        sched.observe(plan, t3 - t0)
        if self.threads is not None:
            self.threads.tick()
        return out

    @staticmethod
    def _record_chunks(plan: SchedulerOutput, start: float) -> None:
        """Put the prompt and recompute chunks of the inspected sequences in their timelines (the step
        began at ``start``; its model pass ended now). Decode steps are recorded when they are sampled."""
        end = None
        for c in plan.chunks:
            t = c.seq.timeline
            if t is not None and not c.num_draft and (c.num_tokens > 1 or c.start < c.seq.num_prompt_tokens):
                end = time.monotonic() if end is None else end
                t.chunk(start, end, c.num_tokens)

    def _fail_plan(self, plan: SchedulerOutput, message: str) -> list[tuple[Hashable, Message]]:
        out: list[tuple[Hashable, Message]] = []
        seen = set()
        for c in plan.chunks:
            req = c.seq.request
            if req.request_id in seen or req.request_id not in self.requests:
                continue
            seen.add(req.request_id)
            out.append((req.owner, self._fail(req, message)))
        return out

    def _targets(
        self, plan: SchedulerOutput
    ) -> tuple[list[int], list[tuple[Sequence, int]], list[tuple[Sequence, int, int]]]:
        """The logits rows to sample and, per row, ``(sequence or parent, choice index)``: one per sequence
        that reached its end, and for a parent that just finished its prompt one per choice (n > 1); and
        the verify chunks as ``(sequence, first logits row, draft tokens)``."""
        rows: list[int] = []
        targets: list[tuple[Sequence, int]] = []  # (sequence or parent, choice index)
        verify: list[tuple[Sequence, int, int]] = []
        r = 0
        for c in plan.chunks:
            if not c.need_logits:
                continue
            seq = c.seq
            if c.num_draft:
                if seq.status is SeqStatus.RUNNING:
                    verify.append((seq, r, c.num_draft))
                r += 1 + c.num_draft
                continue
            if seq.status is SeqStatus.RUNNING:
                req: EngineRequest = seq.request
                if seq.pending_forks and seq.num_generated == 0:
                    for i in range(len(req.seqs)):
                        if (req.seqs[i] is None and not req.done[i]) or i == seq.index:
                            rows.append(r)
                            targets.append((seq, i))
                else:
                    rows.append(r)
                    targets.append((seq, seq.index))
            r += 1
        return rows, targets, verify

    def _propose(self) -> None:
        """Give each decoding sequence its draft tokens for this step (see the module docstring)."""
        decoding = [
            s
            for s in self.scheduler.running
            if s.num_uncomputed == 1 and not s.pending_forks and s.num_computed_tokens >= s.num_prompt_tokens
        ]  # decodes of a generated token (a prompt's last token left by chunked prefill is not one)
        if not decoding or len(decoding) > self.speculative_max_batch:
            return
        lo, hi = self.prompt_lookup
        for seq in decoding:
            state: ChoiceState = seq.sampling_state
            p = state.params
            limit = p.max_tokens - state.num_generated - 1  # the token after the drafts is sampled too
            if not p.speculative or state.matcher is not None or limit <= 0:
                continue
            if seq.spec is None:
                seq.spec = DraftPolicy(self.num_speculative_tokens, lo, hi)
            seq.draft = seq.spec.propose(seq.token_ids, limit)

    def _verify(
        self, verify: list[tuple[Sequence, int, int]], logits: Any, out: list[tuple[Hashable, Message]]
    ) -> None:
        """Sample the verify chunks position by position; keep the accepted drafts (module docstring)."""
        for seq, r0, d in verify:
            req: EngineRequest = seq.request
            if req.request_id not in self.requests or seq.status is not SeqStatus.RUNNING:
                continue
            i = seq.index
            state = req.states[i]
            toks, lps, matched = verify_draft(
                logits[r0 : r0 + d + 1], seq.draft[:d], state, req.stop_set, req.params.max_tokens
            )
            self.spec_drafts += 1
            self.spec_draft_tokens += d
            self.spec_accepted_tokens += matched
            for j in range(matched):
                self.spec_accepted_per_pos[j] += 1
            seq.spec.record(d, matched)
            self._commit(req, i, toks, lps, out)
            self.scheduler.accept_draft(seq, len(toks) - 1)

    def _start_masks(self, targets: list[tuple[Sequence, int]]) -> concurrent.futures.Future | None:
        """Start the grammar masks of the constrained targets (on a worker thread, beside the forward);
        None when no target is constrained."""
        cons = [(j, m) for j, (s, i) in enumerate(targets) if (m := s.request.states[i].matcher) is not None]
        if not cons:
            return None
        if self.masks is None:
            self.masks = G.MaskJob(self.vocab_size)
        return self.masks.start([j for j, _ in cons], [m for _, m in cons])

    def _check_masks(
        self,
        targets: list[tuple[Sequence, int]],
        allowed: G.Masks,
        out: list[tuple[Hashable, Message]],
    ) -> None:
        """Fail the requests whose matcher errored while computing its mask, or allows no token at all
        (their rows are then unmasked: the token drawn there is thrown away)."""
        rows, ok, some, _ = allowed
        for j, r in enumerate(rows):
            seq, i = targets[r]
            req: EngineRequest = seq.request
            m = req.states[i].matcher
            bad = m is not None and m.is_error()  # type: ignore[attr-defined]
            if bad or not some[j]:
                if req.request_id in self.requests:
                    why = G.error_message(m) if bad else "no token can continue the output"
                    out.append((req.owner, self._fail(req, f"grammar: {why}", code="grammar_error")))
                ok[j] = True
                if allowed.bitmask is not None:
                    allowed.bitmask[j] = -1

    def _sample_and_output(
        self,
        rows: list[int],
        targets: list[tuple[Sequence, int]],
        logits: Any,
        mask_job: concurrent.futures.Future | None,
        out: list[tuple[Hashable, Message]],
    ) -> None:
        """Sample one token per target, fork n > 1 parents, and append the step's messages to ``out``
        (filled in place so that a failure midway keeps what was already produced)."""
        allowed = self.masks.result(mask_job) if self.masks is not None and mask_job is not None else None
        if not targets:
            return
        if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
            batch = logits
        else:
            import torch

            batch = logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]
        states = [s.request.states[i] for s, i in targets]
        if allowed is not None:
            self._check_masks(targets, allowed, out)
        tokens, lps = sample(batch, states, allowed)

        # forks: create the children of every parent that just finished its prompt
        forked: dict[int, list[Sequence]] = {}
        for seq, i in targets:
            if i != seq.index and seq.request.request_id in self.requests:
                req = seq.request
                child = Sequence(
                    seq.token_ids[: seq.num_prompt_tokens],
                    cache_salt=seq.cache_salt,
                    max_tokens=seq.max_tokens,
                    request=req,
                    index=i,
                )
                child.sampling_state = req.states[i]
                child.num_cached_tokens = seq.num_cached_tokens
                child.timeline = seq.timeline.fork() if seq.timeline is not None else None
                req.seqs[i] = child
                forked.setdefault(seq.seq_id, [seq]).append(child)
        for parent, *children in forked.values():
            self.scheduler.fork(parent, children)
        for seq, _ in targets:  # a parent whose not-yet-forked siblings were all aborted: free their slots
            if seq.pending_forks and seq.seq_id not in forked and seq.status is SeqStatus.RUNNING:
                self.scheduler.fork(seq, [])

        for (seq, i), tok, lp in zip(targets, tokens, lps):
            req = seq.request
            if req.request_id not in self.requests:
                continue  # failed in this step (grammar)
            req.states[i].append(tok)
            self._commit(req, i, [tok], [lp], out)

    def _commit(
        self,
        req: EngineRequest,
        i: int,
        toks: list[int],
        lps: list[TokenLogprob | None],
        out: list[tuple[Hashable, Message]],
    ) -> None:
        """Emit choice ``i``'s tokens of this step, already appended to its ``ChoiceState`` (one, or the
        accepted drafts and the token after them; only the last may end the choice): advance the grammar,
        decide the finish reason, grow the sequence, append the message to ``out``."""
        now = time.monotonic()
        s = req.seqs[i]
        assert s is not None
        state = req.states[i]
        self.num_generation_tokens += len(toks)
        if s.timeline is not None:
            for _ in toks:
                s.timeline.token(now)
        if req.first_token is None:
            req.first_token = now
        tok = toks[-1]
        m = state.matcher
        if m is not None:
            try:
                for t in toks:
                    G.advance(m, t)
            except G.GrammarError as exc:
                out.append((req.owner, self._fail(req, f"grammar: {exc}", code="grammar_error")))
                return
        lp_list = lps if any(lp is not None for lp in lps) else None
        if tok in req.stop_set:
            head = toks[:-1]
            msg = self._final(
                req, i, "stop", now, stop_token_id=tok,
                new_token_ids=head, logprobs=lp_list[:-1] if lp_list and head else None,
            )  # fmt: skip
            self._finish_choice(req, i)
        elif m is not None and G.finished(m):  # the grammar is complete: nothing may follow
            msg = self._final(req, i, "stop", now, new_token_ids=toks, logprobs=lp_list)
            self._finish_choice(req, i)
        elif state.num_generated >= req.params.max_tokens:
            msg = self._final(req, i, "length", now, new_token_ids=toks, logprobs=lp_list)
            self._finish_choice(req, i)
        else:
            s.token_ids.extend(toks)
            msg = RequestOutput(request_id=req.request_id, index=i, new_token_ids=toks, logprobs=lp_list)
        out.append((req.owner, msg))

    # ------------------------------------------------------------------ stats

    def stats(self, nonce: int = 0) -> Stats:
        bm = self.block_manager
        return Stats(
            nonce=nonce,
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_cached=bm.num_cached_free_blocks,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            preemptions=self.scheduler.num_preemptions,
            aborts=self.num_aborts,
            requests_finished=self.num_finished,
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
            steps=self.num_steps,
            device=str(self.card.device),
            attention_backend=str(self.card.attention_backend),
            spec_drafts=self.spec_drafts,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_accepted_per_pos),
        )

    # ------------------------------------------------------------------ convenience

    def generate(self, submits: list[Submit], max_steps: int = 1_000_000) -> dict[str, list[RequestOutput]]:
        """Run ``submits`` to completion in-process (tests, benchmark).

        Returns request_id -> all its ``RequestOutput`` messages in order.

        Raises:
            ValueError: a submit was refused (the ``RequestError`` message).
        """
        res: dict[str, list[Any]] = {}
        for s in submits:
            e = self.add_request(s)
            if e is not None:
                raise ValueError(f"{e.code}: {e.message}")
            res[s.request_id] = []
        for _ in range(max_steps):
            if not self.has_work():
                break
            for _, m in self.step():
                res.setdefault(m.request_id, []).append(m)
        return res


def collect_tokens(outputs: list[RequestOutput], index: int = 0) -> list[int]:
    """All new token ids of choice ``index`` in ``outputs`` (helper for tests and bench)."""
    toks: list[int] = []
    for o in outputs:
        if isinstance(o, RequestOutput) and o.index == index:
            toks.extend(o.new_token_ids)
    return toks


def final_output(outputs: list[RequestOutput], index: int = 0) -> RequestOutput | None:
    for o in outputs:
        if isinstance(o, RequestOutput) and o.index == index and o.finish_reason is not None:
            return o
    return None


__all__ = ["Engine", "EngineRequest", "collect_tokens", "final_output", "TokenLogprob"]
