"""``burst``: many admissions of one principal at once, for the exact-limit tests of ``ratelimit``."""

from __future__ import annotations

import trio

from ratelimit.admission import Admission
from ratelimit.errors import RateLimitExceeded
from ratelimit.reservation import Reservation, Subject


async def burst(
    adm: Admission, p: Subject, n: int, *, prompt_tokens: int = 1, max_tokens: int = 1, hold: float = 0.0
) -> tuple[list[Reservation], list[RateLimitExceeded]]:
    """``n`` concurrent admissions, each held ``hold`` seconds and finished with ``max_tokens`` completion
    tokens; returns (the reservations admitted, the refusals)."""
    admitted: list[Reservation] = []
    refused: list[RateLimitExceeded] = []

    async def one() -> None:
        try:
            async with adm.admit(p, prompt_tokens=prompt_tokens, max_tokens=max_tokens) as r:
                admitted.append(r)
                await trio.sleep(hold)
                r.finish(completion_tokens=max_tokens)
        except RateLimitExceeded as e:
            refused.append(e)

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    return admitted, refused
