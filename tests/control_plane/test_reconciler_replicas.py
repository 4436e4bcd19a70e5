"""The leader's replicas that follow popularity, pass by pass against a real Redis, with the pods'
DataPlaneAdmin calls answered by the scripted stand-in of test_reconciler."""

from __future__ import annotations

import dataclasses

import grpc

from control_plane.metrics import ControlPlaneMetrics
from control_plane.plan import Command
from control_plane.reconciler import Reconciler
from control_plane.records import PlacementState, PodRecord, Residency
from tests.control_plane.test_reconciler import SHA, endpoint, run

LOAD, RELEASE, PIN = Command.LOAD, Command.RELEASE, Command.LOAD_AND_PIN


def replicating(h, **policy) -> ControlPlaneMetrics:
    """Rebuilds the harness's reconciler with a replica policy (high 5/s, low 1/s, no hold unless told)."""
    h.config = dataclasses.replace(h.config, **({"replica_high_rate": 5.0, "replica_low_rate": 1.0,
                                                 "replica_hold": 0.0} | policy))
    metrics = ControlPlaneMetrics()
    h.reconciler = Reconciler(h.config, h.store, h.fleet, h.lease, h.pods, metrics)
    return metrics


async def beat(h, pod_id: str, holds: tuple[str, ...] = (), demand: tuple[tuple[str, float], ...] = (),
               running: int = 0) -> None:
    await h.fleet.heartbeat(PodRecord(pod_id, endpoint(pod_id), reported_ready=True, slots_total=4, slots_used=1,
                                      cpu_cache_capacity=8, running_requests=running, demand=demand,
                                      residents=tuple(Residency(a, sha256=SHA) for a in holds)))


def test_a_hot_adapter_is_preloaded_unpinned_on_more_pods_and_routed_there(config, redis_server):
    async def body(h):
        metrics = replicating(h)
        await h.adapter("hot")
        await h.adapter("calm")
        await beat(h, "p0", holds=("hot", "calm"), demand=(("hot", 8.0), ("calm", 4.0)))
        await beat(h, "p1", demand=(("hot", 4.0),), running=2)  # refused or relayed requests count too
        await beat(h, "p2")
        await beat(h, "p3", running=1)
        await h.lease.renew()
        h.clock.t += 0.5  # the pass runs after the beats
        sent = await h.sent()
        route = await h.registry.route("hot")
        again = await h.sent()
        return sent, route, again, metrics

    sent, route, again, metrics = run(config, redis_server, body)
    # 12/s over 5/s per replica: three replicas; the new ones on the least loaded pods, calm left alone
    assert sent == [("p2", LOAD, "hot"), ("p3", LOAD, "hot")]
    assert [(p.pod, p.state, p.pinned) for p in route] == [("p0", PlacementState.READY, False),
                                                           ("p2", PlacementState.READY, False),
                                                           ("p3", PlacementState.READY, False)]
    assert again == []  # loaded since the pods' last reports: not sent again
    assert metrics.replica_changes.labels("added")._value.get() == 2
    assert metrics.adapters_replicated._value.get() == 1


def test_a_hot_pinned_adapter_gets_unpinned_replicas_beside_its_pin_and_route_says_which_is_which(
        config, redis_server):
    async def body(h):
        replicating(h)
        await h.adapter("p")
        await h.registry.pin("p", 1)
        await h.lease.renew()
        await beat(h, "p0")
        await beat(h, "p1")
        await beat(h, "p2")
        h.clock.t += 0.5
        pinned = await h.sent()
        holder = pinned[0][0]
        for pod in ("p0", "p1", "p2"):
            await h.fleet.heartbeat(PodRecord(pod, endpoint(pod), reported_ready=True, slots_total=4,
                                              cpu_cache_capacity=8, demand=(("p", 12.0),) if pod == holder else (),
                                              residents=(Residency("p", pinned=True, sha256=SHA),) if pod == holder
                                              else ()))
        h.clock.t += 0.5
        replicas = await h.sent()
        return holder, pinned, replicas, await h.registry.route("p")

    holder, pinned, replicas, route = run(config, redis_server, body)
    assert pinned == [(holder, PIN, "p")]
    assert [command for _, command, _ in replicas] == [LOAD, LOAD]  # 12/s: three replicas, one of them pinned
    assert {(r.pod, r.pinned) for r in route} == {(holder, True), *((pod, False) for pod, _, _ in replicas)}


