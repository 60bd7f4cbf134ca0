"""Redis limiter: the same model as :mod:`ratelimit.local`, shared by several gateway processes.

Check-and-reserve of all dimensions is ONE Lua script (``EVALSHA``): Redis runs a script atomically, so two
processes can never both pass a check for the last unit (no check-then-increment race), and a request is
reserved in every dimension or in none. The clock is the Redis server's ``TIME`` so all processes agree. The
connection is coredis' (:mod:`ratelimit.redis_client`: URLs, TLS, passwords, timeouts); its pool lives in the
task of :meth:`RedisLimiter.run`.

Concurrency slots are *leases*: a sorted set per scope (``<prefix>t:<tenant>:conc``), member = the request's
unique member, score = the lease's expiry (Redis time, seconds). The acquire script drops the expired members
before it counts, so a slot is counted exactly while its lease lives: never more than ``max_concurrent``
admitted across every process sharing the Redis database. A lease lives ``lease_s`` (:data:`LEASE_TTL_S`,
6 s) and the process holding it renews it: :meth:`RedisLimiter.run` is one task per process that renews all the
leases the process holds every ``lease_s / 4`` (one script call), so a live process's slots stay counted while
a process that dies (kill -9, host lost) frees its slots at most ``lease_s`` after its last renewal. A renewal
also puts back a lease of a running request that lapsed (Redis out of reach or the process stalled for longer
than ``lease_s``) or was lost (Redis restarted without persistence), so the count catches up with what runs
(it may then exceed the limit until enough requests end; no new one is admitted meanwhile). A lease cleared by
:meth:`RedisLimiter.clear` (the admin API) is never put back: the clear leaves a tombstone set
(``<lease set>:cleared``, a day) that the renewal checks, and the holder stops renewing it; its request runs on
uncounted.

Sources: https://redis.io/docs/latest/develop/interact/programmability/eval-intro/ , GCRA as in
https://brandur.org/rate-limiting and the redis-cell module, leases as in
https://redis.io/docs/latest/develop/use/patterns/distributed-locks/ (expiring, renewed by their holder).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from .core import CONC_RETRY_S, Dim, DimResult, Outcome
from .errors import StoreError
from .redis_client import COMMAND_TIMEOUT_S, CONNECT_TIMEOUT_S, redis_connection, store_errors

log = logging.getLogger("ratelimit.redis")

LEASE_TTL_S = 6.0  # seconds a concurrency lease lives unless its holder renews it (every LEASE_TTL_S / 4)

SCRIPT = r"""
local mode = ARGV[1]
local member = ARGV[2]
local lease = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = #KEYS
-- optional marker key (after the dims' arguments): set by a successful acquire, deleted by release; 'undo'
-- releases only if it exists, so taking back an acquire that may or may not have run never over-refunds
local marker = ARGV[3 + n * 6 + 1]
local allok = 1
if mode == 'undo' then  -- the reply's first field says whether it released (1) or found nothing (0)
  if marker and redis.call('EXISTS', marker) == 1 then mode = 'release' else mode = 'noop'; allok = 0 end
end
local st = {}
local res = {}
local function fmt(x) return string.format('%.6f', x) end
for i = 1, n do
  local b = 3 + (i - 1) * 6
  local kind, limit, cost = ARGV[b + 1], tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  local window, seed, ttl = tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6])
  local key = KEYS[i]
  local used, remaining, reset, retry = 0, 0, 0, 0
  if kind == 'bucket' then
    local rate = limit / window
    local v = redis.call('HMGET', key, 'd', 't')
    local debt = tonumber(v[1]) or 0
    local at = tonumber(v[2]) or now
    local el = now - at
    if el < 0 then el = 0 end
    debt = debt - el * rate
    if debt < 0 then debt = 0 end
    used = debt
    if rate > 0 then reset = debt / rate elseif debt > 0 then reset = -1 end
  elseif kind == 'conc' then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now))
    used = redis.call('ZCARD', key)
  else
    local v = redis.call('GET', key)
    if v then used = tonumber(v) else used = seed end
    reset = ttl
  end
  remaining = limit - used
  local ok = 1
  if mode == 'acquire' and cost > remaining then
    ok = 0
    allok = 0
    if cost > limit then retry = -1
    elseif kind == 'bucket' then retry = (cost - remaining) / (limit / window)
    elseif kind == 'conc' then
      -- a slot frees when a request ends (unpredictable: a short hint), at the latest when the earliest
      -- lease lapses if its holder stopped renewing it
      retry = __CONC_RETRY_S__
      local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
      if first[2] and tonumber(first[2]) - now < retry then retry = tonumber(first[2]) - now end
    else retry = ttl end
  end
  st[i] = {kind, limit, cost, window, ttl, key, used}
  res[i] = {ok, remaining, reset, retry}
