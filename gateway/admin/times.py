"""Time values of the admin API: UNIX seconds or ISO-8601 (RFC 3339) dates and times, UTC when no offset is
given; as UNIX seconds (float) in ``[0, 253402300800)`` (before the year 10000).

Raises :class:`~gateway.errors.InvalidRequest` (400 naming the parameter) for anything else.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime

from gateway.errors import InvalidRequest

YEAR_10000 = 253402300800  # UNIX seconds of 10000-01-01T00:00:00Z


def parse_time(v: str | None, name: str) -> float | None:
    """A query value (``since``, ``until``): None or ``""`` is None; UNIX seconds; an ISO-8601 date/time."""
    if v is None or v == "":
        return None
    try:
        t = float(v)
    except ValueError:
        pass
    else:
        if not math.isfinite(t) or not 0 <= t < YEAR_10000:
            raise InvalidRequest(f"{name} must be finite UNIX seconds in [0, {YEAR_10000})", param=name)
        return t
    try:
        dt = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"{name} must be UNIX seconds or an ISO-8601 date/time", param=name) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    if dt.timestamp() < 0:
        raise InvalidRequest(f"{name} must not be before 1970-01-01 (UNIX time 0)", param=name)
    return dt.timestamp()


def expiry(v: float | str | None) -> float | None:
    """A key's ``expires_at`` (UNIX seconds or an ISO-8601 time; null or ``""``: never) as UNIX seconds.

    Raises:
        InvalidRequest: not finite, past the year 9999, or not in the future (param ``expires_at``; a key
            born expired is a mistake: revoke a key with ``DELETE /keys/{key_id}``).
    """
    t = parse_time(v, "expires_at") if isinstance(v, str) else v
    if t is None:
        return None
    if not math.isfinite(t) or t >= YEAR_10000:
        raise InvalidRequest(
            "expires_at must be finite UNIX seconds before the year 10000",
            param="expires_at",
            code="invalid_value",
        )
    if t <= time.time():
        raise InvalidRequest(
            "expires_at must be in the future (UNIX seconds or an ISO-8601 time); to disable a key, revoke it",
            param="expires_at",
            code="invalid_value",
        )
    return t
