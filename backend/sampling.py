"""Batched token sampler with per-request parameters (OpenAI / vLLM semantics).

One call samples one token for every row of a ``[B, V]`` float32 logits
tensor, each row with its own ``ChoiceState`` (parameters, random generator,
penalty counters). Order of operations per row, all in float32:

1. ``raw = log_softmax(logits)``: the distribution reported by ``logprobs`` /
   ``top_logprobs`` (before any bias, penalty or filtering, like vLLM's
   default "raw_logprobs").
2. ``logit_bias`` added (OpenAI: added to the logits before sampling).
3. ``min_tokens``: EOS and stop ids masked to ``-inf`` until that many tokens
   were generated. (``ignore_eos`` is the engine's business: EOS is then an
   ordinary token that does not end the choice.)
4. Penalties. ``presence_penalty`` / ``frequency_penalty`` count generated
   tokens only (OpenAI API reference, "Parameter details"):
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
   ``repetition_penalty`` (CTRL, Keskar et al. 2019, as in HF/vLLM) covers
   prompt *and* generated tokens, like vLLM: positive logits are divided by
   it, negative ones multiplied. EOS and stop ids are never penalised.
5. Greedy rows (``temperature == 0``): ``argmax``; no random generator is
   touched. Other rows: ``/ temperature``, top-k, top-p (nucleus), min-p,
   softmax, then one draw from the row's own ``torch.Generator``.

Seeds: each choice owns a CPU ``torch.Generator``. With ``seed`` given, choice
``i`` is seeded with ``blake2b(f"{seed}:{i}")`` (64 bits): the same seed and
request give the same tokens whatever else is in the batch, and the ``n``
choices differ. Any Python int is accepted (negative or huge included; it is
hashed). With no seed, each choice gets 64 fresh random bits from ``secrets``.

Source followed: OpenAI API reference (chat completions: temperature, top_p,
presence/frequency penalty, logit_bias, logprobs, seed); vLLM's sampler and
``SamplingParams``; nano-vllm's sampler.
"""

from __future__ import annotations

import hashlib
import secrets

import torch

from backend.protocol import SamplingParams, TokenLogprob

MAX_TOP_LOGPROBS = 20


def choice_seed(seed: int | None, index: int) -> int:
    """64-bit generator seed of choice ``index`` (fresh random when ``seed`` is None)."""
    if seed is None:
        return secrets.randbits(64)
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class ChoiceState:
    """Sampling state of one choice (one sequence).

    Args:
        params: the request's ``SamplingParams``.
        index: choice index (seed derivation).
        prompt_ids: the prompt, for ``repetition_penalty``.
        vocab_size: logits width V.
        eos_token_ids: the model's EOS ids (masked under ``min_tokens``; never penalised).

    Attributes:
        generator: CPU ``torch.Generator`` (None for greedy).
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
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(choice_seed(params.seed, index))
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

    def append(self, token_id: int) -> None:
        """Record a sampled token (O(1); EOS/stop ids are not counted for penalties)."""
        self.num_generated += 1
        if token_id in self.stop_ids:
            return
        if self.counts is not None:
            self.counts[token_id] += 1.0
        if self.seen is not None:
            self.seen[token_id] = True


def _apply_top_k_top_p_min_p(x: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Filter ``x [R, V]`` (temperature-scaled logits) in place-ish; returns the filtered tensor."""
    R, V = x.shape
    if any(0 < k < V for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        mask = torch.zeros_like(sorted_x, dtype=torch.bool)
        ks = [k if 0 < k < V else V for k in top_k]
        if any(k < V for k in ks):
            k_t = torch.tensor(ks, dtype=torch.int64).unsqueeze(1)
            mask |= torch.arange(V).unsqueeze(0) >= k_t
        if any(p < 1.0 for p in top_p):
            probs = torch.softmax(sorted_x.masked_fill(mask, float("-inf")), dim=-1)
            cum = probs.cumsum(dim=-1)
            p_t = torch.tensor(top_p, dtype=torch.float32).unsqueeze(1)
            # drop a token when the mass before it already reaches top_p (keeps at least one)
            mask |= (cum - probs) >= p_t
        sorted_x = sorted_x.masked_fill(mask, float("-inf"))
        x = torch.empty_like(x).scatter_(1, idx, sorted_x)
    if any(m > 0 for m in min_p):
        probs = torch.softmax(x, dim=-1)
        thr = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, dtype=torch.float32).unsqueeze(1)
        x = x.masked_fill(probs < thr, float("-inf"))
    return x


def process_logits(logits: torch.Tensor, states: list[ChoiceState]) -> torch.Tensor:
    """Apply logit_bias, the min_tokens mask and penalties (steps 2-4 of the module docstring).

    Args:
        logits: ``[B, V] float32`` CPU, row ``i`` for ``states[i]`` (not modified).

    Returns:
        ``[B, V] float32``: ``logits`` itself when no row has anything to apply, else a copy.
    """
    B = len(states)
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
        if s.num_generated < p.min_tokens and s.stop_ids_t is not None:
            writable()[i].index_fill_(0, s.stop_ids_t, float("-inf"))

    pen_rows = [i for i, s in enumerate(states) if s.counts is not None]
    if pen_rows:
        xx = writable()
        counts = torch.stack([states[i].counts for i in pen_rows])  # type: ignore[misc]
        freq = torch.tensor([states[i].params.frequency_penalty for i in pen_rows], dtype=torch.float32).unsqueeze(1)
        pres = torch.tensor([states[i].params.presence_penalty for i in pen_rows], dtype=torch.float32).unsqueeze(1)
        rows_t = torch.tensor(pen_rows, dtype=torch.int64)
        xx[rows_t] = xx[rows_t] - freq * counts - pres * (counts > 0).float()
    rep_rows = [i for i, s in enumerate(states) if s.seen is not None]
    if rep_rows:
        xx = writable()
        seen = torch.stack([states[i].seen for i in rep_rows])  # type: ignore[misc]
        rp = torch.tensor([states[i].params.repetition_penalty for i in rep_rows], dtype=torch.float32).unsqueeze(1)
        rows_t = torch.tensor(rep_rows, dtype=torch.int64)
        sub = xx[rows_t]
        sub = torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub)
        xx[rows_t] = sub

    return x


def sample(logits: torch.Tensor, states: list[ChoiceState]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Sample one token per row.

    Args:
        logits: ``[B, V] float32`` (any device; moved to CPU), row ``i`` for ``states[i]``.
        states: per-row ``ChoiceState`` (not modified; call ``state.append`` after).

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
        temps = torch.tensor([states[i].params.temperature for i in rand], dtype=torch.float32).unsqueeze(1)
        sub = sub / temps
        sub = _apply_top_k_top_p_min_p(
            sub,
            [states[i].params.top_k for i in rand],
            [states[i].params.top_p for i in rand],
            [states[i].params.min_p for i in rand],
        )
        probs = torch.softmax(sub, dim=-1)
        for r, i in enumerate(rand):
            tokens[i] = int(torch.multinomial(probs[r], 1, generator=states[i].generator).item())

    out_lp: list[TokenLogprob | None] = [None] * B
    if raw is not None:
        for r, i in enumerate(lp_rows):
            k = states[i].top_logprobs
            row = raw[r]
            top: list[tuple[int, float]] = []
            if k > 0:
                vals, ids = torch.topk(row, k)
                top = list(zip(ids.tolist(), vals.tolist()))
            out_lp[i] = TokenLogprob(tokens[i], float(row[tokens[i]].item()), top)
    return tokens, out_lp
