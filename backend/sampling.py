"""Batched token sampler with per-request parameters (OpenAI / vLLM semantics).

One call samples one token for every row of a ``[B, V]`` float32 logits
tensor, each row with its own ``ChoiceState`` (parameters, random generator,
penalty counters). Order of operations per row, all in float32:

0. Grammar mask (constrained rows only, ``allowed``): tokens the row's grammar
   does not allow get ``-inf`` (``backend.grammar``).
1. ``raw = log_softmax(logits)``: the distribution reported by ``logprobs`` /
   ``top_logprobs`` (before any bias, penalty or filtering, like vLLM's
   default "raw_logprobs"; after the grammar mask, so a constrained row reports
   the distribution its token was drawn from, renormalised over the allowed tokens).
2. ``logit_bias`` added (OpenAI: added to the logits before sampling).
3. ``min_tokens``: EOS and stop ids masked to ``-inf`` until that many tokens
   were generated (not on constrained rows: a complete grammar ends the choice). (``ignore_eos`` is the engine's business: EOS is then an
   ordinary token that does not end the choice.)
4. Penalties. ``presence_penalty`` / ``frequency_penalty`` count generated
   tokens only (OpenAI API reference, "Parameter details"):
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
   ``repetition_penalty`` (CTRL, Keskar et al. 2019, as in HF/vLLM) covers
   prompt *and* generated tokens, like vLLM: positive logits are divided by
   it, negative ones multiplied. EOS and stop ids are never penalised.
5. Greedy rows (``temperature == 0``): ``argmax``; no random number is drawn. Other rows:
   ``/ temperature``, top-k, top-p (nucleus), min-p, softmax, then one inverse-CDF draw with the
   uniform number of the token's position.

Random numbers are counter-based, not a stateful generator: the uniform for choice ``i``'s ``j``-th
generated token is ``blake2b(j, key=choice seed)`` (52 bits, ``CounterRNG``), a function of
(request seed, choice, position) alone. A token's draw therefore never depends on how many numbers were
used before it, which is what keeps speculative decoding exact and seeded output identical with it on
or off (coupled sampling: the draw at a verified position is the target's own sample; the draft is
accepted iff it equals it; ``backend.engine``). With ``seed`` given, choice ``i``'s key is
``blake2b(f"{seed}:{i}")`` (64 bits): the same seed and request give the same tokens whatever else is
in the batch, and the ``n`` choices differ. Any Python int is accepted (negative or huge included; it
is hashed). With no seed, each choice gets 64 fresh random bits from ``secrets``.

Source followed: OpenAI API reference (chat completions: temperature, top_p,
presence/frequency penalty, logit_bias, logprobs, seed); vLLM's sampler and
``SamplingParams``; nano-vllm's sampler.
"""

from __future__ import annotations

import hashlib
import secrets

import torch

from backend.grammar import Masks, apply_masks
from backend.protocol import SamplingParams, TokenLogprob
from backend.sampling_rules import MAX_TOP_LOGPROBS


