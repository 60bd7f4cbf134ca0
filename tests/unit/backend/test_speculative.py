"""Speculative decoding (n-gram drafts, one verify pass) is lossless, leaks nothing, and counts honestly.

- The proposer finds the latest earlier occurrence of the longest matching suffix, incrementally.
- Coupled verification draws every position from the target's distribution: a chi-square test over
  synthetic logits (no model), against the exact probabilities, and token-equal to plain sampling per seed.
- Random drafts, rejections, aborts and preemptions leave no block leaked and no rejected token hashed
  into the prefix cache (hypothesis, scheduler + block manager, no model).
- With the real model: the 6 fixture chats and 10 repetition-heavy prompts give the same tokens greedy
  with speculation on and off, each alone and all in one batch of 16, in the default CPU mode
  (``default_dtype()``: bfloat16 where the CPU multiplies bf16 natively) and in float32; 20 seeds at temperature 0.8 give the same text too, with drafts both accepted and
  rejected; the engine's counters are consistent.

Run: ``.venv/bin/python -m pytest -q tests/unit/backend/test_speculative.py``.
"""

from __future__ import annotations

import random

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.block_manager import BlockManager
from backend.engine import Engine, collect_tokens, final_output
from backend.model_path import default_dtype
from backend.proposer import DraftPolicy, NgramIndex
from backend.protocol import SamplingParams, Submit
from backend.sampling import ChoiceState, sample, verify_draft
from backend.scheduler import Scheduler
from backend.sequence import SeqStatus, Sequence

# ----------------------------------------------------------------------------------------- proposer


def _brute(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    n = len(tokens)
    for m in range(min(hi, n - 1), lo - 1, -1):
        suffix = tokens[n - m :]
        for e in range(n - 1, m - 1, -1):  # latest earlier occurrence ending at e (exclusive)
            if tokens[e - m : e] == suffix:
                return tokens[e : min(n, e + k)]
    return []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 3), st.integers(0, 2))
def test_ngram_index_matches_a_rescan(tokens, lo, extra):
    """Called after every appended token, the index proposes what a full rescan of the context finds."""
    hi = lo + extra
    idx = NgramIndex(lo, hi)
    for n in range(1, len(tokens) + 1):
        assert idx.propose(tokens[:n], 5) == _brute(tokens[:n], lo, hi, 5), (tokens[:n], lo, hi)


def test_draft_policy_backs_off_and_recovers():
    p = DraftPolicy(4, 1, 2, max_backoff=4, patience=2)
    ctx = [1, 2, 3, 1, 2]
    assert p.propose(ctx, 10) == [3, 1, 2]  # a 2-token match drafts 3
    p.record(3, 0)  # fully rejected once: within the patience, still drafting
    assert p.propose(ctx, 10) == [3, 1, 2]
    p.record(3, 0)  # twice in a row: skip the next step
    assert p.propose(ctx, 10) == []
    assert p.propose(ctx, 10) == [3, 1, 2]
    p.record(3, 0)  # again: skip two
    assert p.propose(ctx, 10) == [] and p.propose(ctx, 10) == []
    p.record(3, 2)  # an accepted token resets the back-off
    assert p.backoff == 1 and p.failures == 0 and (p.draft_tokens, p.accepted_tokens) == (12, 2)
    assert p.propose(ctx, 2) == [3, 1]  # the limit caps the draft


def test_draft_length_follows_the_match_length():
    """A match of k tokens drafts at most k + 1, capped by K: a chance 1-token match costs 2 rows."""
    p = DraftPolicy(5, 1, 8)
    assert p.propose([7, 8, 9, 7], 10) == [8, 9]  # 1-token match "7"
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    assert DraftPolicy(8, 1, 8).propose(ctx, 10) == [4, 5, 6, 7]  # 3-token match: 4 tokens
    assert DraftPolicy(3, 1, 8).propose(ctx, 10) == [4, 5, 6]  # K caps it
    assert DraftPolicy(8, 1, 8).propose(ctx[:-1], 10) == [3, 4, 5]
    assert NgramIndex(1, 8).match([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]) == (2, 2)
    with pytest.raises(ValueError):
        DraftPolicy(4, patience=0)


