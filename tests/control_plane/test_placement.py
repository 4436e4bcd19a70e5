"""Placement of pinned adapters on pods: a pure function, so tested exhaustively."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.placement import Pin, PodSlots, pinned_capacity, place


def pods(*capacities: int, **pinned: str) -> list[PodSlots]:
    return [PodSlots(f"p{i}", c, frozenset(a for a, p in pinned.items() if p == f"p{i}"))
            for i, c in enumerate(capacities)]


def test_replicas_of_one_adapter_go_to_distinct_pods():
    result = place([Pin("a", 3)], pods(4, 4, 4, 4))
    assert len(set(result.pods["a"])) == 3
    assert result.unsatisfied == {}


def test_pins_spread_over_the_pods_with_most_free_capacity():
    result = place([Pin(f"a{i}", 1) for i in range(6)], pods(3, 3, 3))
    load = Counter(p for ids in result.pods.values() for p in ids)
    assert load == {"p0": 2, "p1": 2, "p2": 2}


def test_replicas_zero_means_every_pod():
    result = place([Pin("a", 0)], pods(2, 2, 2))
    assert result.pods["a"] == ("p0", "p1", "p2")
    assert result.unsatisfied == {}


def test_replicas_zero_with_a_full_pod_is_reported():
    result = place([Pin("b", 1), Pin("a", 0)], pods(1, 2, 2, b="p0"))
    assert result.pods["a"] == ("p1", "p2")
    assert "every pod, pinned on 2" in result.unsatisfied["a"]
    assert "no free pinned capacity" in result.unsatisfied["a"]


def test_more_replicas_than_pods_is_reported_not_dropped():
    result = place([Pin("a", 5)], pods(4, 4))
    assert result.pods["a"] == ("p0", "p1")
    assert result.unsatisfied["a"] == "asked for 5 pods, pinned on 2: only 2 ready pods"


def test_pins_beyond_the_fleets_capacity_are_reported_and_capacity_is_never_exceeded():
    result = place([Pin(f"a{i}", 1) for i in range(5)], pods(1, 2))
    assert sum(len(ids) for ids in result.pods.values()) == 3
    assert len(result.unsatisfied) == 2
    assert all("no free pinned capacity" in why for why in result.unsatisfied.values())


def test_scarce_capacity_gives_every_adapter_one_replica_before_any_gets_two():
    result = place([Pin("a", 2), Pin("b", 2)], pods(1, 1))
    assert len(result.pods["a"]) == len(result.pods["b"]) == 1


def test_no_ready_pods_leaves_every_pin_unsatisfied():
    result = place([Pin("a", 1), Pin("b", 0)], [])
    assert result.pods == {"a": (), "b": ()}
    assert result.unsatisfied["a"] == "asked for 1 pod, pinned on 0: no ready pods"
    assert result.unsatisfied["b"] == "asked for every pod, pinned on 0: no ready pods"


def test_pins_already_held_stay_where_they_are():
    result = place([Pin("a", 1), Pin("b", 1)], pods(2, 2, 2, a="p2", b="p2"))
    assert result.pods == {"a": ("p2",), "b": ("p2",)}


def test_pins_of_a_lost_pod_are_placed_on_the_remaining_pods():
    before = place([Pin("a", 2), Pin("b", 1)], pods(2, 2, 2))
    lost = before.pods["a"][0]
    survivors = [PodSlots(p.id, p.capacity, frozenset(a for a, ids in before.pods.items() if p.id in ids))
                 for p in pods(2, 2, 2) if p.id != lost]
    after = place([Pin("a", 2), Pin("b", 1)], survivors)
    assert len(after.pods["a"]) == 2 and lost not in after.pods["a"]
    assert after.unsatisfied == {}
    assert set(before.pods["b"]) - {lost} <= set(after.pods["b"])  # what survived did not move


def test_a_pod_in_its_grace_period_keeps_its_pins_but_gets_no_new_ones():
    slots = [PodSlots("p0", 2, frozenset({"a"}), schedulable=False), PodSlots("p1", 2)]
    result = place([Pin("a", 2), Pin("b", 1)], slots)
    assert result.pods["a"] == ("p0", "p1")
    assert result.pods["b"] == ("p1",)


@pytest.mark.parametrize("in_grace", ["p0", "p1"])
def test_a_pin_on_every_pod_stays_on_both_pods_while_one_is_in_its_grace_period(in_grace):
    # After a control-plane restart one pod heartbeats before the other: neither may lose its pin meanwhile.
    slots = [PodSlots(p, 2, frozenset({"a"}), schedulable=p != in_grace) for p in ("p0", "p1")]
    result = place([Pin("a", 0)], slots)
    assert result.pods["a"] == ("p0", "p1")
    assert result.unsatisfied == {}


def test_a_pod_where_loading_failed_for_good_is_avoided_and_the_failure_is_reported():
    result = place([Pin("a", 2)], pods(1, 1), failed=frozenset({("a", "p0")}))
    assert result.pods["a"] == ("p1",)
    assert "loading failed on p0" in result.unsatisfied["a"]


def test_pinned_capacity_keeps_reserved_slots_free_and_is_bounded_by_the_cpu_cache():
    assert pinned_capacity(slots_total=4, cpu_cache_capacity=16, reserved=1) == 3
    assert pinned_capacity(slots_total=8, cpu_cache_capacity=2, reserved=1) == 1
    assert pinned_capacity(slots_total=1, cpu_cache_capacity=4, reserved=1) == 0


@settings(max_examples=200, deadline=None)
@given(capacities=st.lists(st.integers(0, 4), max_size=6),
       replicas=st.lists(st.integers(0, 5), max_size=8),
       held=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 5)), max_size=10))
def test_placement_never_exceeds_capacity_and_accounts_for_every_pin(capacities, replicas, held):
    pins = [Pin(f"a{i}", r) for i, r in enumerate(replicas)]
    slots = [PodSlots(f"p{j}", c, frozenset(f"a{i}" for i, pj in held if pj == j)) for j, c in enumerate(capacities)]
    result = place(pins, slots)
    load = Counter(p for ids in result.pods.values() for p in ids)
    assert all(load[s.id] <= s.capacity for s in slots)
    for pin in pins:
        ids = result.pods[pin.adapter]
        assert len(ids) == len(set(ids))
        want = pin.replicas or len(slots)
        assert len(ids) <= want
        assert (len(ids) < want or want == 0) == (pin.adapter in result.unsatisfied)
    assert place(pins, slots) == result  # deterministic
