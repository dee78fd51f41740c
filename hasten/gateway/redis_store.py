"""Redis-backed state shared by gateway instances: rate limits (atomic Lua) and cache entries.

The limit script checks every limit of a request and then takes them all, inside one
``EVALSHA``: Redis runs a script without interleaving other commands, so concurrent
requests from any number of gateway instances see one consistent count. Time comes from
the Redis server (``TIME``), so instances on hosts with skewed clocks still agree.

Key layout for a window limit ``K``: ``K`` is a sorted set member -> admission time (ms),
``K:c`` a hash member -> cost, ``K:s`` the running sum. A concurrency limit ``K`` is a
sorted set member -> lease expiry (ms).
"""

from __future__ import annotations

from typing import Any

from hasten.gateway.ratelimit import LEASE_S, WINDOW_S, Decision, LimitSpec

_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
local lease = tonumber(ARGV[2])
local member = ARGV[3]
for i = 1, #KEYS do
  local key = KEYS[i]
  local kind = ARGV[1 + 3 * i]
  local limit = tonumber(ARGV[2 + 3 * i])
  local cost = tonumber(ARGV[3 + 3 * i])
  if kind == 'c' then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    if redis.call('ZCARD', key) + cost > limit then
      return {i, 1000}
    end
  else
    local cutoff = now - window
    while true do
      local old = redis.call('ZRANGEBYSCORE', key, '-inf', cutoff, 'LIMIT', 0, 500)
      if #old == 0 then break end
      local costs = redis.call('HMGET', key .. ':c', unpack(old))
      local freed = 0
      for j = 1, #old do freed = freed + (tonumber(costs[j]) or 0) end
      redis.call('HDEL', key .. ':c', unpack(old))
      redis.call('ZREM', key, unpack(old))
      redis.call('DECRBY', key .. ':s', freed)
    end
    local used = tonumber(redis.call('GET', key .. ':s') or '0')
    if used + cost > limit then
      if cost > limit then return {i, window} end
      local need = used + cost - limit
      local got = 0
      local entries = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
      for j = 1, #entries, 2 do
        got = got + (tonumber(redis.call('HGET', key .. ':c', entries[j])) or 0)
        if got >= need then
          return {i, math.max(1, tonumber(entries[j + 1]) + window - now)}
        end
      end
      return {i, window}
    end
  end
end
for i = 1, #KEYS do
  local key = KEYS[i]
  local cost = tonumber(ARGV[3 + 3 * i])
  if ARGV[1 + 3 * i] == 'c' then
    redis.call('ZADD', key, now + lease, member)
    redis.call('PEXPIRE', key, lease)
  else
    redis.call('ZADD', key, now, member)
    redis.call('HSET', key .. ':c', member, cost)
    redis.call('INCRBY', key .. ':s', cost)
    redis.call('PEXPIRE', key, window * 2)
    redis.call('PEXPIRE', key .. ':c', window * 2)
    redis.call('PEXPIRE', key .. ':s', window * 2)
  end
end
return {0, 0}
"""

_ADJUST = """
for i = 1, #KEYS do
  local old = redis.call('HGET', KEYS[i] .. ':c', ARGV[1])
  if old then
    redis.call('HSET', KEYS[i] .. ':c', ARGV[1], ARGV[2])
    redis.call('INCRBY', KEYS[i] .. ':s', tonumber(ARGV[2]) - tonumber(old))
  end
end
return 0
"""


def connect(url: str) -> Any:
    """An asyncio Redis client (``pip install redis``); imported only when Redis is configured."""
    try:
        import redis.asyncio as aioredis
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("the 'redis' setting needs the redis package: pip install redis") from exc
    return aioredis.from_url(url, decode_responses=False, health_check_interval=30)


class RedisLimitStore:
    def __init__(self, client: Any) -> None:
        self._r = client
        self._acquire = client.register_script(_ACQUIRE)
        self._adjust = client.register_script(_ADJUST)

    async def acquire(self, specs: list[LimitSpec], member: str) -> Decision:
        if not specs:
            return Decision(True)
        args: list[Any] = [int(WINDOW_S * 1000), int(LEASE_S * 1000), member]
        for s in specs:
            args.extend(("c" if s.kind == "concurrency" else "w", s.limit, s.cost))
        failed, retry_ms = await self._acquire(keys=[s.key for s in specs], args=args)
        if int(failed) == 0:
            return Decision(True)
        return Decision(False, int(retry_ms) / 1000.0, specs[int(failed) - 1])

    async def adjust(self, keys: list[str], member: str, cost: int) -> None:
        if keys:
            await self._adjust(keys=keys, args=[member, cost])

    async def release(self, keys: list[str], member: str) -> None:
        if keys:
            pipe = self._r.pipeline(transaction=False)
            for k in keys:
                pipe.zrem(k, member)
            await pipe.execute()

    async def close(self) -> None:
        return None


class RedisBlobStore:
    """Bytes under a key with a TTL (exact response cache) and bounded lists (semantic cache)."""

    def __init__(self, client: Any) -> None:
        self._r = client

    async def get(self, key: str) -> bytes | None:
        return await self._r.get(key)

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        await self._r.set(key, value, px=max(1, int(ttl_s * 1000)))

    async def push(self, key: str, value: bytes, max_len: int, ttl_s: float) -> None:
        pipe = self._r.pipeline(transaction=True)
        pipe.lpush(key, value)
        pipe.ltrim(key, 0, max_len - 1)
        pipe.pexpire(key, max(1, int(ttl_s * 1000)))
        await pipe.execute()

    async def items(self, key: str) -> list[bytes]:
        return list(await self._r.lrange(key, 0, -1))