# ------------------------------------------------------------------------- coupled sampling (no model)

V = 6


def _state(seed: int, **kw) -> ChoiceState:
    return ChoiceState(SamplingParams(temperature=0.8, seed=seed, **kw), 0, [0], V, [])


def _probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    x = logits / temperature
    keep = torch.topk(x, top_k).indices
    p = torch.zeros(V, dtype=torch.float64)
    p[keep] = torch.softmax(x[keep].double(), 0)
    return p


def _verify_one_by_one(logits: torch.Tensor, draft: list[int], state: ChoiceState) -> tuple[list, list]:
    """What ``verify_draft`` computes, one ``sample`` call per row (the path for states that are not
    ``position_free``)."""
    toks, lps = [], []
    for j in range(len(draft) + 1):
        (t,), (lp,) = sample(logits[j : j + 1], [state])
        state.append(t)
        toks.append(t)
        lps.append(lp)
        if j == len(draft) or t != draft[j]:
            break
    return toks, lps


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0.0, "logit_bias": {"3": 4.0, "17": -2.0}, "logprobs": True, "top_logprobs": 3},
        {"temperature": 0.8},
        {"temperature": 0.8, "top_k": 20, "logprobs": True},
        {"temperature": 1.0, "top_p": 0.99},  # flat logits: the nucleus is wider than the 512 candidates
        {"temperature": 0.8, "min_p": 0.2},
        {"temperature": 0.8, "min_tokens": 2},  # reached after 2 tokens: position-free from then on
        {"temperature": 0.8, "presence_penalty": 1.5},  # not position-free: one call per row
        {"temperature": 0.8, "repetition_penalty": 1.3},
    ],
)
def test_verify_draws_every_row_as_plain_sampling(kw):
    """``verify_draft`` emits, with the same logprobs, what sampling the rows one by one emits, whether
    it draws the rows in one call (``position_free``) or one at a time. The draft is the plain draws
    themselves, so every row is accepted and every row's draw is compared."""
    V = 1000
    gen = torch.Generator().manual_seed(7)
    flat = "top_p" in kw

    def state(params: SamplingParams) -> ChoiceState:
        s = ChoiceState(params, 0, [1, 2], V, [0])
        for t in (5, 6):  # two generated tokens before the verify step
            s.append(t)
        return s

    for seed in range(12):
        logits = torch.randn(6, V, generator=gen) * (0.05 if flat else 3.0)
        params = SamplingParams(seed=seed, max_tokens=100, **kw)
        ref, draft = state(params), []
        for j in range(5):  # the plain draws of rows 0..4 as the draft
            (t,), _ = sample(logits[j : j + 1], [ref])
            ref.append(t)
            draft.append(t)
        plain = state(params)
        want, want_lp = _verify_one_by_one(logits, draft, plain)
        s = state(params)
        toks, lps, acc = verify_draft(logits, draft, s, frozenset(), 100)
        assert (toks, acc) == (want, 5) and lps == want_lp, (kw, seed)
        assert s.num_generated == plain.num_generated