def choice_seed(seed: int | None, index: int) -> int:
    """64-bit generator seed of choice ``index`` (fresh random when ``seed`` is None)."""
    if seed is None:
        return secrets.randbits(64)
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class CounterRNG:
    """Counter-based uniform numbers: ``uniform(j)`` is a pure function of the 64-bit key and ``j``.

    ``blake2b`` keyed with the key, over ``j`` as 8 little-endian bytes; the top 52 bits of the 64-bit
    digest scaled to ``[0, 1)`` (float64; at most ``1 - 2**-52``, so ``u * total < total`` for any total). About 1 us per number. Source followed: Salmon et al.,
    "Parallel random numbers: as easy as 1, 2, 3" (SC 2011) for counter-based generation.
    """

    __slots__ = ("key",)

    def __init__(self, seed64: int) -> None:
        self.key = (seed64 & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")

    def uniform(self, counter: int) -> float:
        """The uniform number of position ``counter`` (an int >= 0), in ``[0, 1)``."""
        d = hashlib.blake2b(counter.to_bytes(8, "little"), key=self.key, digest_size=8).digest()
        return (int.from_bytes(d, "little") >> 12) * (1.0 / (1 << 52))


class ChoiceState:
    """Sampling state of one choice (one sequence).

    Args:
        params: the request's ``SamplingParams``.
        index: choice index (seed derivation).
        prompt_ids: the prompt, for ``repetition_penalty``.
        vocab_size: logits width V.
        eos_token_ids: the model's EOS ids (masked under ``min_tokens``; never penalised).

    Attributes:
        generator: the choice's ``CounterRNG`` (None for greedy); the token at generated position ``j``
            (``num_generated`` when it is drawn) uses ``generator.uniform(j)``.
        counts: ``[V] float32`` generated-token counts (only with presence/frequency penalty).
        seen: ``[V] bool`` prompt + generated tokens (only with repetition_penalty != 1).
        num_generated: tokens sampled so far.
    """

    __slots__ = (
        "params",
        "generator",
        "counts",
        "seen",
        "num_generated",
        "stop_ids",
        "stop_ids_t",
        "bias_ids",
        "bias_vals",
        "want_logprobs",
        "top_logprobs",
        "matcher",
    )

    def __init__(
        self,
        params: SamplingParams,
        index: int,
        prompt_ids: list[int],
        vocab_size: int,
        eos_token_ids: list[int],
    ) -> None:
        self.params = params
        self.num_generated = 0
        self.generator: CounterRNG | None = None
        if params.temperature > 0:
            self.generator = CounterRNG(choice_seed(params.seed, index))
        stop = sorted(set(eos_token_ids) | set(params.stop_token_ids))
        self.stop_ids = stop
        self.stop_ids_t = torch.tensor(stop, dtype=torch.int64) if stop else None
        self.counts: torch.Tensor | None = None
        if params.presence_penalty != 0 or params.frequency_penalty != 0:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32)
        self.seen: torch.Tensor | None = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)
            if prompt_ids:
                self.seen[torch.tensor(prompt_ids, dtype=torch.int64)] = True
            if self.stop_ids_t is not None:
                self.seen[self.stop_ids_t] = False
        if params.logit_bias:
            items = sorted(params.logit_bias.items())
            self.bias_ids = torch.tensor([int(k) for k, _ in items], dtype=torch.int64)
            self.bias_vals = torch.tensor([float(v) for _, v in items], dtype=torch.float32)
        else:
            self.bias_ids = self.bias_vals = None
        self.top_logprobs = min(int(params.top_logprobs), MAX_TOP_LOGPROBS)
        self.want_logprobs = bool(params.logprobs) or self.top_logprobs > 0
        self.matcher: object | None = None  # the choice's grammar state (backend.grammar), if constrained

    def append(self, token_id: int) -> None:
        """Record a sampled token (O(1); EOS/stop ids are not counted for penalties)."""
        self.num_generated += 1
        if token_id in self.stop_ids:
            return
        if self.counts is not None:
            self.counts[token_id] += 1.0
        if self.seen is not None:
            self.seen[token_id] = True


_CANDIDATES = 512  # top-k/top-p/min-p rows first look at this many best tokens


def _draw(cdf: torch.Tensor, states: list[ChoiceState], ahead: list[int] | None = None) -> list[int]:
    """Inverse-CDF draw: per row the uniform of the row's next position (``CounterRNG``), or of the
    position ``ahead[r]`` tokens past it.

    ``cdf [R, K]`` non-decreasing (unnormalised). Returns R column indices. The target is kept strictly
    below the row's total (``u`` within ``2**-25`` of 1 would round to it in float32 and take the last
    column, of zero probability or not), so a column of zero probability is never picked.
    """
    offs = ahead or [0] * len(states)
    u = torch.tensor(
        [s.generator.uniform(s.num_generated + o) for s, o in zip(states, offs)],  # type: ignore[union-attr]
        dtype=torch.float64,
    ).to(cdf.dtype)
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    return idx.clamp_(max=cdf.shape[1] - 1).tolist()