end
if mode == 'acquire' and allok == 1 then
  -- the marker outlives any undo (an hour); release deletes it
  if marker then redis.call('SET', marker, '1', 'PX', 3600000) end
  for i = 1, n do
    local kind, limit, cost, window, ttl, key, used = unpack(st[i])
    if kind == 'bucket' then
      local debt = used + cost
      local rate = limit / window
      redis.call('HSET', key, 'd', fmt(debt), 't', fmt(now))
      redis.call('PEXPIRE', key, math.ceil((window + 1) * 1000))
      res[i][2] = limit - debt
      if rate > 0 then res[i][3] = debt / rate end
    elseif kind == 'conc' then
      redis.call('ZADD', key, fmt(now + lease), member)
      redis.call('PEXPIRE', key, math.ceil(lease * 1000))
      res[i][2] = res[i][2] - 1
    else
      redis.call('SET', key, tostring(used + cost), 'PX', math.ceil(ttl * 1000) + 3600000)
      res[i][2] = res[i][2] - cost
    end
  end
elseif mode == 'release' then
  if marker then redis.call('DEL', marker) end
  for i = 1, n do
    local kind, limit, refund, window, ttl, key, used = unpack(st[i])
    local rem = 0
    if kind == 'bucket' then
      local debt = used - refund
      if debt < 0 then debt = 0 end
      redis.call('HSET', key, 'd', fmt(debt), 't', fmt(now))
      redis.call('PEXPIRE', key, math.ceil((window + 1) * 1000))
      res[i][2] = limit - debt
      if limit > 0 then res[i][3] = debt / (limit / window) end
    elseif kind == 'conc' then
      redis.call('ZREM', key, member)
      res[i][2] = limit - redis.call('ZCARD', key)
    else
      local v = used - refund
      if v < 0 then v = 0 end
      redis.call('SET', key, tostring(v), 'PX', math.ceil(ttl * 1000) + 3600000)
      res[i][2] = limit - v
    end
  end
