"""The routing score: residency first (device slot, CPU cache, free slot, eviction), weighed against load."""

from __future__ import annotations

import pytest
from lorafleet.v1 import adapter_admin_pb2 as admin_pb
from lorafleet.v1 import data_plane_admin_pb2 as pod_pb

from router.scoring import Decision, Weights, rank
from router.view import LoadTimes, PodView, Tier, build_view


def pod(pod_id: str, resident: dict[str, Tier] | None = None, used: int = 0, total: int = 4, running: int = 0,
        waiting: int = 0, kv: float = 0.0) -> PodView:
    return PodView(pod_id, f"{pod_id}:1", slots_total=total, slots_used=used, residency=resident or {},
                   running=running, waiting=waiting, kv_usage=kv)


def order(adapter: str, *pods: PodView, **kwargs) -> list[tuple[str, Decision]]:
    return [(c.pod.id, c.decision) for c in rank(adapter, pods, **kwargs)]


def test_residency_orders_idle_pods_device_then_cpu_then_free_slot_then_evict():
    pods = [pod("evict", used=4), pod("free"), pod("cpu", {"a": Tier.CPU}), pod("device", {"a": Tier.DEVICE})]
    assert order("a", *pods) == [("device", Decision.DEVICE_HIT), ("cpu", Decision.CPU_HIT),
                                 ("free", Decision.FREE_SLOT), ("evict", Decision.EVICT)]


def test_a_busy_device_hit_loses_to_an_idle_pod_that_must_load():
    busy = pod("busy", {"a": Tier.DEVICE}, running=12, waiting=2)
    assert order("a", busy, pod("idle"))[0] == ("idle", Decision.FREE_SLOT)
    assert order("a", pod("light", {"a": Tier.DEVICE}, running=2), pod("idle"))[0] == ("light", Decision.DEVICE_HIT)


def test_waiting_requests_and_kv_pressure_count_against_a_pod():
    assert order("", pod("a", running=2), pod("b", waiting=2))[0][0] == "a"
    assert order("", pod("a", running=1), pod("b", kv=0.9))[0][0] == "a"


def test_the_base_model_goes_to_the_least_loaded_pod_and_ties_go_by_pod_id():
    assert order("", pod("b"), pod("a")) == [("a", Decision.BASE), ("b", Decision.BASE)]
    assert order("", pod("a", running=1), pod("b"))[0][0] == "b"


def test_requests_the_router_started_since_the_state_was_read_count_as_running():
    assert order("", pod("a"), pod("b"), extra_running={"a": 2})[0][0] == "b"
    assert order("", pod("a", running=3), pod("b", running=1), extra_running={"a": -3})[0][0] == "a"


def test_a_pod_the_adapter_was_just_sent_to_counts_as_a_cpu_hit_so_a_cold_adapter_loads_once():
    assert order("a", pod("a-pod"), pod("b-pod"), just_sent_to={"b-pod"})[0] == ("b-pod", Decision.CPU_HIT)


def test_weights_must_not_be_negative():
    with pytest.raises(ValueError, match="must not be negative"):
        Weights(evict=-1)


def test_a_ready_pinned_placement_is_a_device_slot_even_before_the_pod_state_shows_it():
    adapters = [admin_pb.Adapter(name="a", placements=[admin_pb.Placement(pod="p1", state=admin_pb.READY,
                                                                          pinned=True)]),
                admin_pb.Adapter(name="b", placements=[admin_pb.Placement(pod="p1", state=admin_pb.LOADING,
                                                                          pinned=True)])]
    pods = [admin_pb.Pod(id="p1", endpoint="h:1", ready=True), admin_pb.Pod(id="p2", endpoint="h:2", ready=True),
            admin_pb.Pod(id="p3", endpoint="h:3", ready=False)]
    states = {"p1": pod_pb.PodState(slots=pod_pb.TierUsage(capacity=4, used=1),
                                    adapters=[pod_pb.AdapterResidency(name="c", tier=pod_pb.CPU)]),
              "p3": pod_pb.PodState()}
    view = build_view(adapters, pods, states, read_at=1.0)
    assert view.adapters == {"a", "b"}
    assert [p.id for p in view.pods] == ["p1"]  # p2's state was not read, p3 is not ready
    assert view.pods[0].residency == {"a": Tier.DEVICE, "c": Tier.CPU}
    assert view.pods[0].has_free_slot


KEY = 0x1234


