"""The failure policy of shared limits, with a real redis-server that is stopped and started again: by default
(fail closed) every admission while Redis is down is a 503 with retry-after, and nothing is admitted; with
``fail_open`` the requests are admitted without limits (billed as usual), one warning per outage, counted, and
the limits apply again as soon as Redis answers, without a restart."""

from __future__ import annotations

import logging
import os
import time

import pytest
import trio
from plugins.redis_server import redis_port, require_redis, running, start_redis, stop_redis

from auth.principal import Principal
from ratelimit.admission import Admission
from ratelimit.core import Limits
from ratelimit.errors import LimiterUnavailable, RateLimitExceeded
from ratelimit.redis_limiter import RedisLimiter


class ListBook:
    """A usage book that keeps the rows it is given."""

    def __init__(self) -> None:
        self.rows: list[dict[str, object]] = []

    def record(self, row: dict[str, object]) -> None:
        self.rows.append(row)

    async def tokens_on_day(
        self, *, tenant_id: str | None = None, key_id: str | None = None, day: str
    ) -> int:
        return 0


def fresh(**limits) -> Principal:
    tag = f"f{os.getpid()}-{time.time_ns()}"
    return Principal(f"tn_{tag}", tag, f"key_{tag}", "sk-gw-AbCd", Limits(**limits))


LIMITS = dict(rpm=2, max_concurrent=1, window_s=3600)


@pytest.fixture
def redis_proc(tmp_path):
    require_redis()
    procs = [start_redis(tmp_path)]
    yield procs  # [(process, url)]; a test may stop it and start another on its port
    for proc, _ in procs:
        stop_redis(proc)


async def admit_while_down(
    adm: Admission, p: Principal, n: int
) -> tuple[list[dict[str, str]], list[Exception]]:
    """``n`` admissions at once, each held 0.1 s: (the headers of the admitted ones, the errors)."""
    admitted: list[dict[str, str]] = []
    errors: list[Exception] = []

    async def one() -> None:
        try:
            async with adm.admit(p, prompt_tokens=3, max_tokens=4) as r:
                admitted.append(r.headers)
                await trio.sleep(0.1)
                r.finish(completion_tokens=4)
        except (LimiterUnavailable, RateLimitExceeded) as e:
            errors.append(e)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)
    return admitted, errors


async def test_fail_closed_is_the_default(redis_proc):
    proc, url = redis_proc[0]
    book = ListBook()
    adm = Admission(RedisLimiter(url), book)
    await adm.start()
    async with running(adm):
        p = fresh(**LIMITS)
        async with adm.admit(p, prompt_tokens=1, max_tokens=1):
            pass
        stop_redis(proc)
        admitted, errors = await admit_while_down(adm, p, 4)
        assert admitted == [] and len(errors) == 4
        assert all(isinstance(e, LimiterUnavailable) for e in errors)
        assert {(e.status, e.code, e.headers["retry-after"]) for e in errors} == {
            (503, "rate_limiter_unavailable", "1")
        }
        assert adm.fail_open_admitted == 0 and len(book.rows) == 1


async def test_fail_open_admits_without_limits_and_says_so_once_per_outage(redis_proc, tmp_path, caplog):
    proc, url = redis_proc[0]
    book = ListBook()
    adm = Admission(RedisLimiter(url), book, fail_open=True)
    await adm.start()
    p = fresh(**LIMITS)
    caplog.set_level(logging.WARNING, logger="ratelimit.admission")
    async with running(adm):
        async with adm.admit(p, prompt_tokens=1, max_tokens=1) as r:
            assert r.headers["x-ratelimit-remaining-requests"] == "1"

        stop_redis(proc)
        admitted, errors = await admit_while_down(adm, p, 5)  # over rpm 2 and 1 at a time: all let in
        assert errors == [] and admitted == [{}] * 5  # no x-ratelimit-* headers: no limit was checked
        assert (adm.fail_open_admitted, adm.fail_open_outages) == (5, 1)
        assert len(book.rows) == 6 and all(row["completion_tokens"] == 4 for row in book.rows[1:])
        opened = [m for m in caplog.messages if "WITHOUT limits" in m]
        assert len(opened) == 1 and "ConnectionError" in opened[0]
        assert not [m for m in caplog.messages if "limits apply" in m]

        # Redis back (its state lost: no persistence): the limits apply again at once, no restart
        redis_proc[0] = start_redis(tmp_path, port=redis_port(url))
        admitted, errors = await admit_while_down(adm, p, 3)  # rpm 2 in a fresh window, 1 at a time
        assert len(admitted) == 1 and len(errors) == 2
        assert all(isinstance(e, RateLimitExceeded) for e in errors)
        assert len([m for m in caplog.messages if "limits apply" in m]) == 1
        assert adm.fail_open_admitted == 5

        # a second outage is a second warning
        stop_redis(redis_proc[0][0])
        admitted, errors = await admit_while_down(adm, p, 2)
        assert len(admitted) == 2 and errors == []
        assert (adm.fail_open_admitted, adm.fail_open_outages) == (7, 2)
        assert len([m for m in caplog.messages if "WITHOUT limits" in m]) == 2


async def test_fail_open_does_not_skip_a_refusal(redis_proc):
    """Fail-open is for a store that does not answer, not for a limit it enforces: with Redis up a tenant
    over its limit is refused as usual."""
    _, url = redis_proc[0]
    adm = Admission(RedisLimiter(url), ListBook(), fail_open=True)
    async with running(adm):
        p = fresh(**LIMITS)
        admitted, errors = await admit_while_down(adm, p, 4)
        assert len(admitted) == 1 and len(errors) == 3 and adm.fail_open_admitted == 0
