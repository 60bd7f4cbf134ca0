"""The gateway's tenant services: lifecycle (default tenant, ledger flushed on close), auth and admission
together, and their errors as the gateway's APIError tree with OpenAI's bodies and headers."""

from __future__ import annotations

import pytest
import trio

from auth.errors import Forbidden, Unauthenticated
from gateway.error_map import api_error, error_status
from gateway.errors import (
    APIError,
    AuthenticationError,
    InvalidRequest,
    PermissionDenied,
    RateLimited,
    ServiceUnavailable,
)
from gateway.tenants import Tenants
from ratelimit.core import Limits
from ratelimit.errors import LimiterUnavailable, RateLimitExceeded


def creds(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


@pytest.fixture
async def tenants(tmp_path):
    async with Tenants(
        str(tmp_path / "g.db"), admin_key="admin-secret", announce=lambda s: None
    ).running() as t:
        yield t


async def test_default_tenant_announced_once(tmp_path):
    said: list[str] = []
    path = str(tmp_path / "g.db")
    async with Tenants(path, announce=said.append).running() as t:
        assert t.default_key and len(said) == 1 and t.default_key in said[0]
        p = await t.authenticate(creds(t.default_key))
        assert p.tenant_name == "default"
        key = t.default_key
    async with Tenants(path, announce=said.append).running() as t:
        assert t.default_key is None and len(said) == 1  # not created or printed again
        assert (await t.authenticate(creds(key))).tenant_name == "default"


async def test_gateways_starting_together_on_an_empty_store_create_one_default(pg_database_url, tmp_path):
    """Several gateways opening one empty PostgreSQL database at once: every one starts, exactly one creates
    (and announces) the default tenant; the others see it."""
    said: list[str] = []
    opened: list[Tenants] = []

    async def one(i: int, nursery: trio.Nursery) -> None:
        t = Tenants(pg_database_url, announce=said.append, spool_dir=str(tmp_path / f"spool{i}"))
        await t.start(nursery)
        opened.append(t)

    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as starts:
            for i in range(4):
                starts.start_soon(one, i, nursery)
        assert len(opened) == 4 and len(said) == 1, said
        assert [t.default_key is not None for t in opened].count(True) == 1
        key = next(t.default_key for t in opened if t.default_key)
        for t in opened:
            assert (await t.authenticate(creds(key))).tenant_name == "default"
        for t in opened:
            await t.aclose()
        nursery.cancel_scope.cancel()


async def test_restart_keeps_usage_and_revocations(tmp_path):
    path = str(tmp_path / "g.db")
    async with Tenants(path, announce=lambda s: None).running() as t:
        tn = await t.store.create_tenant("acme")
        k1, r1 = await t.store.create_key(tn.id, name="one")
        p = await t.authenticate(creds(k1))
        for i in range(3):
            async with t.admit(p, prompt_tokens=10, max_tokens=10, model="m", request_id=f"r{i}") as res:
                res.finish(completion_tokens=4, finish_reason="stop")
        await t.store.revoke_key(r1.id)
        t.invalidate()
        with pytest.raises(AuthenticationError):
            await t.authenticate(creds(k1))
        # no explicit flush: closing must write the queued ledger rows
    async with Tenants(path, announce=lambda s: None).running() as t:
        with pytest.raises(AuthenticationError) as ei:
            await t.authenticate(creds(k1))
        assert ei.value.status == 401 and "revoked" in ei.value.message
        u = await t.store.usage_summary(tn.id, None, None)
        assert u["totals"]["requests"] == 3 and u["totals"]["total_tokens"] == 42
        assert len(u["days"]) == 1


async def test_limit_change_applies_at_once(tenants):
    tn = await tenants.store.create_tenant("lim", Limits(rpm=2))
    key, _ = await tenants.store.create_key(tn.id)
    p = await tenants.authenticate(creds(key))
    for _ in range(2):
        async with tenants.admit(p, prompt_tokens=1, max_tokens=1):
            pass
    with pytest.raises(RateLimited):
        async with tenants.admit(p, prompt_tokens=1, max_tokens=1):
            pass
    await tenants.store.update_tenant(tn.id, limits=Limits(rpm=5))
    tenants.invalidate()  # what the admin API does after every change
    p = await tenants.authenticate(creds(key))
    assert p.limits.rpm == 5
    for _ in range(3):  # the raised limit: 3 more at once (debt-based bucket)
        async with tenants.admit(p, prompt_tokens=1, max_tokens=1):
            pass


async def test_admission_errors_are_api_errors_and_statuses_are_billed(tenants):
    tn = await tenants.store.create_tenant("x", Limits(rpm=1, window_s=3600))
    key, _ = await tenants.store.create_key(tn.id)
    p = await tenants.authenticate(creds(key))
    with pytest.raises(InvalidRequest):
        async with tenants.admit(p, prompt_tokens=1, max_tokens=1, request_id="bad"):
            raise InvalidRequest("nope")
    with pytest.raises(RateLimited) as ei:
        async with tenants.admit(p, prompt_tokens=1, max_tokens=1):
            pass
    assert ei.value.body()["error"]["code"] == "rate_limit_exceeded"
    assert ei.value.headers["x-ratelimit-remaining-requests"] == "0"
    await tenants.ledger.flush()
    [row] = await tenants.store.usage_rows(tn.id)
    assert (row["request_id"], row["status"], row["finish_reason"]) == ("bad", 400, "error")


async def test_admin_check_through_the_scope(tenants):
    await tenants.require_admin({"headers": creds("admin-secret")})
    await tenants.require_admin({"headers": [], "state": {"admin": True}})  # the middleware's verdict
    with pytest.raises(AuthenticationError):
        await tenants.require_admin({"headers": [], "state": {}})
    with pytest.raises(PermissionDenied):
        await tenants.require_admin({"headers": creds(tenants.default_key or ""), "query_string": b""})


def test_errors_map_to_the_same_openai_bodies():
    """The bodies, statuses and headers the gateway answered before auth and ratelimit had errors of their own."""
    cases: list[tuple[Exception, type[APIError], int, dict]] = [
        (
            Unauthenticated("Incorrect API key provided.", headers={"www-authenticate": "Bearer"}),
            AuthenticationError,
            401,
            {
                "message": "Incorrect API key provided.",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            },
        ),
        (
            Unauthenticated("no key", code=None),
            AuthenticationError,
            401,
            {"message": "no key", "type": "invalid_request_error", "param": None, "code": "invalid_api_key"},
        ),
        (
            Forbidden("not admin", code="admin_required"),
            PermissionDenied,
            403,
            {
                "message": "not admin",
                "type": "invalid_request_error",
                "param": None,
                "code": "admin_required",
            },
        ),
        (
            RateLimitExceeded(
                "too big",
                type="tokens",
                code="rate_limit_exceeded",
                param="max_tokens",
                headers={"x-should-retry": "false"},
            ),
            RateLimited,
            429,
            {"message": "too big", "type": "tokens", "param": "max_tokens", "code": "rate_limit_exceeded"},
        ),
        (
            LimiterUnavailable(
                "down", type="server_error", code="rate_limiter_unavailable", headers={"retry-after": "1"}
            ),
            ServiceUnavailable,
            503,
            {"message": "down", "type": "server_error", "param": None, "code": "rate_limiter_unavailable"},
        ),
    ]
    for exc, cls, status, body in cases:
        e = api_error(exc)
        assert type(e) is cls and e.status == status and e.body() == {"error": body}
        assert e.headers == exc.headers
    assert error_status(RateLimited("x")) == 429 and error_status(KeyError()) == 500
