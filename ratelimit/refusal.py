"""The 429 for an admission that failed: message, type, code and headers as OpenAI's API answers them.

Source: https://platform.openai.com/docs/guides/rate-limits ("Rate limits in headers", "Error mitigation"):
``retry-after`` (integer seconds, at least 1) and ``retry-after-ms``, the ``x-ratelimit-*`` headers of the
tightest scope, and ``x-should-retry: false`` where waiting cannot help (the daily quota is spent, or the request
is larger than a whole limit). Messages follow OpenAI's wording ("Rate limit reached for ... on tokens per min
(TPM): Limit 100, Used 100, Requested 1. Please try again in 6s.").
"""

from __future__ import annotations

import math

from .core import Dim, DimResult, headers_for
from .errors import RateLimitExceeded


def window_label(d: Dim) -> str:
    """``requests per min (RPM)`` for a 60 s window, else ``tokens per 2s (TPM)``."""
    unit = "requests" if d.name == "requests" else "tokens"
    abbr = "RPM" if d.name == "requests" else "TPM"
    if abs(d.window_s - 60.0) < 1e-9:
        return f"{unit} per min ({abbr})"
    return f"{unit} per {d.window_s:g}s ({abbr})"


def _retry_headers(retry_s: float, *, min_ms: int) -> dict[str, str]:
    return {
        "retry-after": str(max(1, math.ceil(retry_s))),
        "retry-after-ms": str(max(min_ms, math.ceil(retry_s * 1000))),
    }


def refusal(results: list[DimResult]) -> RateLimitExceeded:
    """The error for an admission whose ``results`` (one per dimension, from the limiter) have a failure:
    ``insufficient_quota`` for the daily quota, "Request too large" when a cost exceeds a whole limit, else
    ``rate_limit_exceeded`` with the retry time of the slowest failing dimension."""
    failed = [r for r in results if not r.ok]
    headers = headers_for([r for r in results if r.dim.kind == "bucket"])
    daily = [r for r in failed if r.dim.kind == "daily"]
    if daily:
        d, remaining = daily[0].dim, daily[0].remaining
        headers.update(_retry_headers(d.ttl_s, min_ms=0))
        headers["x-should-retry"] = "false"
        return RateLimitExceeded(
            f"You exceeded your current quota of {d.limit} tokens per day for {d.scope}: used "
            f"{d.limit - int(remaining)}, requested {d.cost}. The quota resets at 00:00 UTC.",
            type="insufficient_quota",
            code="insufficient_quota",
            headers=headers,
        )
    too_large = [r.dim for r in failed if not math.isfinite(r.retry_s)]
    if too_large:
        d = too_large[0]
        headers["x-should-retry"] = "false"
        what = window_label(d) if d.kind == "bucket" else "concurrent requests"
        return RateLimitExceeded(
            f"Request too large for {d.scope} on {what}: Limit {d.limit}, Requested {d.cost}. The input or "
            f"output tokens must be reduced in order to run successfully.",
            type="tokens" if d.name == "tokens" else "requests",
            param="max_tokens" if d.name == "tokens" else None,
            code="rate_limit_exceeded",
            headers=headers,
        )
    worst = max(failed, key=lambda r: r.retry_s)
    retry, d = worst.retry_s, worst.dim
    headers.update(_retry_headers(retry, min_ms=1))
    if d.kind == "conc":
        message = (
            f"Too many concurrent requests for {d.scope}: Limit {d.limit}. A slot frees when one of them ends; "
            f"please try again in {retry:.3g}s."
        )
        return RateLimitExceeded(message, type="requests", code="rate_limit_exceeded", headers=headers)
    used = d.limit - int(math.floor(worst.remaining + 1e-9))
    message = (
        f"Rate limit reached for {d.scope} on {window_label(d)}: Limit {d.limit}, Used {used}, "
        f"Requested {d.cost}. Please try again in {retry:.3g}s."
    )
    return RateLimitExceeded(message, type=d.name, code="rate_limit_exceeded", headers=headers)
