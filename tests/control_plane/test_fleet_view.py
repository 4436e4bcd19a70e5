"""The fleet's reused view of pod records (``view_cache_s``), against a real Redis: what this replica
records or removes shows at once; what another replica records shows once the view lapses."""

from __future__ import annotations

import asyncio

from control_plane.fleet import Fleet
from control_plane.records import PodRecord, Residency
from control_plane.store import Store


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def pod(residents: tuple[Residency, ...] = ()) -> PodRecord:
    return PodRecord("p0", "127.0.0.1:7000", reported_ready=True, slots_total=4, cpu_cache_capacity=8,
                     residents=residents)


def with_fleets(redis_server, body):
    """Runs ``body(here, elsewhere, view_clock, store)``: two replicas' fleets on one registry, ``here``
    reusing what it reads for 60 s of ``view_clock``, ``elsewhere`` reading Redis every time."""
    async def go():
        store = Store(redis_server.url, "view", clock=Clock())
        view_clock = Clock()
        here = Fleet(store, "", 10.0, 20.0, view_cache_s=60.0, clock=view_clock)
        elsewhere = Fleet(store, "", 10.0, 20.0)
        try:
            return await body(here, elsewhere, view_clock, store)
        finally:
            await store.close()

    return asyncio.run(go())


def residents(views) -> list[tuple[str, tuple[str, ...]]]:
    return [(v.pod.id, tuple(r.name for r in v.pod.residents)) for v in views]


def test_a_heartbeat_recorded_here_shows_at_once(redis_server):
    async def body(here, elsewhere, view_clock, store):
        await here.heartbeat(pod())
        first = await here.pods()
        await here.heartbeat(pod((Residency("a", pinned=True),)))
        return residents(first), residents(await here.pods())

    assert with_fleets(redis_server, body) == ([("p0", ())], [("p0", ("a",))])


def test_a_heartbeat_another_replica_records_shows_once_the_view_lapses(redis_server):
    async def body(here, elsewhere, view_clock, store):
        before = await here.pods()
        await elsewhere.heartbeat(pod())
        within = await here.pods()
        view_clock.t += 61
        return residents(before), residents(within), residents(await here.pods())

    assert with_fleets(redis_server, body) == ([], [], [("p0", ())])


def test_a_pod_removed_here_disappears_at_once(redis_server):
    async def body(here, elsewhere, view_clock, store):
        await elsewhere.heartbeat(pod())
        (seen,) = await here.pods()
        token = await store.acquire_leadership("me", 30)
        removed = await here.remove("p0", seen.pod.last_heartbeat, token)
        return removed, await here.pods()

    assert with_fleets(redis_server, body) == (True, [])