def _sample_random(x: torch.Tensor, states: list[ChoiceState], ahead: list[int] | None = None) -> list[int]:
    """Temperature, top-k, top-p, min-p, then one draw per row (rows independent of each other).

    ``x [R, V]`` processed logits; ``ahead``: as ``_draw``'s (None: every row at its next position).
    Filters work on the ``_CANDIDATES`` best tokens of a row (``topk``, sorted), falling back to the full
    vocabulary for a row whose top-p nucleus is not inside them; rows without filters draw from the full
    softmax.
    Cost: O(R * V) plus O(R * V) ``topk`` for filtered rows (no full sort).
    """
    R, V = x.shape
    temps = torch.tensor([s.params.temperature for s in states], dtype=torch.float32).unsqueeze(1)
    probs = torch.softmax(x / temps, dim=-1)
    out = [0] * R
    filt = [
        r
        for r, s in enumerate(states)
        if (0 < s.params.top_k < V) or s.params.top_p < 1.0 or s.params.min_p > 0
    ]
    filt_set = set(filt)
    plain = [r for r in range(R) if r not in filt_set]
    offs = ahead or [0] * R
    if plain:
        sub = probs if len(plain) == R else probs[plain]
        draws = _draw(torch.cumsum(sub, dim=-1), [states[r] for r in plain], [offs[r] for r in plain])
        for r, t in zip(plain, draws):
            out[r] = t
    if filt:
        # rows grouped by their own candidate count: a row's draw never depends on the other rows
        groups: dict[int, list[int]] = {}
        for r in filt:
            k = states[r].params.top_k
            groups.setdefault(min(V, max(_CANDIDATES, k if 0 < k < V else 0)), []).append(r)
        for kc, rows in groups.items():
            _sample_filtered(probs, states, rows, kc, out, offs)
    return out


def _sample_filtered(
    probs: torch.Tensor, states: list[ChoiceState], filt: list[int], kc: int, out: list[int], ahead: list[int]
) -> None:
    """Top-k, top-p, min-p and one draw for the rows ``filt`` of ``probs [R, V]`` (softmax after
    temperature), each over its ``kc`` best tokens (wider for a nucleus not inside them); writes
    ``out[r]``. ``ahead[r]``: as ``_draw``'s."""
    V = probs.shape[1]
    ks = [states[r].params.top_k if 0 < states[r].params.top_k < V else V for r in filt]
    tp = [states[r].params.top_p for r in filt]
    # a row without top-k whose nucleus is not inside the candidates needs the whole vocabulary
    sub = probs[filt]
    vals, idx = torch.topk(sub, kc, dim=-1)
    if kc < V:
        mass = vals.sum(-1).tolist()
        wide = [i for i in range(len(filt)) if ks[i] == V and tp[i] < 1.0 and mass[i] < tp[i]]
        if wide:
            # nucleus wider than the candidates: find the probability threshold by bisection
            # (O(V) per iteration, no full sort), then keep the tokens at or above it
            w = sub[wide]
            lo = torch.zeros(len(wide), 1)
            hi = vals[wide, -1:].clone()  # mass above hi < top_p
            p_t = torch.tensor([tp[i] for i in wide]).unsqueeze(1)
            for _ in range(40):
                mid = (lo + hi) / 2
                ok = (w * (w >= mid)).sum(-1, keepdim=True) >= p_t
                lo = torch.where(ok, mid, lo)
                hi = torch.where(ok, hi, mid)
            for j, i in enumerate(wide):
                row = w[j]
                keep = (row >= lo[j]).nonzero().squeeze(1)
                r = filt[i]
                pr = row[keep].double()
                mpv = states[r].params.min_p
                if mpv > 0:
                    pr = torch.where(pr >= pr.max() * mpv, pr, torch.zeros_like(pr))
                (c,) = _draw(torch.cumsum(pr, 0).unsqueeze(0), [states[r]], [ahead[r]])
                out[r] = int(keep[c])
            wide_set = set(wide)
            rest = [i for i in range(len(filt)) if i not in wide_set]
            if not rest:
                return
            filt = [filt[i] for i in rest]
            ks = [ks[i] for i in rest]
            tp = [tp[i] for i in rest]
            vals, idx = vals[rest], idx[rest]
    k_t = torch.tensor(ks, dtype=torch.int64).unsqueeze(1)
    mask = torch.arange(kc).unsqueeze(0) >= k_t
    pv = vals.masked_fill(mask, 0.0)
    # top-p on the distribution left by top-k (renormalised), like vLLM
    pv = pv / pv.sum(-1, keepdim=True)
    if any(p < 1.0 for p in tp):
        has_k = torch.tensor([k < V for k in ks]).unsqueeze(1)
        # rows without top-k: mass relative to the whole vocabulary
        ref = torch.where(has_k, pv, vals)
        cum = torch.cumsum(ref, dim=-1)
        mask |= (cum - ref) >= torch.tensor(tp, dtype=torch.float32).unsqueeze(1)
    mp = [states[r].params.min_p for r in filt]
    if any(m > 0 for m in mp):
        mask |= pv < pv[:, :1] * torch.tensor(mp, dtype=torch.float32).unsqueeze(1)
    pv = pv.masked_fill(mask, 0.0)
    cols = _draw(torch.cumsum(pv, dim=-1), [states[r] for r in filt], [ahead[r] for r in filt])
    picked = idx.gather(1, torch.tensor(cols, dtype=torch.int64).unsqueeze(1)).squeeze(1).tolist()
    for r, t in zip(filt, picked):
        out[r] = t