def test_a_cooled_adapter_loses_its_extra_replicas_one_per_hold_and_keeps_one(config, redis_server):
    async def body(h):
        metrics = replicating(h)
        await h.adapter("hot")
        for p in ("p0", "p1", "p2"):
            await beat(h, p, holds=("hot",) if p == "p0" else (), demand=(("hot", 12.0),) if p == "p0" else ())
        await h.lease.renew()
        raised = await h.sent()
        holders = {"p0", "p1", "p2"}
        passes = []
        for _ in range(3):
            for p in ("p0", "p1", "p2"):
                await beat(h, p, holds=("hot",) if p in holders else (), demand=(("hot", 0.1),) if p == "p0" else ())
            sent = await h.sent()
            holders -= {pod for pod, command, _ in sent if command is RELEASE}
            passes.append(sent)
        return raised, passes, holders, await h.store.placements(["hot"]), metrics

    raised, passes, holders, placements, metrics = run(config, redis_server, body)
    assert raised == [("p1", LOAD, "hot"), ("p2", LOAD, "hot")]
    assert [len(p) for p in passes] == [1, 1, 0]  # one replica per pass (no hold here), then it stays at one
    assert all(command is RELEASE for sent in passes for _, command, _ in sent)
    assert len(holders) == 1
    assert {r.pod for r in placements["hot"]} <= holders  # released replicas' records are gone
    assert metrics.replica_changes.labels("released")._value.get() == 2


def test_a_replica_in_use_that_the_pod_will_not_release_holds_up_nothing_and_is_released_later(
        config, redis_server):
    async def body(h):
        replicating(h, retry_backoff_s=30.0)  # a pod held up would be left alone for 30 s
        await h.adapter("hot")
        await h.adapter("other")
        await h.lease.renew()
        await beat(h, "p0", holds=("hot",), demand=(("hot", 12.0),))
        await beat(h, "p1")
        raised = await h.sent()
        h.pods.refuse[("p0", RELEASE)] = (grpc.StatusCode.FAILED_PRECONDITION, "in use by 1 request")
        for p in ("p0", "p1"):
            await beat(h, p, holds=("hot",), demand=(("hot", 0.1),) if p == "p0" else ())
        refused = await h.sent()
        await h.registry.pin("other", 0)
        then = await h.sent()
        return raised, refused, then

    raised, refused, then = run(config, redis_server, body)
    assert raised == [("p1", LOAD, "hot")]
    assert refused == [("p0", RELEASE, "hot")]
    # p0 is not backed off: it gets its pin at once, and the release is decided again (no hold here)
    assert then == [("p0", PIN, "other"), ("p0", RELEASE, "hot"), ("p1", PIN, "other")]


def test_replication_turned_off_sends_no_replica_commands(config, redis_server):
    async def body(h):
        replicating(h, replica_high_rate=0.0, replica_low_rate=0.0)
        await h.adapter("hot")
        await beat(h, "p0", holds=("hot",), demand=(("hot", 1000.0),))
        await beat(h, "p1")
        await h.lease.renew()
        return await h.sent()

    assert run(config, redis_server, body) == []


def test_a_new_leader_takes_over_the_replicas_it_finds_and_releases_them_once_cold(config, redis_server):
    async def body(h):
        replicating(h)
        await h.adapter("hot")
        await h.lease.renew()
        await beat(h, "p0", holds=("hot",), demand=(("hot", 12.0),))
        await beat(h, "p1")
        await beat(h, "p2")
        raised = await h.sent()
        replicating(h)  # a new leader: none of the old one's memory, only the registry
        for p in ("p0", "p1", "p2"):
            await beat(h, p, holds=("hot",), demand=(("hot", 0.1),) if p == "p0" else ())
        h.clock.t += 0.5
        return raised, await h.sent()

    raised, after = run(config, redis_server, body)
    assert raised == [("p1", LOAD, "hot"), ("p2", LOAD, "hot")]
    assert after == [("p0", RELEASE, "hot")]  # one per hold (none here), from the busiest pod (all idle: by id)


def test_a_new_leader_leaves_alone_an_adapter_the_pods_loaded_on_demand(config, redis_server):
    async def body(h):
        replicating(h)
        await h.adapter("warm")
        await h.lease.renew()
        for p in ("p0", "p1", "p2"):  # the router sent it everywhere; no leader loaded it
            await beat(h, p, holds=("warm",), demand=(("warm", 0.1),))
        return await h.sent()

    assert run(config, redis_server, body) == []
