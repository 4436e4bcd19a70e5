"""The fleet simulator keeps the real fleet's promises under pressure: no request is lost, slots and CPU
entries never exceed capacity, pins stay in their slots, and the control plane's placement is obeyed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from control_plane.placement import Pin
from control_plane.replication import Policy as ReplicaPolicy
from fleetsim.config import FleetConfig
from fleetsim.pod import Arrival, InvariantViolated
from fleetsim.policies import POLICIES, Ours, Policy
from fleetsim.simulator import Simulation
from fleetsim.trace import Arrivals, TraceConfig, make_trace

# Small enough for a few seconds, tight enough that slots and CPU entries are fought over: 300 adapters
# against 8 pods x 12 CPU entries, bursts at 3x the mean rate, and the hot set rotating every 5 s.
FLEET = FleetConfig(pods=8, slots=4, cpu_entries=12, max_num_seqs=8)
TRACE = TraceConfig(adapters=300, rate=40.0, duration_s=20.0, alpha=1.0, arrivals=Arrivals.BURSTY,
                    drift_period_s=5.0, drift_step=20, min_tokens=16, max_tokens=96, seed=7)
PINS = [Pin("a00003", 2), Pin("a00010", 2), Pin("a00042", 3), Pin("a00100", 0)]


def simulate(policy: Policy, fleet: FleetConfig = FLEET, seed: int = 1) -> Simulation:
    sim = Simulation(fleet, make_trace(TRACE), policy, PINS, seed=seed, audit=True)
    sim.result = sim.run()
    return sim


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_request_completes_within_capacity_and_every_pin_is_held(name):
    sim = simulate(POLICIES[name]())
    r = sim.result
    assert r.requests == len(sim.trace) > 500
    assert r.completed == r.requests and sim.completed.all()
    assert not np.isnan(sim.queue_s).any()  # every request entered a batch, once
    assert r.peak_slots <= FLEET.slots and r.peak_cpu <= FLEET.cpu_entries
    assert r.peak_slots == FLEET.slots and r.peak_cpu == FLEET.cpu_entries  # the tiers were full, so the limits held
    assert sum(p.counters.evictions for p in sim.pods) > 0
    assert r.pins_assigned == 2 + 2 + 3 + FLEET.pods and r.pins_held == r.pins_assigned
    found = np.bincount(sim.arrived_as, minlength=len(Arrival))  # each request's arrival, as the pods counted it
    assert found.sum() == len(sim.trace)
    assert found[Arrival.SLOT] == sum(p.counters.device_hits for p in sim.pods)
    assert found[Arrival.COLD] == sum(p.counters.cold_loads for p in sim.pods)


def test_the_control_plane_places_each_pin_on_as_many_distinct_pods_as_it_asks():
    sim = simulate(POLICIES["ours"]())
    assigned = sim.control.assigned
    assert {a: len(set(pods)) for a, pods in assigned.items()} == {"a00003": 2, "a00010": 2, "a00042": 3,
                                                                   "a00100": FLEET.pods}
    for adapter, pods in assigned.items():
        for pod in sim.pods:
            assert (adapter in pod.pinned) == (pod.id in pods)


def test_the_leaders_replica_decision_loads_hot_adapters_on_more_pods_within_the_same_invariants():
    eager = ReplicaPolicy(high_rate=0.5, low_rate=0.1, hold_s=3.0)
    sim = simulate(Ours(replication=eager), dataclasses.replace(FLEET, demand_window_s=5.0))
    pin_loads = 2 + 2 + 3 + FLEET.pods
    assert sim.result.preloads > pin_loads  # extra replicas were loaded (LOAD), each a disk read
    assert sim.result.completed == sim.result.requests
    assert simulate(Ours(replicas=False)).result.preloads == pin_loads


def test_the_same_seed_gives_the_same_result_and_another_seed_another():
    a, b = simulate(POLICIES["ours"]()).result, simulate(POLICIES["ours"]()).result
    assert dataclasses.replace(a, wall_s=0) == dataclasses.replace(b, wall_s=0)
    c = simulate(POLICIES["ours"](), seed=2).result
    assert dataclasses.replace(c, wall_s=0) != dataclasses.replace(a, wall_s=0)


def test_residency_aware_routing_hits_device_slots_more_often_than_round_robin():
    ours, blind = simulate(POLICIES["ours"]()).result, simulate(POLICIES["round-robin"]()).result
    assert ours.device_hit_rate > blind.device_hit_rate
    assert ours.cold_per_1k < blind.cold_per_1k


def test_the_audit_catches_a_pod_over_its_slots_and_a_pin_that_lost_its_slot():
    sim = simulate(POLICIES["least-loaded"]())
    pod = next(p for p in sim.pods if p.held)
    pod.check()
    pinned = next(iter(pod.held))
    del pod.slots[pinned]
    with pytest.raises(InvariantViolated, match="pinned adapters lost their slot"):
        pod.check()
    pod.slots[pinned] = True
    for name in list(pod.cpu)[: FLEET.slots + 1]:
        pod.slots[name] = True
    with pytest.raises(InvariantViolated, match=f"in {FLEET.slots} slots"):
        pod.check()


def test_a_policy_that_routes_outside_the_fleet_is_refused():
    class Stray(Policy):
        name = "stray"

        def route(self, adapter: str) -> int:
            return len(self.pods)

    with pytest.raises(InvariantViolated, match="not in the fleet"):
        simulate(Stray())


def test_pins_past_a_pods_capacity_are_refused_by_the_pod():
    sim = Simulation(FLEET, make_trace(TRACE), POLICIES["ours"](), ())
    pod = sim.pods[0]
    for i in range(FLEET.slots):
        pod.load_and_pin(f"a{i:05d}", 0.0)
    with pytest.raises(InvariantViolated, match="past capacity"):
        pod.load_and_pin("a00299", 0.0)


def test_requests_that_can_never_run_are_reported_instead_of_waited_for_forever():
    sim = Simulation(FLEET, make_trace(TRACE), POLICIES["round-robin"](), ())
    for pod in sim.pods:
        pod._start_disk_load = lambda name, now: None  # a disk that never answers
    with pytest.raises(InvariantViolated, match="requests still unfinished 3600 s after the last arrival"):
        sim.run()


def test_the_routers_bounds_on_load_even_out_the_tokens_each_pod_decodes():
    # a fleet below its seats, where the cost alone piles hot adapters onto the pods that hold them
    fleet, trace = FleetConfig(pods=16, cpu_entries=32), make_trace(TraceConfig(adapters=500, rate=30.0,
                                                                                duration_s=60.0, seed=3))
    cost_only, bounded = (Simulation(fleet, trace, Ours(load_bound=bound, share_bound=bound), (), seed=1,
                                     warmup_s=20.0).run() for bound in (0, None))
    assert (Ours().load_bound, Ours().share_bound) == (0.2, 0.1)  # the router's shipped --load-bound, --share-bound
    assert bounded.imbalance <= 1.2 < 1.4 < cost_only.imbalance
    assert bounded.completed == bounded.requests == cost_only.requests