end
local out = {allok}
for i = 1, n do
  local r = res[i]
  out[#out + 1] = r[1]
  out[#out + 1] = fmt(r[2])
  out[#out + 1] = fmt(r[3])
  out[#out + 1] = fmt(r[4])
end
return out
"""

SCRIPT = SCRIPT.replace("__CONC_RETRY_S__", repr(float(CONC_RETRY_S)))

# KEYS: per scope its lease set, then its tombstone set (``<lease set>:cleared``); ARGV: ttl_s, then per scope
# the number of members and the members. Every member not in the tombstone set gets expiry now + ttl_s, put back
# if it had lapsed or was lost (Redis restarted without persistence): the slots count what runs. Returns the
# members that were cleared, which the holder stops renewing.
RENEW_SCRIPT = r"""
local ttl = tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local expiry = string.format('%.6f', now + ttl)
local j = 2
local cleared = {}
for i = 1, #KEYS, 2 do
  local key, tomb = KEYS[i], KEYS[i + 1]
  local n = tonumber(ARGV[j])
  j = j + 1
  local kept = 0
  for k = 1, n do
    local m = ARGV[j]
    if redis.call('SISMEMBER', tomb, m) == 1 then
      cleared[#cleared + 1] = m
    else
      redis.call('ZADD', key, expiry, m)
      kept = kept + 1
    end
    j = j + 1
  end
  if kept > 0 then redis.call('PEXPIRE', key, math.ceil(ttl * 1000)) end
end
return cleared
"""

# KEYS: per scope its lease set, then its tombstone set. Moves every member to the tombstone set (kept a day, so
# the holders' renewals never bring them back) and deletes the lease set; returns per scope its live leases.
CLEAR_SCRIPT = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {}
for i = 1, #KEYS, 2 do
  local key, tomb = KEYS[i], KEYS[i + 1]
  local members = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  local live = 0
  for k = 1, #members, 2 do
    redis.call('SADD', tomb, members[k])
    if tonumber(members[k + 1]) > now then live = live + 1 end
  end
  if #members > 0 then redis.call('PEXPIRE', tomb, 86400000) end
  redis.call('DEL', key)
  out[#out + 1] = live
end
return out
"""


class RedisLimiter:
    """Limiter whose state lives in Redis (keys prefixed ``prefix``); every call is one script round-trip.

    The connections live while :meth:`run` runs (it enters the coredis pool, and its nursery owns their
    tasks): start it before the first call, ``await nursery.start(limiter.run)``; :meth:`aclose` ends it.

    Args:
        url: ``redis://``, ``rediss://`` (TLS), ``unix://`` or ``redis+sentinel://`` URL with an optional
            password or ACL user (:mod:`ratelimit.redis_client`).
        prefix: key prefix in Redis.
        lease_s: seconds a concurrency lease lives without renewal (:data:`LEASE_TTL_S`); :meth:`run` renews
            this process's leases every ``lease_s / 4``.
        connect_timeout_s, command_timeout_s: bounds of a new connection and of a reply (seconds).

    Errors: :class:`~ratelimit.errors.StoreError` when Redis is unreachable, slow past the command timeout or
    answers an error, and when :meth:`run` is not running (admission answers 503); ``ValueError`` for a bad
    URL (at construction).
    """

    shared = True

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "gw:rl:",
        lease_s: float = LEASE_TTL_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        command_timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> None:
        if not lease_s > 0:
            raise ValueError("lease_s must be > 0")
        self.connection = redis_connection(
            url, connect_timeout_s=connect_timeout_s, command_timeout_s=command_timeout_s
        )
        self.client = self.connection.client
        self.ping_timeout_s = connect_timeout_s + command_timeout_s
        # EVALSHA, and on NOSCRIPT (a restarted or flushed Redis) SCRIPT LOAD and EVALSHA again
        self._admit_script = self.client.register_script(SCRIPT)
        self._renew_script = self.client.register_script(RENEW_SCRIPT)
        self._clear_script = self.client.register_script(CLEAR_SCRIPT)
        self.prefix = prefix
        self.lease_s = float(lease_s)
        self.renew_every_s = self.lease_s / 4
        self._held: dict[str, set[str]] = {}  # Redis key of a lease set -> the members this process holds
        self._stop: trio.MemorySendChannel[None] | None = None
        self._renew_failing = False
        self._connected = False  # the pool is entered (run's task, or connected())
        self._closed = False

    async def _eval(self, script: Any, keys: list[str], argv: list[object]) -> Any:
        """One script call; every failure is a :class:`StoreError`."""
        if not self._connected:
            raise StoreError(
                "the Redis limiter is closed" if self._closed else "the Redis limiter is not running"
            )
        with store_errors():
            return await script(keys=keys, args=argv)

    async def _run(
        self, mode: str, dims: list[Dim], member: str, costs: list[float]
    ) -> tuple[bool, list[DimResult]]:
        keys = [self.prefix + d.key for d in dims]
        argv: list[object] = [mode, member, repr(self.lease_s)]
        for d, c in zip(dims, costs):
            argv += [d.kind, d.limit, c, repr(float(d.window_s or 1.0)), d.seed, repr(float(d.ttl_s))]
        if mode != "peek":
            argv.append(self.prefix + "m:" + member)  # the acquire marker (see the script)
        reply = await self._eval(self._admit_script, keys, argv)
        ok = bool(int(reply[0]))
        results = []
        for i, d in enumerate(dims):
            rok, rem, reset, retry = reply[1 + 4 * i : 5 + 4 * i]
            retry_f = float(retry)
            reset_f = float(reset)
            results.append(
                DimResult(
                    d,
                    bool(int(rok)),
                    max(0.0, float(rem)),
                    math.inf if reset_f < 0 else reset_f,
                    math.inf if retry_f < 0 else max(0.0, retry_f),
                )
            )
        return ok, results

    def _hold(self, dims: list[Dim], member: str) -> None:
        for d in dims:
            if d.kind == "conc":
                self._held.setdefault(self.prefix + d.key, set()).add(member)

    def _drop(self, dims: list[Dim], member: str) -> None:
        for d in dims:
            if d.kind == "conc":
                key = self.prefix + d.key
                members = self._held.get(key)
                if members is not None:
                    members.discard(member)
                    if not members:
                        del self._held[key]

    @property
    def held(self) -> int:
        """How many leases this process holds (and renews)."""
        return sum(len(m) for m in self._held.values())

    async def acquire(self, dims: list[Dim], member: str) -> Outcome:
        """Check and reserve ``dims`` for ``member`` (unique per request) in one script; a reserved
        concurrency slot is a lease this process then renews until :meth:`release`."""
        if not dims:
            return Outcome(True, [])
        ok, results = await self._run("acquire", dims, member, [d.cost for d in dims])
        if ok:
            self._hold(dims, member)
        return Outcome(ok, results)

    async def release(self, dims: list[Dim], member: str, refunds: dict[str, int]) -> list[DimResult]:
        """Give back ``refunds`` and free the slot. The lease stops being renewed first, so a release that
        fails (Redis unreachable) still frees the slot when the lease lapses."""
        if not dims:
            return []
        self._drop(dims, member)
        _, results = await self._run("release", dims, member, [refunds.get(d.key, 0) for d in dims])
        return results

    async def undo(self, dims: list[Dim], member: str) -> bool:
        """Take back ``acquire(dims, member)`` if, and only if, it ran (its marker exists): every dimension
        gets its full cost back and the concurrency slot is freed. For an acquire whose reply was lost
        (timeout, dropped connection): the script may or may not have run. Returns True if it released."""
        if not dims:
            return False
        self._drop(dims, member)
        released, _ = await self._run("undo", dims, member, [d.cost for d in dims])
        return released

    async def peek(self, dims: list[Dim]) -> list[DimResult]:
        if not dims:
            return []
        _, results = await self._run("peek", dims, "", [0 for _ in dims])
        return results

    async def clear(self, keys: list[str]) -> list[int]:
        """Delete the lease sets of the concurrency dimensions ``keys`` (``t:<tenant>:conc``,
        ``k:<key>:conc``); returns how many live leases each held. Whichever process holds them stops
        counting them at once (its renewals do not bring them back); their requests run on."""
        if not keys:
            return []
        sets = [self.prefix + k for k in keys]
        reply = await self._eval(self._clear_script, [x for k in sets for x in (k, k + ":cleared")], [])
        return [int(n) for n in reply]

    async def renew(self) -> int:
        """Renew every lease this process holds to ``lease_s`` from now (Redis time), in one script call,
        putting back any that lapsed or was lost; a lease cleared by :meth:`clear` is dropped instead.
        Returns how many it renewed. Raises :class:`StoreError`."""
        held = [(key, sorted(members)) for key, members in self._held.items() if members]
        if not held:
            return 0
        argv: list[object] = [repr(self.lease_s)]
        for _, members in held:
            argv += [len(members), *members]
        keys = [x for key, _ in held for x in (key, key + ":cleared")]
        cleared = set(await self._eval(self._renew_script, keys, argv))
        for key, members in held:
            gone = cleared.intersection(members)
            if gone:
                self._held[key] -= gone
                if not self._held[key]:
                    del self._held[key]
        return sum(len(m) for _, m in held) - len(cleared)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The connections and the lease heartbeat: enter the coredis pool (its connections' tasks live in
        this task's scope), then renew this process's leases every ``renew_every_s`` until :meth:`aclose`
        closes its channel (or the task is cancelled); the connections close when it returns. Start it in the
        nursery that owns the limiter: ``await nursery.start(limiter.run)``; calls made before it started, or
        after it ended, raise :class:`StoreError`. Nothing is connected until the first call, so it starts
        while Redis is down. A renewal bounded by ``renew_every_s`` that fails is logged (once per outage) and
        retried at the next tick; the leases lapse if Redis stays out of reach for ``lease_s``."""
        if self._closed:
            task_status.started()
            return
        send, receive = trio.open_memory_channel[None](0)
        self._stop = send
        async with self.connected(), receive:
            task_status.started()
            while True:
                with trio.move_on_after(self.renew_every_s):
                    try:
                        await receive.receive()
                    except trio.EndOfChannel:
                        return
                await self._renew_once()

    @asynccontextmanager
    async def connected(self) -> AsyncIterator[None]:
        """The connections without the heartbeat (:meth:`run` uses it): ``async with limiter.connected():``
        in the task that owns the limiter. The leases this process takes lapse after ``lease_s`` unless
        :meth:`renew` is called (a one-off tool, a test of a holder that stopped renewing)."""
        async with self.connection.open():
            self._connected = not self._closed
            try:
                yield
            finally:
                self._connected = False

    async def _renew_once(self) -> None:
        try:
            with trio.fail_after(self.renew_every_s):
                await self.renew()
        except (StoreError, trio.TooSlowError) as e:
            if self._closed:
                return
            if not self._renew_failing:
                log.warning(
                    "rate limiter: cannot renew %d concurrency lease(s): %s (they lapse after %gs without "
                    "renewal)",
                    self.held,
                    e if isinstance(e, StoreError) else "no reply in time",
                    self.lease_s,
                )
            self._renew_failing = True
            return
        if self._renew_failing:
            log.warning("rate limiter: lease renewals work again")
        self._renew_failing = False

    def has_daily(self, key: str) -> bool:
        return False

    async def ping(self) -> None:
        """Raise :class:`StoreError` unless the server answers ``PING`` within the connect and command
        timeouts (a wrong password, a TLS certificate that does not verify: the message says which). Before
        :meth:`run` has started it opens the pool for this one call (the start-up check)."""
        failed: StoreError | None = None

        async def ping_once() -> None:
            nonlocal failed
            try:
                with store_errors():
                    await self.client.ping()
            except StoreError as e:  # kept out of the pool's task group (it would come out in a group)
                failed = e

        try:
            with trio.fail_after(self.ping_timeout_s):
                if self._connected:
                    await ping_once()
                else:
                    async with self.connection.open():
                        await ping_once()
        except trio.TooSlowError:
            raise StoreError(f"no answer to PING within {self.ping_timeout_s:g}s") from None
        if failed is not None:
            raise failed

    async def aclose(self) -> None:
        """Stop the heartbeat (its channel closes): :meth:`run` returns and closes the connections. Calls made
        after it raise :class:`StoreError`. Idempotent."""
        self._closed = True
        self._connected = False
        if self._stop is not None:
            self._stop.close()