def process_logits(logits: torch.Tensor, states: list[ChoiceState]) -> torch.Tensor:
    """Apply logit_bias, the min_tokens mask and penalties (steps 2-4 of the module docstring).

    Args:
        logits: ``[B, V] float32`` CPU, row ``i`` for ``states[i]`` (not modified).

    Returns:
        ``[B, V] float32``: ``logits`` itself when no row has anything to apply, else a copy.
    """
    x = logits
    modified = False

    def writable() -> torch.Tensor:
        nonlocal x, modified
        if not modified:
            x = x.clone()
            modified = True
        return x

    for i, s in enumerate(states):
        if s.bias_ids is not None:
            writable()[i].index_add_(0, s.bias_ids, s.bias_vals)
        p = s.params
        if s.num_generated < p.min_tokens and s.stop_ids_t is not None and s.matcher is None:
            writable()[i].index_fill_(0, s.stop_ids_t, float("-inf"))

    pen_rows = [i for i, s in enumerate(states) if s.counts is not None]
    if pen_rows:
        xx = writable()
        counts = torch.stack([states[i].counts for i in pen_rows])  # type: ignore[misc]
        freq = torch.tensor(
            [states[i].params.frequency_penalty for i in pen_rows], dtype=torch.float32
        ).unsqueeze(1)
        pres = torch.tensor(
            [states[i].params.presence_penalty for i in pen_rows], dtype=torch.float32
        ).unsqueeze(1)
        rows_t = torch.tensor(pen_rows, dtype=torch.int64)
        xx[rows_t] = xx[rows_t] - freq * counts - pres * (counts > 0).float()
    rep_rows = [i for i, s in enumerate(states) if s.seen is not None]
    if rep_rows:
        xx = writable()
        seen = torch.stack([states[i].seen for i in rep_rows])  # type: ignore[misc]
        rp = torch.tensor(
            [states[i].params.repetition_penalty for i in rep_rows], dtype=torch.float32
        ).unsqueeze(1)
        rows_t = torch.tensor(rep_rows, dtype=torch.int64)
        sub = xx[rows_t]
        sub = torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub)
        xx[rows_t] = sub

    return x


