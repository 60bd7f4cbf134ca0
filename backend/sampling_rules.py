"""The rules of the sampling parameters, in one place: the gateway applies them to a request (a 400 naming
the parameter) and the engine to every ``Submit`` frame (a ``RequestError``), so both accept the same set.

Each check returns a ``Violation`` (the parameter and a message for the client) or None. Ranges (OpenAI API
reference "Create chat completion"; vLLM's extra parameters):

    n                    [1, 16]
    max_tokens           >= 1 (tokens); min_tokens: [0, max_tokens]
    temperature          [0, 2]            top_p  (0, 1]         min_p  [0, 1]
    top_k                -1 or 0 (disabled), or positive
    presence_penalty     [-2, 2]           frequency_penalty     [-2, 2]
    repetition_penalty   (0, 2]
    logit_bias           token id in [0, vocab) -> bias in [-100, 100]
    stop_token_ids       token ids in [0, vocab)
    top_logprobs         [0, 20]

NaN and infinities are outside every range. The backend imports nothing from the gateway; this module
imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec

from backend.protocol import SamplingParams

MAX_N = 16
MAX_TOP_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0


class Violation(msgspec.Struct, frozen=True):
    """A parameter outside its rule: ``param`` (its API name) and ``message`` (for the client)."""

    param: str
    message: str


class Range(msgspec.Struct, frozen=True):
    """``lo <= v <= hi`` (``lo < v`` when ``lo_open``), finite."""

    lo: float
    hi: float
    lo_open: bool = False

    def contains(self, v: float) -> bool:
        return math.isfinite(v) and (v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi

    def describe(self) -> str:
        return f"{'>' if self.lo_open else '>='} {self.lo} and <= {self.hi}"


FLOAT_RANGES: dict[str, Range] = {
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "min_p": Range(0.0, 1.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 2.0, lo_open=True),
}


def check_float(name: str, value: float | None) -> Violation | None:
    """``value`` of the float parameter ``name`` (a key of ``FLOAT_RANGES``); None is "not given"."""
    rng = FLOAT_RANGES[name]
    if value is None or rng.contains(value):
        return None
    return Violation(name, f"Invalid value for '{name}': {value} (must be {rng.describe()}).")


def check_n(n: int) -> Violation | None:
    if 1 <= n <= MAX_N:
        return None
    return Violation("n", f"Invalid value for 'n': {n} (must be between 1 and {MAX_N}).")


def check_max_tokens(value: int | None, *, param: str = "max_tokens") -> Violation | None:
    """A token limit (``max_tokens`` or ``max_completion_tokens``): >= 1; None is "not given"."""
    if value is None or value >= 1:
        return None
    return Violation(param, f"Invalid value for '{param}': {value} (must be >= 1).")


def check_min_tokens(min_tokens: int, max_tokens: int | None) -> Violation | None:
    if min_tokens < 0:
        return Violation("min_tokens", "Invalid value for 'min_tokens': must be >= 0.")
    if max_tokens is not None and min_tokens > max_tokens:
        return Violation(
            "min_tokens",
            f"Invalid value for 'min_tokens': {min_tokens} is larger than max_tokens ({max_tokens}).",
        )
    return None


def check_top_k(top_k: int | None) -> Violation | None:
    if top_k is None or top_k >= -1:
        return None
    return Violation("top_k", f"Invalid value for 'top_k': {top_k} (must be -1, 0 (disabled) or positive).")


def check_top_logprobs(
    k: int | None, *, param: str = "top_logprobs", most: int = MAX_TOP_LOGPROBS
) -> Violation | None:
    """Alternatives per token (``top_logprobs``; the legacy ``logprobs`` allows fewer: ``most``)."""
    if k is None or 0 <= k <= most:
        return None
    return Violation(param, f"Invalid value for '{param}': {k} (must be between 0 and {most}).")


def check_logit_bias(bias: dict[int, float], vocab_size: int) -> Violation | None:
    for tid, val in bias.items():
        if not 0 <= tid < vocab_size:
            return Violation(
                "logit_bias", f"Invalid key in 'logit_bias': {tid} is not a token id in [0, {vocab_size})."
            )
        if not (math.isfinite(val) and -LOGIT_BIAS_LIMIT <= val <= LOGIT_BIAS_LIMIT):
            return Violation(
                "logit_bias",
                f"Invalid value in 'logit_bias' for token {tid}: {val} (must be between -100 and 100).",
            )
    return None


def check_token_ids(
    ids: Iterable[int], vocab_size: int, *, param: str = "stop_token_ids"
) -> Violation | None:
    for t in ids:
        if not 0 <= t < vocab_size:
            return Violation(param, f"Invalid token id in '{param}': {t}.")
    return None


def check_sampling(p: SamplingParams, vocab_size: int) -> Violation | None:
    """Every rule over a whole ``SamplingParams`` (the first violation, in the order of the table above)."""
    for v in (
        check_n(p.n),
        check_max_tokens(p.max_tokens),
        check_min_tokens(p.min_tokens, p.max_tokens),
        *(check_float(name, getattr(p, name)) for name in FLOAT_RANGES),
        check_top_k(p.top_k),
        check_logit_bias(p.logit_bias, vocab_size),
        check_token_ids(p.stop_token_ids, vocab_size),
        check_top_logprobs(p.top_logprobs),
    ):
        if v is not None:
            return v
    return None
