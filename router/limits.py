"""Per-tenant rate limits shared by every router replica: GCRA (the generic cell rate algorithm) kept in
Redis, one theoretical-arrival-time per tenant and limit, read and written by one Lua script so that
replicas racing on the same tenant see one count. The clock is Redis's own (TIME), so replicas with skewed
clocks still agree.

- requests per second: each request moves the tenant's arrival time on by 1/rate; a burst of one second's
  worth is allowed; a request that would go further is refused and nothing is recorded.
- tokens per minute: a request's tokens (prompt + completion) are known only when it ends, so they are
  charged then; a new request is refused while the tenant has spent more than a minute's worth ahead of
  the clock, with the wait until it has not.
"""

from __future__ import annotations

import logging
import math

import redis.asyncio as redis
from redis.exceptions import RedisError

from router.errors import RateLimited
from router.tenants import Tenant

log = logging.getLogger("lorafleet.router.limits")

_TOKEN_WINDOW_MS = 60_000.0  # tokens per *minute*: the most a tenant may run ahead of the clock

# KEYS: requests TAT, tokens TAT. ARGV: ms per request (0 = unlimited), request tolerance ms (how far ahead),
# ms per token (0 = unlimited), token tolerance ms. Returns {wait ms, limit}: {0, 0} = admitted and counted;
# limit 1 = tokens per minute, 2 = requests per second.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local per_token = tonumber(ARGV[3])
if per_token > 0 then
  local tat = math.max(tonumber(redis.call('GET', KEYS[2]) or now), now)
  local over = tat - now - tonumber(ARGV[4])
  if over > 0 then return {math.ceil(over), 1} end
end
local per_request = tonumber(ARGV[1])
if per_request > 0 then
  local tat = math.max(tonumber(redis.call('GET', KEYS[1]) or now), now) + per_request
  local over = tat - now - tonumber(ARGV[2])
  if over > 0 then return {math.ceil(over), 2} end
  redis.call('SET', KEYS[1], tostring(tat), 'PX', math.ceil(tat - now) + 1000)
end
return {0, 0}
"""
# KEYS: tokens TAT. ARGV: ms per token, tokens spent.
_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local tat = math.max(tonumber(redis.call('GET', KEYS[1]) or now), now) + tonumber(ARGV[1]) * tonumber(ARGV[2])
redis.call('SET', KEYS[1], tostring(tat), 'PX', math.ceil(tat - now) + 1000)
return 0
"""


class RateLimiter:
    """Admits and charges tenants' requests against their limits in the Redis at ``url``. When Redis cannot
    be reached, requests are let through (the pods' own queues still bound the load) and ``on_error`` is
    called, so that an outage of the limits store is not an outage of the API."""

    def __init__(self, url: str, prefix: str = "lorafleet:limits", on_error=lambda: None) -> None:
        self._redis = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._prefix, self._on_error = prefix, on_error
        self._admit = self._redis.register_script(_ADMIT)
        self._charge = self._redis.register_script(_CHARGE)

    async def admit(self, tenant: Tenant) -> None:
        """Counts one request of ``tenant``; RateLimited, with the wait, when a limit refuses it."""
        if tenant.requests_per_s is None and tenant.tokens_per_min is None:
            return
        per_request = 1000.0 / tenant.requests_per_s if tenant.requests_per_s else 0.0
        # How far ahead of the clock the arrival time may run: a burst of one second's requests, at least one.
        request_tolerance = max(1000.0, per_request)
        try:
            wait_ms, limit = await self._admit(keys=self._keys(tenant), args=[
                per_request, request_tolerance, _per_token_ms(tenant), _TOKEN_WINDOW_MS])
        except (RedisError, OSError) as e:
            self._failed(e)
            return
        if wait_ms > 0:
            which = f"{tenant.tokens_per_min} tokens/min" if limit == 1 else f"{tenant.requests_per_s:g} requests/s"
            raise RateLimited(f"tenant {tenant.name!r} is over its limit of {which}; retry in"
                              f" {math.ceil(wait_ms / 1000)} s", retry_after_s=wait_ms / 1000)

    async def charge(self, tenant: Tenant, tokens: int) -> None:
        """Charges ``tokens`` (prompt + completion) of a finished request to ``tenant``'s tokens per minute."""
        if tenant.tokens_per_min is None or tokens <= 0:
            return
        try:
            await self._charge(keys=self._keys(tenant)[1:], args=[_per_token_ms(tenant), tokens])
        except (RedisError, OSError) as e:
            self._failed(e)

    async def close(self) -> None:
        await self._redis.aclose()

    def _keys(self, tenant: Tenant) -> list[str]:
        return [f"{self._prefix}:{{{tenant.name}}}:requests", f"{self._prefix}:{{{tenant.name}}}:tokens"]

    def _failed(self, error: Exception) -> None:
        self._on_error()
        log.warning("the limits store is unreachable; letting the request through", extra={"error": str(error)})


def _per_token_ms(tenant: Tenant) -> float:
    return _TOKEN_WINDOW_MS / tenant.tokens_per_min if tenant.tokens_per_min else 0.0