def test_coupled_verification_has_the_target_distribution():
    """Two positions: the target's logits at position 1 depend on the token at position 0. The draft is
    fixed (a deterministic proposer). 20,000 seeds: the emitted pair (verify, then the next step's plain
    draw when the draft was rejected) follows the target's joint distribution (chi-square, p >= 1e-3),
    and each seed gives exactly the pair that plain sampling without speculation gives."""
    gen = torch.Generator().manual_seed(1234)
    l0 = torch.randn(V, generator=gen) * 1.5
    l1 = torch.randn(V, V, generator=gen) * 1.5  # l1[x0]: logits at position 1 after x0
    draft = [int(torch.argmax(l0)), 2]
    kw = {"top_k": 5}
    p0 = _probs(l0, 0.8, 5)
    expected = torch.stack([p0[a] * _probs(l1[a], 0.8, 5) for a in range(V)])  # [V, V] joint
    counts = torch.zeros(V, V, dtype=torch.float64)
    accepted_any = rejected_any = False
    N = 20_000
    rows = torch.stack([l0, l1[draft[0]], l1[draft[1]]]).float()
    pairs: list[list[int]] = []
    later: list[tuple[int, ChoiceState]] = []  # rejected at position 0: the next step samples position 1
    for seed in range(N):
        s = _state(seed, **kw)
        toks, _, acc = verify_draft(rows, draft, s, frozenset(), 100)
        accepted_any |= acc > 0
        rejected_any |= acc < len(draft)
        pairs.append(toks[:2])
        if len(toks) == 1:
            later.append((seed, s))
    # those next steps as the engine runs them: one batch, a row per choice (rows are independent)
    nxt, _ = sample(torch.stack([l1[pairs[seed][0]] for seed, _ in later]).float(), [s for _, s in later])
    for (seed, _), t1 in zip(later, nxt):
        pairs[seed].append(t1)
    for a, b in pairs:
        counts[a, b] += 1
    for seed in range(300):  # the same seed without speculation: one plain draw per position
        q = _state(seed, **kw)
        (a,), _ = sample(l0.unsqueeze(0), [q])
        q.append(a)
        (b,), _ = sample(l1[a].unsqueeze(0), [q])
        assert [a, b] == pairs[seed], seed
    assert accepted_any and rejected_any
    mask = expected > 0
    assert counts[~mask].sum() == 0  # nothing outside the top-k support
    e = expected[mask] * N
    chi2 = float(((counts[mask] - e) ** 2 / e).sum())
    df = int(mask.sum()) - 1
    pval = float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(chi2 / 2.0)))
    assert pval >= 1e-3, (chi2, df, pval)


# ------------------------------------------------------------------- no leaks (scheduler, no model)


def _simulate(seed: int, num_blocks: int, caching: bool) -> dict[str, int]:
    """Random sequences decode with random drafts and random acceptance; some are aborted; a small pool
    forces preemptions. Checks after every step: the refcounts match the owners, each sequence's
    prefix-cache hashes are those of its committed tokens (never a rejected draft), no sequence holds a
    block past its tokens; at the end every block is free. Returns what happened (counts)."""
    rng = random.Random(seed)
    bs = 4
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=caching)
    sch = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=24)
    seqs = []
    seen = {"verify": 0, "accepted": 0, "rejected": 0, "aborts": 0}
    for _ in range(8):
        prompt = [rng.randrange(5) for _ in range(rng.randrange(1, 10))]
        s = Sequence(prompt, max_tokens=rng.randrange(1, 14))
        seqs.append(s)
        sch.add(s)
    for _ in range(400):
        if not sch.has_work():
            break
        for s in sch.running:
            if s.num_uncomputed == 1 and rng.random() < 0.7:
                room = s.max_tokens - s.num_generated - 1
                s.draft = [rng.randrange(5) for _ in range(rng.randrange(0, 6))][: max(0, room)]
        plan = sch.schedule()
        if not plan.chunks:  # the pool cannot hold one sequence: give up on the rest
            for s in list(sch.waiting):
                sch.finish(s)
            break
        sch.update_after_step(plan)
        for c in plan.chunks:
            s = c.seq
            if s.status is not SeqStatus.RUNNING or not c.need_logits:
                continue
            acc = rng.randrange(c.num_draft + 1) if c.num_draft else 0
            if c.num_draft:
                seen["verify"] += 1
                seen["accepted"] += acc
                seen["rejected"] += c.num_draft - acc
            new = s.draft[:acc] + [rng.randrange(5)]
            if s.num_generated + len(new) >= s.max_tokens or rng.random() < 0.05:
                seen["aborts"] += 1
                sch.finish(s)  # length or an abort
                continue
            s.token_ids.extend(new)
            if c.num_draft:
                sch.accept_draft(s, acc)
            assert not s.draft
        sch.check_invariants()
        for s in sch.running:
            assert len(s.block_table) <= bm.blocks_for(len(s.token_ids))
            assert s.num_computed_tokens <= len(s.token_ids)
            for i, key in enumerate(s.block_hashes):
                toks = tuple(s.token_ids[i * bs : (i + 1) * bs])
                parent = s.block_hashes[i - 1] if i else 0x5EED
                assert key == bm._key(parent, s.cache_salt, toks)
                assert (i + 1) * bs <= s.num_computed_tokens
        for key, b in bm.key_to_block.items():
            assert bm.block_key[b] == key and len(bm.block_tokens[b]) == bs
    for s in seqs:
        sch.finish(s)
    sch.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    seen["preemptions"] = sch.num_preemptions
    return seen


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(6, 40), st.booleans())
def test_drafts_rejections_aborts_and_preemptions_leak_nothing(seed, num_blocks, caching):
    _simulate(seed, num_blocks, caching)


