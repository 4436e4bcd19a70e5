"""Tenants' limits counted in a real redis-server: two limiters on one Redis (two router replicas) share one
count; a refusal says how long to wait, and waiting that long is enough; tokens are charged after the fact
and refuse the next request until the tenant is back within a minute's worth."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.processes import RedisServer, free_port
from router.errors import RateLimited
from router.limits import RateLimiter
from router.tenants import Tenant


@pytest.fixture
def redis_url(tmp_path):
    server = RedisServer(tmp_path, durable=False)
    server.start()
    yield server.url
    server.kill()


async def outcomes(limiter: RateLimiter, tenant: Tenant, n: int) -> list[float]:
    """0 for each admitted request, else its wait in seconds."""
    waits = []
    for _ in range(n):
        try:
            await limiter.admit(tenant)
            waits.append(0.0)
        except RateLimited as e:
            waits.append(e.retry_after_s)
    return waits


def test_two_replicas_share_one_requests_per_second_count(redis_url):
    tenant = Tenant("acme", ("*",), requests_per_s=4)

    async def go():
        replicas = [RateLimiter(redis_url), RateLimiter(redis_url)]
        try:
            waits = [w for _ in range(3) for r in replicas for w in await outcomes(r, tenant, 1)]
            refused = [w for w in waits if w]
            await asyncio.sleep(max(refused))
            after = await outcomes(replicas[1], tenant, 1)
            other = await outcomes(replicas[0], Tenant("beta", ("*",), requests_per_s=4), 4)
            return waits, after, other
        finally:
            for r in replicas:
                await r.close()

    waits, after, other = asyncio.run(go())
    # A second's burst of 4 in all, across both replicas, and not 4 each.
    assert waits[:4] == [0.0] * 4 and all(0 < w <= 0.25 for w in waits[4:])
    assert after == [0.0]  # the wait it was told was enough
    assert other == [0.0] * 4  # another tenant counts apart


def test_tokens_are_charged_when_a_request_ends_and_refuse_until_back_within_a_minute(redis_url):
    tenant = Tenant("acme", ("*",), tokens_per_min=600)  # 100 ms a token

    async def go():
        limiter = RateLimiter(redis_url)
        try:
            await limiter.admit(tenant)
            await limiter.charge(tenant, 590)
            admitted = await outcomes(limiter, tenant, 1)  # 590 of 600: still within the minute
            await limiter.charge(tenant, 30)  # 620: 20 tokens, 2 s, over
            return admitted, await outcomes(limiter, tenant, 1)
        finally:
            await limiter.close()

    admitted, refused = asyncio.run(go())
    assert admitted == [0.0] and 1.5 < refused[0] <= 2.0


def test_an_unreachable_store_lets_requests_through_and_counts_the_failure():
    failures = []

    async def go():
        limiter = RateLimiter(f"redis://127.0.0.1:{free_port()}/0", on_error=lambda: failures.append(1))
        try:
            return await outcomes(limiter, Tenant("acme", ("*",), requests_per_s=1), 3)
        finally:
            await limiter.close()

    assert asyncio.run(go()) == [0.0] * 3 and len(failures) == 3
