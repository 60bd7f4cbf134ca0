"""Admission (in-process limiter): exact limits under concurrency, refill, true-up, quotas, headers, billing."""

from __future__ import annotations

import math

import pytest
import trio
from plugins.admission_burst import burst

from auth.ledger import UsageLedger
from auth.principal import Principal
from auth.store import open_store
from ratelimit.admission import Admission
from ratelimit.core import Dim, Limits, format_duration, headers_for
from ratelimit.errors import RateLimitExceeded
from ratelimit.local import LocalLimiter


@pytest.fixture
async def books(tmp_path):
    """A real SQLite store with its usage ledger running."""
    store = open_store(str(tmp_path / "g.db"))
    await store.open()
    ledger = UsageLedger(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        yield store, ledger
        await ledger.aclose()
    await store.aclose()


@pytest.fixture
def admission(books):
    return Admission(LocalLimiter(), books[1])


_n = 0


def principal(key_limits: Limits | None = None, **limits) -> Principal:
    global _n
    _n += 1
    return Principal(f"tn_{_n}", f"t{_n}", f"key_{_n}", "sk-gw-AbCd", Limits(**limits), key_limits)


def test_format_duration():
    assert format_duration(0) == "0s"
    assert format_duration(0.012) == "12ms"
    assert format_duration(1) == "1s"
    assert format_duration(2.4745) == "2.475s"
    assert format_duration(360) == "6m0s"
    assert format_duration(3723.5) == "1h2m3.5s"
    assert format_duration(math.inf) == "24h0m0s"


def test_limits_validation():
    assert Limits.from_dict({"rpm": 5}).rpm == 5
    for bad in ({"rpm": -1}, {"tpm": 1.5}, {"rpm": True}, {"nope": 1}, {"window_s": 0}):
        with pytest.raises(ValueError):
            Limits.from_dict(bad)


def test_local_bucket_refill_is_continuous():
    now = [0.0]
    lim = LocalLimiter(clock=lambda: now[0])

    def d():
        return [Dim("k:rpm", "bucket", "requests", 10, 1, 60.0)]

    assert sum(lim.acquire_now(d(), "m").ok for _ in range(15)) == 10
    now[0] = 5.9  # 10/60 per second: 0.98 of a request refilled
    assert not lim.acquire_now(d(), "m").ok
    now[0] = 6.0
    assert lim.acquire_now(d(), "m").ok
    assert not lim.acquire_now(d(), "m").ok
    now[0] = 66.0
    r = lim.acquire_now(d(), "m")
    assert r.ok and headers_for(r.results)["x-ratelimit-remaining-requests"] == "9"


def test_all_or_nothing():
    lim = LocalLimiter(clock=lambda: 0.0)

    def dims(tok):
        return [Dim("r", "bucket", "requests", 10, 1, 60.0), Dim("t", "bucket", "tokens", 100, tok, 60.0)]

    assert lim.acquire_now(dims(90), "a").ok
    assert not lim.acquire_now(dims(20), "b").ok  # tokens fail -> the request must not be charged
    assert lim.peek_now(dims(0))[0].remaining == 9


async def test_rpm_exact_under_concurrency(admission):
    p = principal(rpm=10)  # 60 s window: 1 request refills every 6 s
    ok, errs = await burst(admission, p, 50)
    assert len(ok) == 10 and len(errs) == 40
    for e in errs:
        assert e.status == 429 and e.code == "rate_limit_exceeded" and e.type == "requests"
        h = e.headers
        assert h["x-ratelimit-limit-requests"] == "10" and h["x-ratelimit-remaining-requests"] == "0"
        assert int(h["retry-after"]) >= 1 and 3000 <= int(h["retry-after-ms"]) <= 6000
        assert h["x-ratelimit-reset-requests"]


async def test_rpm_refills_after_window(admission):
    p = principal(rpm=10, window_s=1.0)  # 10 per second
    t0 = trio.current_time()
    ok, errs = await burst(admission, p, 50)
    elapsed = trio.current_time() - t0
    assert 10 <= len(ok) <= 10 + int(elapsed * 10)  # exactly 10 unless the burst took >= 0.1 s (a refill)
    await trio.sleep(1.05)
    ok, errs = await burst(admission, p, 10)
    assert len(ok) == 10


async def test_tpm_exact_with_max_tokens_reservations(admission):
    p = principal(tpm=1000, window_s=3600)
    # each request reserves 20 prompt + 80 max_tokens = 100 tokens; held so nothing is given back meanwhile
    ok, errs = await burst(admission, p, 50, prompt_tokens=20, max_tokens=80, hold=0.05)
    assert len(ok) == 10 and len(errs) == 40
    assert all(e.type == "tokens" and e.headers["x-ratelimit-limit-tokens"] == "1000" for e in errs)


async def test_concurrency_exact(admission):
    p = principal(max_concurrent=3)
    ok, errs = await burst(admission, p, 50, hold=0.2)
    assert len(ok) == 3 and len(errs) == 47
    assert all("concurrent" in e.message and e.headers["retry-after"] for e in errs)
    ok, errs = await burst(admission, p, 3)  # slots were released
    assert len(ok) == 3


async def test_request_larger_than_tpm_is_rejected_at_once(admission):
    p = principal(tpm=100)
    with pytest.raises(RateLimitExceeded) as ei:
        async with admission.admit(p, prompt_tokens=50, max_tokens=51):
            pass
    e = ei.value
    assert "Request too large" in e.message and "Limit 100" in e.message and "Requested 101" in e.message
    assert e.headers["x-should-retry"] == "false" and e.param == "max_tokens"


async def test_true_up_returns_unused_tokens(admission):
    p = principal(tpm=1000, window_s=3600)
    async with admission.admit(p, prompt_tokens=100, max_tokens=400) as r:
        assert int(r.headers["x-ratelimit-remaining-tokens"]) == 500
        r.finish(completion_tokens=10)
    # 110 used: about 890 left (plus a little refill)
    assert 889 <= int(r.final_headers["x-ratelimit-remaining-tokens"]) <= 900


async def test_cancellation_gives_back_and_bills_generated_tokens(admission, books):
    store, ledger = books
    p = principal(tpm=1000, max_concurrent=1, window_s=3600)
    res = []
    with trio.move_on_after(0.05):
        async with admission.admit(p, prompt_tokens=100, max_tokens=800, request_id="req-c") as r:
            res.append(r)
            r.update(completion_tokens=7)
            await trio.sleep(10)
    r = res[0]
    assert r.status == 499 and r.finish_reason == "abort"
    h = await admission.peek_headers(p)
    assert 893 <= int(h["x-ratelimit-remaining-tokens"]) <= 900
    async with admission.admit(p, prompt_tokens=1, max_tokens=1):  # concurrency slot was freed
        pass
    await ledger.flush()
    rows = await store.usage_rows(p.tenant_id)
    row = [x for x in rows if x["request_id"] == "req-c"][0]
    assert row["prompt_tokens"] == 100 and row["completion_tokens"] == 7 and row["status"] == 499


async def test_error_inside_admission_releases_and_bills(books):
    store, ledger = books

    class Teapot(Exception):
        status = 418

    adm = Admission(LocalLimiter(), ledger, error_status=lambda e: getattr(e, "status", 500))
    p = principal(max_concurrent=1)
    for exc, rid in ((ZeroDivisionError("inside admission"), "req-e"), (Teapot(), "req-t")):
        with pytest.raises(type(exc)):
            async with adm.admit(p, prompt_tokens=5, max_tokens=5, request_id=rid):
                raise exc
    async with adm.admit(p, prompt_tokens=1, max_tokens=1):
        pass
    await ledger.flush()
    rows = {x["request_id"]: x for x in await store.usage_rows(p.tenant_id)}
    assert (rows["req-e"]["status"], rows["req-e"]["finish_reason"]) == (500, "error")
    assert rows["req-t"]["status"] == 418


async def test_daily_quota_insufficient_quota(admission):
    p = principal(daily_tokens=100)
    async with admission.admit(p, prompt_tokens=30, max_tokens=30) as r:
        r.finish(completion_tokens=30)
    with pytest.raises(RateLimitExceeded) as ei:
        async with admission.admit(p, prompt_tokens=30, max_tokens=30):
            pass
    e = ei.value
    assert e.code == "insufficient_quota" and e.type == "insufficient_quota"
    assert e.headers["x-should-retry"] == "false" and int(e.headers["retry-after"]) >= 1


async def test_daily_quota_is_seeded_from_ledger_after_restart(books):
    """A new Admission (a restarted process) reads the day's billed tokens from the ledger."""
    _, ledger = books
    p = principal(daily_tokens=100)
    async with Admission(LocalLimiter(), ledger).admit(p, prompt_tokens=40, max_tokens=40) as r:
        r.finish(completion_tokens=40)
    await ledger.flush()
    with pytest.raises(RateLimitExceeded) as ei:
        async with Admission(LocalLimiter(), ledger).admit(
            p, prompt_tokens=10, max_tokens=20
        ):  # 80 + 30 > 100
            pass
    assert ei.value.code == "insufficient_quota"


async def test_per_key_limits(admission):
    p = principal(Limits(rpm=3), rpm=100)
    ok, errs = await burst(admission, p, 10)
    assert len(ok) == 3 and "key" in errs[0].message
    assert errs[0].headers["x-ratelimit-limit-requests"] == "3"  # the tightest scope is reported


async def test_unlimited_tenant_has_no_headers_but_is_billed(admission, books):
    store, ledger = books
    p = principal()
    async with admission.admit(p, prompt_tokens=3, max_tokens=4, model="m") as r:
        assert r.headers == {}
        r.finish(completion_tokens=2, finish_reason="stop", timings={"ttft_s": 0.01})
    await ledger.flush()
    [row] = await store.usage_rows(p.tenant_id)
    assert (row["model"], row["total_tokens"], row["finish_reason"], row["status"]) == ("m", 5, "stop", 200)
    assert row["timings"]["ttft_s"] == 0.01


async def test_close_is_idempotent(admission):
    p = principal(tpm=100, window_s=3600)
    res = await admission.reserve(p, prompt_tokens=10, max_tokens=10)
    res.finish(completion_tokens=0)
    first = await admission.close(res)
    assert await admission.close(res) == first  # the second close gives back nothing more
    assert (
        first["x-ratelimit-remaining-tokens"]
        == (await admission.peek_headers(p))["x-ratelimit-remaining-tokens"]
    )


def model_principal(model_limits: dict[str, Limits], **limits) -> Principal:
    p = principal(**limits)
    return Principal(p.tenant_id, p.tenant_name, p.key_id, p.key_prefix, p.limits, model_limits=model_limits)


async def requests_to(adm: Admission, p: Principal, n: int, model: str | None = None):
    """``n`` one-token admissions to ``model``, one after the other: (how many passed, the refusals)."""
    passed, refused = 0, []
    for _ in range(n):
        try:
            async with adm.admit(p, prompt_tokens=1, max_tokens=0, model=model):
                passed += 1
        except RateLimitExceeded as e:
            refused.append(e)
    return passed, refused


async def test_model_limits_are_dimensions_of_their_own(admission):
    """A tenant's limits for one model apply to requests to that model, besides the tenant-wide ones; the other
    models (and requests naming none) are not affected by them."""
    p = model_principal({"m1": Limits(rpm=2, window_s=3600)}, rpm=20, window_s=3600)
    ok, errs = await requests_to(admission, p, 5, "m1")
    assert ok == 2 and len(errs) == 3
    e = errs[0]
    assert e.code == "rate_limit_exceeded" and e.type == "requests"
    assert f"model m1 of tenant {p.tenant_name}" in e.message and "Limit 2" in e.message
    assert (
        e.headers["x-ratelimit-limit-requests"] == "2" and e.headers["x-ratelimit-remaining-requests"] == "0"
    )
    assert await requests_to(admission, p, 6, "m2") == (6, [])
    assert await requests_to(admission, p, 2) == (2, [])
    # every admitted request was charged to the tenant too: 2 + 6 + 2 of 20
    assert (await admission.peek_headers(p))["x-ratelimit-remaining-requests"] == "10"
    assert (await admission.peek_headers(p, "m1"))["x-ratelimit-remaining-requests"] == "0"


async def test_tenant_limits_still_bind_a_model_with_looser_limits(admission):
    p = model_principal({"m1": Limits(rpm=50)}, rpm=3)
    ok, errs = await requests_to(admission, p, 6, "m1")
    assert ok == 3 and f"for tenant {p.tenant_name} on" in errs[0].message


async def test_model_tokens_and_concurrency_are_trued_up(admission):
    p = model_principal({"m1": Limits(tpm=1000, max_concurrent=1, window_s=3600)})
    async with admission.admit(p, prompt_tokens=100, max_tokens=400, model="m1") as r:
        assert r.headers["x-ratelimit-remaining-tokens"] == "500"
        with pytest.raises(RateLimitExceeded) as ei:
            async with admission.admit(p, prompt_tokens=1, max_tokens=1, model="m1"):
                pass
        assert "Too many concurrent requests for model m1" in ei.value.message
        async with admission.admit(p, prompt_tokens=1, max_tokens=1, model="m2"):
            pass
        r.finish(completion_tokens=10)
    assert 889 <= int(r.final_headers["x-ratelimit-remaining-tokens"]) <= 900
    async with admission.admit(p, prompt_tokens=1, max_tokens=1, model="m1"):  # the slot was freed
        assert await admission.clear_leases(p.tenant_id, [p.key_id], ["m1"]) == (0, 0, 1)


async def test_model_daily_quota_is_seeded_from_that_models_rows(books):
    """A restarted process seeds a model's daily quota from that model's ledger rows only."""
    _, ledger = books
    p = model_principal({"m1": Limits(daily_tokens=100)})
    for model, tokens in (("m1", 40), ("m2", 80)):
        async with Admission(LocalLimiter(), ledger).admit(
            p, prompt_tokens=tokens, max_tokens=0, model=model
        ) as r:
            r.finish(completion_tokens=0)
    await ledger.flush()
    restarted = Admission(LocalLimiter(), ledger)
    async with restarted.admit(p, prompt_tokens=50, max_tokens=0, model="m1") as r:  # 40 + 50 <= 100
        r.finish(completion_tokens=0)
    with pytest.raises(RateLimitExceeded) as ei:
        async with restarted.admit(p, prompt_tokens=20, max_tokens=0, model="m1"):  # 90 + 20 > 100
            pass
    assert ei.value.code == "insufficient_quota" and "model m1 of tenant" in ei.value.message


async def test_counted_request_charges_rpm_once_and_keeps_it_when_refused_later(admission):
    """``count_request`` takes the rpm unit before the token counts are known (a prompt refused for its size
    after it still counted, as OpenAI counts unsuccessful requests); ``admit(counted=...)`` then reserves
    tokens and the slot without a second rpm unit, and keeps the rpm headers on the response; a 429 of
    admission itself (tokens, concurrency) gives the unit back."""
    p = principal(rpm=3, tpm=100, max_concurrent=1)
    counted = await admission.count_request(p)
    assert counted.headers["x-ratelimit-remaining-requests"] == "2"
    async with admission.admit(p, prompt_tokens=10, max_tokens=10, counted=counted) as res:
        assert res.headers["x-ratelimit-remaining-requests"] == "2"  # not charged twice
        assert res.headers["x-ratelimit-remaining-tokens"] == "80"
        busy = await admission.count_request(p)  # the slot is taken: admission refuses it, the unit back
        assert busy.headers["x-ratelimit-remaining-requests"] == "1"
        with pytest.raises(RateLimitExceeded) as e:
            async with admission.admit(p, prompt_tokens=1, max_tokens=1, counted=busy):
                pass
        assert "concurrent" in e.value.message
        res.finish(completion_tokens=5)
    assert res.final_headers["x-ratelimit-remaining-requests"] == "2"
    await admission.count_request(p)  # counted, then refused before admission (a prompt too long)
    # 0 left, not refused: the unit of the request refused for concurrency came back
    assert (await admission.count_request(p)).headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(RateLimitExceeded) as e:
        await admission.count_request(p)
    assert e.value.status == 429 and e.value.type == "requests"
    assert (await admission.count_request(principal(tpm=100))).headers == {}  # no rpm: nothing to count
