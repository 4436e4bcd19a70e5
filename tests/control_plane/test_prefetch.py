"""Prefetch by popularity: remote adapters whose demand rises get disk copies on the pods the router would send
their overflow to, hottest first, within a per-pass budget, never past a pod's disk room."""

from __future__ import annotations

import pytest

from control_plane.errors import ConfigError
from control_plane.plan import Command
from control_plane.prefetch import Prefetch, demand_rates, disk_has_room, popular_prefetches
from control_plane.records import AdapterRecord, PodRecord, Residency

GB = 1 << 30


def adapter(name: str, source: str = "s3://bucket/x") -> AdapterRecord:
    return AdapterRecord(name, source, name[0] * 64, "base")


def pod(pod_id: str, running: int = 0, used: int = 0, entries: int = 0, capacity: int = 10 * GB,
        residents: tuple[str, ...] = (), demand: tuple[tuple[str, float], ...] = ()) -> PodRecord:
    return PodRecord(pod_id, f"{pod_id}:1", running_requests=running, disk_capacity_bytes=capacity,
                     disk_used_bytes=used, disk_entries=entries, residents=tuple(Residency(r) for r in residents),
                     demand=demand)


def never(adapter: str, pod: str, sha256: str) -> bool:
    return False


def prefetched(actions) -> list[tuple[str, str]]:
    assert all(a.command is Command.PREFETCH for a in actions)
    return [(a.adapter, a.pod) for a in actions]


def test_a_rising_remote_adapter_goes_to_the_least_loaded_pods_disks_one_copy_per_rate_step():
    pods = [pod("a", running=3), pod("b"), pod("c", running=1)]
    assert prefetched(popular_prefetches([adapter("hot")], pods, {"hot": 2.5}, Prefetch(rate=1.0), never)) == [
        ("hot", "b"), ("hot", "c"), ("hot", "a")]
    assert prefetched(popular_prefetches([adapter("hot")], pods, {"hot": 1.5}, Prefetch(rate=1.0), never)) == [
        ("hot", "b"), ("hot", "c")]
    assert popular_prefetches([adapter("cool")], pods, {"cool": 0.9}, Prefetch(rate=1.0), never) == []
    assert popular_prefetches([adapter("hot")], pods, {"hot": 9.0}, Prefetch(rate=0.0), never) == []  # off


def test_holders_and_earlier_prefetches_count_as_copies_and_local_sources_are_never_prefetched():
    pods = [pod("a", residents=("hot",)), pod("b"), pod("c")]
    asked = {("hot", "b")}
    actions = popular_prefetches([adapter("hot"), adapter("local", "file:///adapters/local")], pods,
                                 {"hot": 3.0, "local": 50.0}, Prefetch(rate=1.0), lambda a, p, s: (a, p) in asked)
    assert prefetched(actions) == [("hot", "c")]


def test_the_budget_goes_to_the_hottest_adapters_first():
    pods = [pod("a"), pod("b")]
    adapters = [adapter("warm"), adapter("hot"), adapter("mild")]
    actions = popular_prefetches(adapters, pods, {"warm": 2.0, "hot": 8.0, "mild": 1.0}, Prefetch(1.0, per_pass=3),
                                 never)
    assert prefetched(actions) == [("hot", "a"), ("hot", "b"), ("warm", "a")]


def test_a_pod_whose_disk_tier_would_have_to_evict_or_that_has_none_is_never_asked():
    full = pod("a", used=9 * GB + 1, entries=3)  # 3 GB a copy on average, 1 GB free
    none = pod("b", capacity=0)
    roomy = pod("c", running=5, used=3 * GB, entries=3)
    assert (disk_has_room(full), disk_has_room(none), disk_has_room(roomy), disk_has_room(pod("d"))) == (
        False, False, True, True)
    assert prefetched(popular_prefetches([adapter("hot")], [full, none, roomy], {"hot": 5.0}, Prefetch(1.0),
                                         never)) == [("hot", "c")]


def test_the_fleet_rate_sums_the_pods_reports_of_registered_adapters():
    pods = [pod("a", demand=(("x", 0.5), ("gone", 9.0))), pod("b", demand=(("x", 0.75),))]
    assert demand_rates([adapter("x")], pods) == {"x": 1.25}


@pytest.mark.parametrize(("policy", "words"), [({"rate": -1.0}, "--prefetch-rate"),
                                               ({"rate": float("nan")}, "--prefetch-rate"),
                                               ({"per_pass": 0}, "--prefetch-per-pass")])
def test_a_bad_policy_is_refused_with_its_flag(policy, words):
    with pytest.raises(ConfigError, match=words):
        Prefetch(**policy)