def test_the_simulation_exercises_every_path():
    """The simulation above does verify, accept, reject, abort and preempt (it could not pass vacuously)."""
    total: dict[str, int] = {}
    for seed in range(30):
        for k, v in _simulate(seed, 8 + seed % 20, bool(seed % 2)).items():
            total[k] = total.get(k, 0) + v
    assert all(v > 0 for v in total.values()), total


def _decoding(num_blocks: int, budget: int, prompts: list[list[int]]) -> tuple[Scheduler, list[Sequence]]:
    """A scheduler whose sequences have computed their prompts and sampled one token each."""
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=budget, watermark_blocks=0)
    seqs = [Sequence(p, max_tokens=20) for p in prompts]
    for s in seqs:
        sch.add(s)
    while any(s.num_uncomputed > 1 or s.num_computed_tokens == 0 for s in seqs):
        plan = sch.schedule()
        sch.update_after_step(plan)
        for c in plan.chunks:
            if c.need_logits:
                c.seq.token_ids.append(9)
    return sch, seqs


def test_a_draft_never_takes_a_decodes_block_or_budget():
    """Drafts get what is left once every decode has its token: the older sequence's draft would take the
    last free block the newer one's decode needs (it is cut instead: no preemption), and four drafting
    sequences on a budget of 8 tokens still all decode."""
    sch, (a, b) = _decoding(5, 64, [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8]])
    a.draft = [1, 2, 3]
    plan = sch.schedule()
    assert not plan.preempted and sch.num_preemptions == 0
    assert sorted((c.num_tokens, c.num_draft) for c in plan.chunks) == [(1, 0), (2, 1)]
    sch, seqs = _decoding(64, 8, [[1, 2, 3, 4, 5]] * 4)
    for s in seqs:
        s.draft = [1, 2, 3]
    plan = sch.schedule()
    assert {c.seq.seq_id for c in plan.chunks} == {s.seq_id for s in seqs}
    assert plan.num_tokens == 8 and sum(c.num_draft for c in plan.chunks) == 4


# ------------------------------------------------------------------------------ the real model

NEW_TOKENS = 12  # per choice: the runs below take ~40 s on a 2-core VM in float32 (one thread)
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
PARAGRAPH = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
    "they agreed to fund the reading room, the children's corner and the archive, but postponed the cafe "
    "until next year, when the city expects more revenue from the harbour tax."
)
CODE = "def area(w, h):\n    return w + h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
REPETITION = [
    [("user", f"Repeat this paragraph exactly:\n\n{PARAGRAPH}")],
    [("user", f"Copy the following text word for word:\n{PARAGRAPH}")],
    [("user", f"Fix the bug in area and return the whole file:\n\n{CODE}")],
    [("user", f"Rename the parameter w to width in this code:\n\n{CODE}")],
    [("user", f'Extract JSON with keys "day", "funded", "postponed" from: {PARAGRAPH}')],
    [("user", "Extract the name, age and city as JSON: Maria Lopez is 34 and lives in Porto.")],
    [("user", "List the numbers 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 again, separated by commas.")],
    [("user", f"Summarize in one sentence: {PARAGRAPH}")],
    [
        ("user", "My name is Ada and I live in Lyon. What is my name?"),
        ("assistant", "Your name is Ada and you live in Lyon."),
        ("user", "Where do I live, and what is my name? Answer in the same words."),
    ],
    [("user", "Say 'hello world' five times.")],
]