def sample(
    logits: torch.Tensor,
    states: list[ChoiceState],
    allowed: Masks | None = None,
    ahead: list[int] | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Sample one token per row.

    Args:
        logits: ``[B, V] float32`` (any device; moved to CPU), row ``i`` for ``states[i]``.
        states: per-row ``ChoiceState`` (not modified; call ``state.append`` after). One state may
            stand for several rows (``ahead``).
        allowed: grammar masks (``backend.grammar.Masks``): row ``rows[j]`` may only take the tokens
            ``allowed[j]`` marks; None: no constrained row. The masked rows of ``logits`` are overwritten
            in place.
        ahead: row ``i`` draws with the uniform of the position ``ahead[i]`` tokens past
            ``states[i]``'s next one (None: all 0). Only for states whose transforms do not depend on
            the tokens in between (``position_free``).

    Returns:
        ``(token_ids, logprobs)``: B ints, and per row a ``TokenLogprob`` (raw
        log-softmax of the chosen token and its ``top_logprobs`` best alternatives)
        or None when the request asked for no logprobs.
    """
    B = len(states)
    if logits.device.type != "cpu":
        logits = logits.float().cpu()
    logits = logits.float()
    assert logits.shape[0] == B, (logits.shape, B)
    if allowed is not None:  # in place: the caller hands its logits over (the engine never reads them again)
        apply_masks(logits, allowed)

    lp_rows = [i for i, s in enumerate(states) if s.want_logprobs]
    raw = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None
    x = process_logits(logits, states)

    tokens = [0] * B
    greedy = [i for i, s in enumerate(states) if s.generator is None]
    rand = [i for i, s in enumerate(states) if s.generator is not None]
    if greedy:
        if len(greedy) == B:
            am = torch.argmax(x, dim=-1).tolist()
        else:
            am = torch.argmax(x[greedy], dim=-1).tolist()
        for i, t in zip(greedy, am):
            tokens[i] = t
    if rand:
        sub = x[rand] if len(rand) != B else x
        offs = None if ahead is None else [ahead[i] for i in rand]
        for i, t in zip(rand, _sample_random(sub, [states[i] for i in rand], offs)):
            tokens[i] = t

    out_lp: list[TokenLogprob | None] = [None] * B
    if raw is not None:
        for r, i in enumerate(lp_rows):
            k = states[i].top_logprobs
            row = raw[r]
            top: list[tuple[int, float]] = []
            if k > 0:
                vals, ids = torch.topk(row, k)
                # a grammar may allow fewer than k tokens: the masked ones (-inf) are not alternatives
                top = [(t, v) for t, v in zip(ids.tolist(), vals.tolist()) if v != float("-inf")]
            out_lp[i] = TokenLogprob(tokens[i], float(row[tokens[i]].item()), top)
    return tokens, out_lp


def position_free(state: ChoiceState) -> bool:
    """Whether ``state``'s next draws depend on nothing but their row and position: no penalty counts,
    no grammar, and ``min_tokens`` (if any) already reached, so the tokens emitted in between do not
    change how a later row is transformed."""
    return (
        state.counts is None
        and state.seen is None
        and state.matcher is None
        and (state.stop_ids_t is None or state.num_generated >= state.params.min_tokens)
    )


def verify_draft(
    logits: torch.Tensor,
    draft: list[int],
    state: ChoiceState,
    stop_ids: frozenset[int] | set[int],
    max_tokens: int,
) -> tuple[list[int], list[TokenLogprob | None], int]:
    """Coupled verification of ``draft`` against the target's logits (speculative decoding).

    Args:
        logits: ``[d + 1, V] float32``: row ``j`` is the target's next-token logits after the context
            plus ``draft[:j]`` (the verify pass's rows).
        draft: the ``d`` proposed tokens.
        state: the choice's ``ChoiceState``; every emitted token is appended to it (``state.append``).
        stop_ids: tokens that end the choice (EOS, stop ids): nothing is emitted after one.
        max_tokens: the choice's generation limit (tokens).

    Position by position, the token is drawn exactly as ``sample`` draws it (every transform, the
    position's own uniform number; all rows in one ``sample`` call when the state is
    ``position_free``); the draft token there is accepted iff the drawn token equals it.
    Emission stops at the first mismatch (the drawn token replaces the draft's), after the token that
    follows an all-accepted draft, at a stop token or at ``max_tokens``. Every emitted token is a
    draw from the target's distribution given the tokens before it, so the output has the target's
    distribution, and with a seed it is the same token sequence as without speculation (Leviathan et
    al., ICML 2023, with the draft deterministic and the randomness shared through ``CounterRNG``).

    Returns:
        ``(tokens, logprobs, accepted)``: the emitted tokens (``1..d + 1``), their ``TokenLogprob`` or
        None each, and how many of them were accepted draft tokens.
    """
    toks: list[int] = []
    lps: list[TokenLogprob | None] = []
    accepted = 0
    d = len(draft)
    drawn: tuple[list[int], list[TokenLogprob | None]] | None = None
    if position_free(state):  # one call for all rows: row j as ``sample`` would draw it at position j
        drawn = sample(logits[: d + 1], [state] * (d + 1), ahead=list(range(d + 1)))
    for j in range(d + 1):
        if drawn is not None:
            tok, lp = drawn[0][j], drawn[1][j]
        else:
            (tok,), (lp,) = sample(logits[j : j + 1], [state])
        state.append(tok)
        toks.append(tok)
        lps.append(lp)
        if j == d or tok != draft[j]:
            break
        accepted += 1
        if tok in stop_ids or state.num_generated >= max_tokens:
            break
    return toks, lps, accepted
