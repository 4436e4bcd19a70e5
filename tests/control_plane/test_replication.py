"""The replica decision: hot adapters get more pods, cold extra replicas go, with hysteresis."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.errors import ConfigError
from control_plane.replication import PodLoad, Policy, ReplicaPlan, ReplicaState, plan_replicas

POLICY = Policy(high_rate=10.0, low_rate=4.0, hold_s=60.0)
NOTHING = ReplicaPlan({}, {}, {}, ReplicaState())


def pods(n: int = 4, capacity: int = 2, **load) -> list[PodLoad]:
    return [PodLoad(f"pod-{i}", capacity, **load) for i in range(n)]


def plan(rates, holders, pins=None, fleet=None, state=None, now=0.0, policy=POLICY, **kw) -> ReplicaPlan:
    return plan_replicas(rates, holders, pins or {}, fleet if fleet is not None else pods(), policy,
                         state or ReplicaState(), now, **kw)


def test_an_adapter_above_the_high_rate_per_replica_is_raised_to_keep_each_replica_under_it():
    p = plan({"hot": 25.0}, {"hot": {"pod-0"}})
    assert p.targets == {"hot": 3}  # ceil(25 / 10)
    assert p.add == {"hot": ("pod-1", "pod-2")}
    assert p.release == {}


def test_an_adapter_at_or_under_the_high_rate_is_left_alone():
    assert plan({"warm": 10.0}, {"warm": {"pod-0"}}) == NOTHING
    assert plan({"warm": 19.0}, {"warm": {"pod-0", "pod-1"}}).add == {}


def test_an_adapter_held_nowhere_but_hot_is_loaded_on_enough_pods():
    assert plan({"hot": 15.0}, {}).add == {"hot": ("pod-0", "pod-1")}


def test_new_replicas_go_where_the_router_would_send_overflow_a_free_slot_then_the_least_load():
    fleet = [PodLoad("a", 2, running=1), PodLoad("b", 2, has_free_slot=False, running=1),
             PodLoad("c", 2, running=4), PodLoad("d", 2, running=0, waiting=1)]
    # costs: a 14+1, b 20+1, c 14+4, d 14+2 -> a, d, c, b
    assert plan({"hot": 15.0}, {}, fleet=fleet).add == {"hot": ("a", "d")}
    assert plan({"hot": 25.0}, {}, fleet=fleet).add == {"hot": ("a", "c", "d")}


def test_within_the_band_the_target_holds_and_replicas_lost_are_replaced():
    first = plan({"hot": 25.0}, {"hot": {"pod-0"}})
    # rate fell to 6/s per target replica: between low (4) and high (10), so no change
    second = plan({"hot": 18.0}, {"hot": {"pod-0", "pod-1"}}, state=first.state, now=1.0)
    assert second.targets == {"hot": 3}
    assert second.add == {"hot": ("pod-2",)}  # pod-2's replica was evicted; it comes back
    assert second.release == {}


def test_below_the_low_rate_a_replica_goes_only_after_the_hold_time_and_one_at_a_time():
    state = plan({"hot": 35.0}, {"hot": {"pod-0"}}).state
    holders = {"hot": {"pod-0", "pod-1", "pod-2", "pod-3"}}
    assert state.targets == {"hot": 4}
    quiet = plan({"hot": 2.0}, holders, state=state, now=10.0)  # 0.5/s per replica
    assert quiet.targets == {"hot": 4} and quiet.release == {}
    held = plan({"hot": 2.0}, holders, state=quiet.state, now=10.0 + POLICY.hold_s - 1)
    assert held.release == {}
    lowered = plan({"hot": 2.0}, holders, state=held.state, now=10.0 + POLICY.hold_s)
    assert lowered.targets == {"hot": 3} and len(lowered.release["hot"]) == 1
    holders = {"hot": holders["hot"] - set(lowered.release["hot"])}
    soon = plan({"hot": 2.0}, holders, state=lowered.state, now=10.0 + POLICY.hold_s + 1)
    assert soon.release == {}  # the hold starts again after each step down


def test_a_rate_back_in_the_band_resets_the_hold():
    state = plan({"hot": 25.0}, {"hot": {"pod-0"}}).state
    holders = {"hot": {"pod-0", "pod-1", "pod-2"}}
    low = plan({"hot": 3.0}, holders, state=state, now=0.0)
    back = plan({"hot": 15.0}, holders, state=low.state, now=30.0)
    again_low = plan({"hot": 3.0}, holders, state=back.state, now=70.0)
    assert again_low.release == {}  # 70 s after the first dip, but only 0 s into this one


def test_lowering_never_goes_below_what_would_raise_the_adapter_again():
    policy = Policy(high_rate=10.0, low_rate=8.0, hold_s=0.0)
    state = plan({"hot": 35.0}, {"hot": {"pod-0"}}, policy=policy).state  # 4 replicas
    holders = {"hot": {"pod-0", "pod-1", "pod-2", "pod-3"}}
    # 30/s over 4 is 7.5 < low, but 3 replicas is the fewest that keep each at <= 10/s
    p = plan({"hot": 30.0}, holders, state=state, now=1.0, policy=policy)
    assert p.targets == {"hot": 3}
    p2 = plan({"hot": 30.0}, {"hot": holders["hot"] - set(p.release["hot"])}, state=p.state, now=2.0, policy=policy)
    assert p2.targets == {"hot": 3} and p2.release == {} and p2.add == {}


def test_a_cold_adapter_loses_its_extra_replicas_and_is_then_forgotten():
    policy = Policy(high_rate=10.0, low_rate=4.0, hold_s=0.0)
    state = plan({"hot": 15.0}, {"hot": {"pod-0"}}, policy=policy).state
    p = plan({}, {"hot": {"pod-0", "pod-1"}}, state=state, now=1.0, policy=policy)
    assert p.release == {"hot": ("pod-0",)}  # equally busy pods: the first by id
    assert p.targets == {"hot": 1}  # managed until the release is done (a pod may refuse it while in use)
    # back to one replica: the pods' LRU owns it
    assert plan({}, {"hot": {"pod-1"}}, state=p.state, now=2.0, policy=policy) == NOTHING


def test_a_release_the_pod_did_not_carry_out_is_decided_again_after_the_next_hold():
    policy = Policy(high_rate=10.0, low_rate=4.0, hold_s=30.0)
    state = ReplicaState({"hot": 2}, {"hot": 0.0})
    p = plan({}, {"hot": {"pod-0", "pod-1"}}, state=state, now=30.0, policy=policy)
    assert p.release == {"hot": ("pod-0",)}
    refused = plan({}, {"hot": {"pod-0", "pod-1"}}, state=p.state, now=31.0, policy=policy)
    assert refused.release == {}  # the hold starts again
    retried = plan({}, {"hot": {"pod-0", "pod-1"}}, state=refused.state, now=61.0, policy=policy)
    assert retried.release == {"hot": ("pod-0",)}


def test_the_replica_released_is_the_one_on_the_busiest_pod():
    policy = Policy(high_rate=10.0, low_rate=4.0, hold_s=0.0)
    fleet = [PodLoad("a", 2, running=3), PodLoad("b", 2, running=0), PodLoad("c", 2, running=1)]
    state = ReplicaState({"hot": 3})
    p = plan({"hot": 1.0}, {"hot": {"a", "b", "c"}}, fleet=fleet, state=state, now=1.0, policy=policy)
    assert p.release == {"hot": ("a",)}


def test_a_pin_is_a_floor_and_pinned_replicas_are_never_released():
    policy = Policy(high_rate=10.0, low_rate=4.0, hold_s=0.0)
    hot = plan({"p": 45.0}, {"p": {"pod-0", "pod-1"}}, pins={"p": 2}, policy=policy,
               pinned_on={"p": {"pod-0", "pod-1"}})
    assert hot.targets == {"p": 4} and hot.add == {"p": ("pod-2", "pod-3")}
    all4 = {"p": {"pod-0", "pod-1", "pod-2", "pod-3"}}
    cold = hot.state
    released: set[str] = set()
    for step in range(1, 5):
        c = plan({}, {"p": all4["p"] - released}, pins={"p": 2}, state=cold, now=float(step), policy=policy,
                 pinned_on={"p": {"pod-0", "pod-1"}})
        released |= set(c.release.get("p", ()))
        cold = c.state
    assert released == {"pod-2", "pod-3"}  # down to the pin's two, never the pinned pods
    assert cold == ReplicaState()


def test_an_adapter_pinned_on_every_pod_is_not_replicated():
    assert plan({"p": 1000.0}, {"p": {"pod-0"}}, pins={"p": 0}) == NOTHING


def test_targets_are_capped_by_max_replicas_ready_pods_and_their_room():
    assert plan({"hot": 1000.0}, {}).targets == {"hot": 4}  # four pods
    assert plan({"hot": 1000.0}, {}, policy=Policy(high_rate=10.0, low_rate=4.0, max_replicas=2)).targets == {"hot": 2}
    room = [PodLoad("a", 1), PodLoad("b", 0), PodLoad("c", 1)]
    p = plan({"x": 100.0, "y": 90.0}, {}, fleet=room)
    # two pods with room for one replica each, shared one per adapter per round, hottest first
    assert p.add == {"x": ("a",), "y": ("c",)}
    assert p.targets == {} and p.state == ReplicaState()  # one replica each: not more than the floor
    holders_elsewhere = plan({"x": 100.0}, {"x": {"pod-9"}}, fleet=pods(2))  # a holder that is not ready
    assert holders_elsewhere.add == {"x": ("pod-0", "pod-1")}


def test_room_already_taken_by_replicas_counts_and_failed_pods_are_skipped():
    fleet = [PodLoad("a", 1), PodLoad("b", 1), PodLoad("c", 1)]
    state = ReplicaState({"x": 2})
    p = plan({"x": 15.0, "y": 25.0}, {"x": {"a", "b"}, "y": {"c"}}, fleet=fleet, state=state)
    assert p.add == {}  # a and b hold x's replicas, c holds y: no room left
    assert p.targets == {"x": 2}
    q = plan({"y": 25.0}, {"y": {"c"}}, fleet=fleet, excluded={("y", "a")})
    assert q.add == {"y": ("b",)}


def test_the_plan_is_deterministic_whatever_the_order_of_its_inputs():
    rates = {"a": 31.0, "b": 31.0, "c": 12.0, "d": 0.5}
    holders = {"a": ["pod-1"], "b": ["pod-2"], "c": ["pod-0", "pod-3"], "d": ["pod-1"]}
    fleet = [PodLoad(f"pod-{i}", 2, running=i % 2) for i in range(4)]
    plans = set()
    for order in itertools.permutations(fleet):
        shuffled_rates = dict(reversed(list(rates.items())))
        plans.add(repr(plan(shuffled_rates, holders, fleet=list(order))))
        plans.add(repr(plan(rates, {k: list(reversed(v)) for k, v in holders.items()}, fleet=list(order))))
    assert len(plans) == 1


@pytest.mark.parametrize("kwargs", [{"high_rate": 0.0}, {"high_rate": float("inf")}, {"high_rate": float("nan")},
                                    {"low_rate": 10.0}, {"low_rate": -1.0}, {"hold_s": -1.0},
                                    {"max_replicas": -1}])
def test_a_policy_without_a_working_hysteresis_band_is_refused(kwargs):
    with pytest.raises(ConfigError):
        Policy(**({"high_rate": 10.0, "low_rate": 4.0} | kwargs))


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_any_plan_keeps_pins_room_and_caps(data):
    """Whatever the fleet and the rates: new replicas only on ready pods that do not hold the adapter, within
    each pod's room; releases only of unpinned holders; targets within max_replicas and the ready pods."""
    n_pods = data.draw(st.integers(0, 5))
    fleet = [PodLoad(f"p{i}", data.draw(st.integers(0, 3)), data.draw(st.booleans()), data.draw(st.integers(0, 4)))
             for i in range(n_pods)]
    ids = [p.id for p in fleet] + ["gone"]
    names = ["a", "b", "c"]
    rates = {a: data.draw(st.floats(0, 100)) for a in names if data.draw(st.booleans())}
    holders = {a: set(data.draw(st.lists(st.sampled_from(ids), max_size=4))) for a in names}
    pins = {a: data.draw(st.integers(0, 3)) for a in names if data.draw(st.booleans())}
    pinned_on = {a: {p for p in holders[a] if data.draw(st.booleans())} for a in pins}
    policy = Policy(high_rate=10.0, low_rate=4.0, hold_s=data.draw(st.sampled_from([0.0, 5.0])),
                    max_replicas=data.draw(st.integers(0, 3)))
    state = ReplicaState({a: data.draw(st.integers(1, 5)) for a in names if data.draw(st.booleans())})
    p = plan(rates, holders, pins=pins, fleet=fleet, state=state, now=10.0, policy=policy, pinned_on=pinned_on)
    ready = {f.id: f for f in fleet}
    for a, pods_added in p.add.items():
        assert all(pod in ready and pod not in holders[a] for pod in pods_added)
    for a, pods_released in p.release.items():
        assert all(pod in holders[a] and pod not in pinned_on.get(a, ()) for pod in pods_released)
    for pod in ready.values():
        assert sum(pod.id in added for added in p.add.values()) <= pod.capacity
    for a, t in p.targets.items():
        assert t <= max(min(policy.max_replicas or n_pods, n_pods), min(pins.get(a, 0), n_pods))
    assert p == plan(rates, holders, pins=pins, fleet=fleet, state=state, now=10.0, policy=policy,
                     pinned_on=pinned_on)