def _chatml(turns: list[tuple[str, str]]) -> str:
    out = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    for role, text in turns:
        out += f"<|im_start|>{role}\n{text}<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def prompts(chat_fixtures, model_path) -> list[list[int]]:
    from templating.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    return [c["prompt_ids"] for c in chat_fixtures] + [tok.encode_prompt(_chatml(t)) for t in REPETITION]


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    res = engine.generate(
        [Submit(request_id=str(i), prompt_ids=p, sampling=s) for i, (p, s) in enumerate(zip(prompts, params))]
    )
    out = []
    for i in range(len(prompts)):
        fin = final_output(res[str(i)])
        out.append((collect_tokens(res[str(i)]), fin.finish_reason, fin.stop_token_id))
    return out


def _check_counters(engine: Engine) -> None:
    st = engine.stats()
    assert 0 <= st.spec_accepted_tokens <= st.spec_draft_tokens
    assert st.spec_drafts <= st.spec_draft_tokens <= st.spec_drafts * engine.num_speculative_tokens
    assert sum(st.spec_accepted_per_pos) == st.spec_accepted_tokens
    assert all(a >= b for a, b in zip(st.spec_accepted_per_pos, st.spec_accepted_per_pos[1:]))
    assert st.kv_blocks_used == 0  # everything given back


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "exact"])
def test_greedy_is_lossless_alone_and_in_a_batch(one_thread_runner, prompts, mode):
    """The served default mode: the 16 prompts; the exact mode (float32, dense weights; 3-7x slower per token
    than the default): the 10 repetition-heavy ones. ``NEW_TOKENS`` each."""
    runner = one_thread_runner(default_dtype(), "auto") if mode == "default" else one_thread_runner("float32")
    full = mode == "default"
    chosen = prompts if full else prompts[6:]
    n = NEW_TOKENS
    greedy = [SamplingParams(temperature=0.0, max_tokens=n)] * len(chosen)
    eng = Engine(runner, num_speculative_tokens=5, speculative_max_batch=16)
    # one cold batch with speculation on (chunked prefills beside verify chunks); its prompts stay in the
    # prefix cache for the run with it off (each request opts out) and the runs alone (prefix caching and
    # batching are invariant: test_invariance)
    batch = _run(eng, chosen, greedy)
    drafts = eng.stats().spec_drafts
    ref = _run(eng, chosen, [SamplingParams(temperature=0.0, max_tokens=n, speculative=False)] * len(chosen))
    assert eng.stats().spec_drafts == drafts
    alone = [_run(eng, [p], greedy[:1])[0] for p in chosen]
    assert batch == ref
    assert alone == ref
    st = eng.stats()
    assert st.spec_accepted_tokens > 0 and st.spec_accepted_tokens < st.spec_draft_tokens
    _check_counters(eng)


@pytest.mark.slow
def test_seeded_sampling_is_lossless_with_drafts_accepted_and_rejected(one_thread_runner, prompts):
    runner = one_thread_runner(default_dtype(), "auto")
    p = prompts[6]  # repeat a paragraph
    seeded = [SamplingParams(temperature=0.8, seed=s, max_tokens=16) for s in range(20)]  # 12: too few differ
    eng = Engine(runner, num_speculative_tokens=5, speculative_max_batch=32)
    _run(eng, [p], [SamplingParams(temperature=0.0, max_tokens=1)])  # the prompt's blocks, cached once
    off = _run(eng, [p] * 20, [msgspec.structs.replace(s, speculative=False) for s in seeded])
    assert eng.stats().spec_drafts == 0
    on = _run(eng, [p] * 20, seeded)
    assert on == off
    assert len({tuple(t) for t, _, _ in off}) > 5  # the seeds differ (a quote: few ways to say it)
    st = eng.stats()
    rate = st.spec_accepted_tokens / st.spec_draft_tokens
    assert 0.05 < rate < 0.95, rate
    _check_counters(eng)
