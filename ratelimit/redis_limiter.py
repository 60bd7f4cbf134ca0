"""Redis limiter: the same model as :mod:`ratelimit.local`, shared by several gateway processes.

Check-and-reserve of all dimensions is ONE Lua script (``EVALSHA``): Redis runs a script atomically, so two
processes can never both pass a check for the last unit (no check-then-increment race), and a request is
reserved in every dimension or in none. The clock is the Redis server's ``TIME`` so all processes agree.
Concurrency slots are leases in a sorted set (score = expiry), so a crashed process frees its slots after
``lease_s`` seconds. Sources: https://redis.io/docs/latest/develop/interact/programmability/eval-intro/ ,
GCRA as in https://brandur.org/rate-limiting and the redis-cell module.
"""

from __future__ import annotations

import hashlib
import math

from .core import Dim, DimResult, Outcome
from .resp import RedisClient, RedisError

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
    elseif kind == 'conc' then retry = 1
    else retry = ttl end
  end
  st[i] = {kind, limit, cost, window, ttl, key, used}
  res[i] = {ok, remaining, reset, retry}
end
if mode == 'acquire' and allok == 1 then
  if marker then redis.call('SET', marker, '1', 'PX', math.ceil(lease * 1000)) end
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

SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()


class RedisLimiter:
    """Limiter whose state lives in Redis (keys prefixed ``prefix``); every call is one script round-trip.

    Errors: :class:`ratelimit.resp.RedisError` when Redis is unreachable (the gateway answers 503/500).
    """

    shared = True

    def __init__(self, url: str, *, prefix: str = "gw:rl:", lease_s: float = 3600.0) -> None:
        self.client = RedisClient(url)
        self.prefix = prefix
        self.lease_s = lease_s

    async def _run(
        self, mode: str, dims: list[Dim], member: str, costs: list[float]
    ) -> tuple[bool, list[DimResult]]:
        keys = [self.prefix + d.key for d in dims]
        argv: list = [mode, member, repr(float(self.lease_s))]
        for d, c in zip(dims, costs):
            argv += [d.kind, d.limit, c, repr(float(d.window_s or 1.0)), d.seed, repr(float(d.ttl_s))]
        if mode != "peek":
            argv.append(self.prefix + "m:" + member)  # the acquire marker (see the script)
        args = (len(keys), *keys, *argv)
        try:
            reply = await self.client.execute("EVALSHA", SHA, *args)
        except RedisError as e:
            if "NOSCRIPT" not in str(e):
                raise
            reply = await self.client.execute("EVAL", SCRIPT, *args)
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
                    math.inf if retry_f < 0 else retry_f,
                )
            )
        return ok, results

    async def acquire(self, dims: list[Dim], member: str) -> Outcome:
        if not dims:
            return Outcome(True, [])
        ok, results = await self._run("acquire", dims, member, [d.cost for d in dims])
        return Outcome(ok, results)

    async def release(self, dims: list[Dim], member: str, refunds: dict[str, int]) -> list[DimResult]:
        if not dims:
            return []
        _, results = await self._run("release", dims, member, [refunds.get(d.key, 0) for d in dims])
        return results

    async def undo(self, dims: list[Dim], member: str) -> bool:
        """Take back ``acquire(dims, member)`` if, and only if, it ran (its marker exists): every dimension
        gets its full cost back and the concurrency slot is freed. For an acquire whose reply was lost
        (timeout, dropped connection): the script may or may not have run. Returns True if it released."""
        if not dims:
            return False
        released, _ = await self._run("undo", dims, member, [d.cost for d in dims])
        return released

    async def peek(self, dims: list[Dim]) -> list[DimResult]:
        if not dims:
            return []
        _, results = await self._run("peek", dims, "", [0 for _ in dims])
        return results

    def has_daily(self, key: str) -> bool:
        return False

    async def ping(self) -> None:
        """Raise ``OSError`` / ``RedisError`` unless the server answers ``PING``."""
        await self.client.execute("PING")

    async def aclose(self) -> None:
        await self.client.aclose()
