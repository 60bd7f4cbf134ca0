"""Rate-limit model shared by the in-process and the Redis limiter.

Algorithm (see docs/tenancy.md): every limited *dimension* of a scope (a tenant, optionally a key) is one of

* ``bucket`` -- a token bucket with continuous refill, stored as GCRA-style *debt*: ``debt`` units
  were taken and not yet refilled; the debt drains at ``rate = limit / window_s`` units per second, so
  ``available = limit - max(0, debt - elapsed * rate)``. A request costing ``cost`` units is admitted iff
  ``cost <= available``; then ``debt += cost``. Storing debt (not the level) makes a limit change apply at
  once: raising the limit raises ``available`` by the same amount immediately. Used for requests per
  minute (cost 1) and tokens per minute (cost ``prompt_tokens + max_tokens``, OpenAI's way of counting TPM).
  Equivalent to GCRA (Generic Cell Rate Algorithm, ITU-T I.371; https://brandur.org/rate-limiting) with
  burst = limit: the theoretical arrival time is ``now + debt / rate``.
* ``conc`` -- concurrent requests in flight: the set of the admitted requests' members (with Redis a sorted
  set of leases, member -> expiry, renewed by the process holding them, so that a crashed process's slots
  lapse within seconds; see :mod:`ratelimit.redis_limiter`).
* ``daily`` -- tokens per UTC day (a counter per day key; exhausting it yields ``insufficient_quota``).

Admission checks *all* dimensions and reserves them all together or none (all-or-nothing). The in-process
limiter does it with no ``await`` inside (Trio runs one task at a time, so that is atomic); the Redis limiter
does it in one Lua script (atomic on the server). Units: tokens, requests, seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

DEFAULT_WINDOW_S = 60.0
# seconds a concurrency 429 tells the client to wait (``retry-after``): a slot frees when a request in flight
# ends, which no limiter can predict, so this is a short poll hint; with Redis it is shortened to the moment the
# earliest lease lapses if that comes sooner (a slot held by a process that stopped frees then)
CONC_RETRY_S = 1.0

LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent", "daily_tokens")
# the response headers of :func:`headers_for` (OpenAI's names), limit before remaining before reset
RATE_LIMIT_HEADERS = tuple(
    f"x-ratelimit-{what}-{dim}" for what in ("limit", "remaining", "reset") for dim in ("requests", "tokens")
)


@dataclass(frozen=True)
class Limits:
    """Limits of one scope. ``None`` = unlimited.

    Attributes:
        rpm: requests per window (default window 60 s: requests per minute).
        tpm: tokens per window (prompt + max_tokens reserved at admission, trued up to used at the end).
        max_concurrent: requests in flight at once.
        daily_tokens: tokens (prompt + completion) per UTC day.
        window_s: the refill window of rpm/tpm in seconds (60 = "per minute"); tests and special tenants
            may shorten it, e.g. ``rpm=10, window_s=2`` refills 5 requests per second.
    """

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    daily_tokens: int | None = None
    window_s: float = DEFAULT_WINDOW_S

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Limits:
        """Validate and build; raises ValueError naming the bad field."""
        d = dict(d or {})
        kw: dict[str, Any] = {}
        for k in LIMIT_FIELDS:
            v = d.pop(k, None)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"{k} must be a non-negative integer or null")
            kw[k] = v
        w = d.pop("window_s", None)
        if w is not None:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not (0.01 <= float(w) <= 86400):
                raise ValueError("window_s must be a number of seconds in [0.01, 86400]")
            kw["window_s"] = float(w)
        if d:
            raise ValueError(f"unknown limit field(s): {', '.join(sorted(d))}")
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rpm": self.rpm,
            "tpm": self.tpm,
            "max_concurrent": self.max_concurrent,
            "daily_tokens": self.daily_tokens,
            "window_s": self.window_s,
        }

    @property
    def unlimited(self) -> bool:
        return all(getattr(self, k) is None for k in LIMIT_FIELDS)


@dataclass
class Dim:
    """One dimension to check+reserve. ``key`` is the state key (e.g. ``t:<tenant>:tpm``)."""

    key: str
    kind: str  # "bucket" | "conc" | "daily"
    name: str  # "requests" | "tokens" | "concurrent" | "daily_tokens"
    limit: int
    cost: int
    window_s: float = DEFAULT_WINDOW_S
    scope: str = ""  # human label: "tenant acme" / "key sk-gw-AbCd..." / "model m of tenant acme"
    seed: int = 0  # daily: initial value if the counter does not exist yet (from the usage ledger)
    ttl_s: float = 0.0  # daily: seconds until the day key may expire
    # daily: the usage-ledger rows whose tokens of the day are the seed (``tenant_id`` or ``key_id``, and
    # ``model`` for a model's own limits), as keyword arguments of ``tokens_on_day``
    ledger: dict[str, str] = field(default_factory=dict)


@dataclass
class DimResult:
    """Outcome of one dimension. ``remaining`` after the reservation (or now, for a peek / failure);
    ``reset_s`` = seconds until the dimension is back to its full limit; ``retry_s`` = seconds until the
    failing request could pass (``math.inf`` if never, e.g. cost > limit)."""

    dim: Dim
    ok: bool
    remaining: float
    reset_s: float
    retry_s: float = 0.0


@dataclass
class Outcome:
    ok: bool
    results: list[DimResult] = field(default_factory=list)

    def failed(self) -> list[DimResult]:
        return [r for r in self.results if not r.ok]


def build_dims(
    limits: Limits,
    scope_key: str,
    scope_label: str,
    *,
    tokens: int,
    day: str,
    day_ttl_s: float,
    daily_seed: int = 0,
    concurrent: bool = True,
    ledger: dict[str, str] | None = None,
) -> list[Dim]:
    """The dimensions of ``limits`` for a request of ``tokens`` reserved tokens; ``ledger`` names the usage
    rows that seed the daily dimension (see :class:`Dim`)."""
    dims: list[Dim] = []
    if limits.rpm is not None:
        dims.append(
            Dim(f"{scope_key}:rpm", "bucket", "requests", limits.rpm, 1, limits.window_s, scope_label)
        )
    if limits.tpm is not None:
        dims.append(
            Dim(f"{scope_key}:tpm", "bucket", "tokens", limits.tpm, tokens, limits.window_s, scope_label)
        )
    if limits.max_concurrent is not None and concurrent:
        dims.append(
            Dim(f"{scope_key}:conc", "conc", "concurrent", limits.max_concurrent, 1, 0.0, scope_label)
        )
    if limits.daily_tokens is not None:
        dims.append(
            Dim(
                f"{scope_key}:day:{day}",
                "daily",
                "daily_tokens",
                limits.daily_tokens,
                tokens,
                0.0,
                scope_label,
                seed=daily_seed,
                ttl_s=day_ttl_s,
                ledger=dict(ledger or {}),
            )
        )
    return dims


def format_duration(seconds: float) -> str:
    """OpenAI's ``x-ratelimit-reset-*`` format (Go ``time.Duration`` style): ``0s``, ``12ms``, ``1.5s``,
    ``6m0s``, ``1h2m3s``. Rounded up to the millisecond. Source: platform.openai.com/docs/guides/rate-limits
    ("Rate limits in headers")."""
    if not math.isfinite(seconds):
        return "24h0m0s"
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    h, rem = divmod(ms, 3_600_000)
    m, rem = divmod(rem, 60_000)
    s = rem / 1000
    s_txt = (f"{s:.3f}".rstrip("0").rstrip(".")) if rem % 1000 else str(rem // 1000)
    if h:
        return f"{h}h{m}m{s_txt}s"
    if m:
        return f"{m}m{s_txt}s"
    return f"{s_txt}s"


def headers_for(results: list[DimResult]) -> dict[str, str]:
    """``x-ratelimit-*`` headers from dimension results: for ``requests`` and ``tokens`` the tightest
    bucket (lowest remaining) among the scopes. Dimensions that are unlimited produce no header."""
    out: dict[str, str] = {}
    for name, kind in (("requests", "bucket"), ("tokens", "bucket")):
        best: DimResult | None = None
        for r in results:
            if r.dim.kind == kind and r.dim.name == name and (best is None or r.remaining < best.remaining):
                best = r
        if best is not None:
            out[f"x-ratelimit-limit-{name}"] = str(best.dim.limit)
            out[f"x-ratelimit-remaining-{name}"] = str(max(0, int(math.floor(best.remaining + 1e-9))))
            out[f"x-ratelimit-reset-{name}"] = format_duration(best.reset_s)
    return out