def test_a_pod_holding_a_remote_adapter_on_its_disk_tier_wins_over_one_that_would_download_it():
    held, lacks = PodView("b", "b:1", slots_total=4, disk=frozenset({KEY})), PodView("a", "a:1", slots_total=4)
    ranked = rank("x", [lacks, held], remote_key=KEY)
    assert [(c.pod.id, c.download) for c in ranked] == [("b", False), ("a", True)]
    assert ranked[1].cost == 2 * ranked[0].cost  # unmeasured: a download costs at least a second read
    # a local source is read from disk anywhere: ties go by pod id, as before
    assert [c.pod.id for c in rank("x", [lacks, held])] == ["a", "b"]
    # resident adapters pay no download, whatever the disk tier holds
    warm = PodView("a", "a:1", slots_total=4, residency={"x": Tier.CPU})
    assert [(c.pod.id, c.decision, c.download) for c in rank("x", [warm, held], remote_key=KEY)][0] == \
        ("a", Decision.CPU_HIT, False)


def test_the_download_weighs_what_the_pod_measured_against_its_disk_reads():
    slow_net = PodView("a", "a:1", slots_total=4, load_times=LoadTimes(disk_to_host_s=0.4, remote_to_disk_s=4.0))
    fast_net = PodView("b", "b:1", slots_total=4, load_times=LoadTimes(disk_to_host_s=0.4, remote_to_disk_s=0.4))
    cold = Weights().cold(True)
    costs = {c.pod.id: c.cost for c in rank("x", [slow_net, fast_net], remote_key=KEY)}
    assert costs == pytest.approx({"a": cold * 11, "b": cold * 2})
    # ... so a busier pod with a fast download beats an idle one whose download is slow
    busy_fast = PodView("b", "b:1", slots_total=4, running=5, load_times=fast_net.load_times)
    assert rank("x", [slow_net, busy_fast], remote_key=KEY)[0].pod.id == "b"


def test_the_view_reads_each_pods_disk_tier_load_times_and_seats_and_which_adapters_are_remote():
    sha = "ab" * 32
    adapters = [admin_pb.Adapter(name="s3", source="s3://b/k", sha256=sha),
                admin_pb.Adapter(name="local", source="file:///a", sha256="cd" * 32)]
    state = pod_pb.PodState(slots=pod_pb.TierUsage(capacity=2), disk_digests=[int(sha[:16], 16)], max_num_seqs=32,
                            load_times=pod_pb.LoadTimes(host_to_slot_seconds=0.02, disk_to_host_seconds=0.3,
                                                        remote_to_disk_seconds=1.5))
    view = build_view(adapters, [admin_pb.Pod(id="p", endpoint="p:1", ready=True)], {"p": state}, 0.0)
    assert view.remote == {"s3": int(sha[:16], 16)}
    (p,) = view.pods
    assert not p.must_download(view.remote["s3"]) and p.must_download(0x99) and not p.must_download(None)
    assert p.load_times == LoadTimes(0.02, 0.3, 1.5) and p.load_times.download_factor() == pytest.approx(5.0)
    assert p.seats == 32 and not p.seats_taken(31) and p.seats_taken(32)


def test_a_pod_whose_every_slot_is_pinned_or_serving_makes_a_cpu_hit_wait_and_loses_to_one_with_room():
    saturated = PodView("a", "a:1", slots_total=2, slots_used=2, slots_busy=2, residency={"x": Tier.CPU})
    roomy = PodView("b", "b:1", slots_total=2, slots_used=2, slots_busy=1, residency={"x": Tier.CPU})
    ranked = rank("x", [saturated, roomy])
    assert [(c.pod.id, c.decision) for c in ranked] == [("b", Decision.CPU_HIT), ("a", Decision.CPU_HIT)]
    assert ranked[1].cost - ranked[0].cost == Weights().slot_wait
    # a device hit needs no slot: the busy slots are its own
    assert rank("x", [PodView("a", "a:1", slots_total=2, slots_used=2, slots_busy=2,
                              residency={"x": Tier.DEVICE})])[0].cost == 0.0


def test_a_cold_load_costs_in_proportion_to_the_adapters_rank_against_the_fleets_mean():
    adapters = [admin_pb.Adapter(name=name, rank=r) for name, r in (("r8", 8), ("r16", 16), ("r64", 64))]
    adapters.append(admin_pb.Adapter(name="held-nowhere"))  # rank 0: no pod holds it, so its rank is unknown
    view = build_view(adapters, [], {}, 0.0)
    assert view.ranks == {"r8": 8, "r16": 16, "r64": 64}
    mean = (8 + 16 + 64) / 3
    assert [view.size(a) for a in ("r8", "r16", "r64", "held-nowhere")] == [8 / mean, 16 / mean, 64 / mean, 1.0]
    w = Weights()
    # a pod running 20 requests that holds the adapter in host memory, beside an idle one with a free slot
    holder, idle = pod("holder", {"x": Tier.CPU}, running=20), pod("idle")
    assert order("x", holder, idle, size=1.0)[0] == ("idle", Decision.FREE_SLOT)  # 14 < 20.5
    assert order("x", holder, idle, size=2.0)[0] == ("holder", Decision.CPU_HIT)  # 28 > 21
    assert rank("x", [idle], size=2.0)[0].cost == 2 * w.free_slot and rank("x", [idle])[0].cost == w.free_slot
