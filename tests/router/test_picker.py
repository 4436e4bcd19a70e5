"""The pod picker: the latest view plus what this router did since it was read."""

from __future__ import annotations

import dataclasses

import pytest

from router.config import RouterConfig
from router.errors import AdapterNotRegistered, NoPodAvailable
from router.forwarder import same_precision
from router.picker import PodPicker
from router.scoring import LOAD_BOUND, Choice, Decision, bounded
from router.view import FleetView, PodView, Tier


class Views:
    """A view source the test replaces, as the refresher does."""

    def __init__(self) -> None:
        self.view: FleetView | None = None

    def read(self, *pod_ids: str, at: float) -> None:
        self.view = FleetView(frozenset({"a"}), tuple(PodView(p, f"{p}:1", slots_total=2) for p in pod_ids), at)


def test_before_the_first_read_and_with_no_pod_the_caller_is_told_why():
    views = Views()
    picker = PodPicker(lambda: views.view)
    with pytest.raises(NoPodAvailable, match="has not read the fleet's state yet"):
        picker.choose("")
    views.read(at=1.0)
    with pytest.raises(NoPodAvailable, match="no data-plane pod is ready"):
        picker.choose("")
    views.read("p1", at=2.0)
    with pytest.raises(AdapterNotRegistered, match="'zzz' is not registered; register it"):
        picker.choose("zzz")


def test_a_pod_without_adapter_slots_serves_only_the_base_model():
    views = Views()
    views.view = FleetView(frozenset({"a"}), (PodView("base-only", "b:1", slots_total=0),
                                              PodView("lora", "l:1", slots_total=2, running=5)), 1.0)
    picker = PodPicker(lambda: views.view)
    assert [c.pod.id for c in picker.choose("a")] == ["lora"]  # however busy the other
    assert {c.pod.id for c in picker.choose("")} == {"base-only", "lora"}
    views.view = FleetView(frozenset({"a"}), (PodView("base-only", "b:1", slots_total=0),), 2.0)
    with pytest.raises(NoPodAvailable, match="--no-enable-lora"):
        picker.choose("a")


def test_requests_in_flight_since_the_read_spread_the_base_model_over_pods():
    views = Views()
    views.read("p1", "p2", at=1.0)
    picker = PodPicker(lambda: views.view)
    first = picker.choose("")[0].pod.id
    picker.started(first, "")
    assert picker.choose("")[0].pod.id != first
    picker.finished(first)
    assert picker.choose("")[0].pod.id == first


def test_a_refused_pod_is_left_out_until_a_view_read_after_the_refusal():
    views = Views()
    views.read("p1", "p2", at=0.0)
    picker = PodPicker(lambda: views.view)
    picker.refused("p1")
    assert [c.pod.id for c in picker.choose("")] == ["p2"]
    views.read("p1", "p2", at=float("inf"))  # read after the refusal, and p1 answered
    assert [c.pod.id for c in picker.choose("")] == ["p1", "p2"]


def test_the_pod_a_cold_adapter_was_just_sent_to_keeps_its_next_requests():
    views = Views()
    views.read("p1", "p2", at=1.0)
    picker = PodPicker(lambda: views.view)
    first = picker.choose("a")[0]
    assert first.decision == Decision.FREE_SLOT
    picker.started(first.pod.id, "a")
    again = picker.choose("a")[0]
    assert (again.pod.id, again.decision) == (first.pod.id, Decision.CPU_HIT)


def test_a_just_sent_adapter_stops_counting_as_resident_after_five_seconds_of_the_pickers_clock():
    views = Views()
    views.read("p1", "p2", at=1.0)
    now = [100.0]
    picker = PodPicker(lambda: views.view, clock=lambda: now[0])
    first = picker.choose("a")[0].pod.id
    picker.started(first, "a")
    picker.finished(first)
    now[0] += 4.9
    assert (picker.choose("a")[0].pod.id, picker.choose("a")[0].decision) == (first, Decision.CPU_HIT)
    now[0] += 0.2
    assert {c.decision for c in picker.choose("a")} == {Decision.FREE_SLOT}


def test_the_record_of_adapters_just_sent_forgets_expired_entries_as_it_grows():
    views = Views()
    views.read("p1", at=1.0)
    now = [0.0]
    picker = PodPicker(lambda: views.view, clock=lambda: now[0])
    for i in range(5000):
        now[0] = i * 0.01  # 5 s holds 500 entries
        picker.started("p1", f"a{i}")
        picker.finished("p1")
    assert picker._sent_count <= 4096
    assert picker._sent_count == sum(map(len, picker._sent.values()))
    assert "a4999" in picker._sent and "a0" not in picker._sent


def test_a_hot_adapters_requests_spill_to_the_next_best_pod_past_the_load_bound():
    hot = PodView("hot", "h:1", slots_total=4, slots_used=1, residency={"a": Tier.DEVICE}, running=6)
    idle = [PodView(p, f"{p}:1", slots_total=4, running=1) for p in ("p1", "p2")]
    view = FleetView(frozenset({"a"}), (hot, *idle), 1.0)
    unbounded = PodPicker(lambda: view, load_bound=0)
    assert [c.pod.id for c in unbounded.choose("a")] == ["hot", "p1", "p2"]  # its device hit outweighs 6 running
    # 8 outstanding over 3 pods: each may hold ceil(1.2 * 9 / 3) = 4 with this request; hot holds 6
    ranked = PodPicker(lambda: view, load_bound=0.2).choose("a")
    assert [(c.pod.id, c.decision) for c in ranked] == [("p1", Decision.FREE_SLOT), ("p2", Decision.FREE_SLOT),
                                                        ("hot", Decision.DEVICE_HIT)]
    # within the bound the cost decides as before: a device hit beside pods as loaded
    cool = PodView("hot", "h:1", slots_total=4, slots_used=1, residency={"a": Tier.DEVICE}, running=1)
    view = FleetView(frozenset({"a"}), (cool, *idle), 2.0)  # ceil(1.2 * 4 / 3) = 2 each
    assert PodPicker(lambda: view, load_bound=0.2).choose("a")[0].pod.id == "hot"


def test_requests_the_router_started_since_its_read_count_toward_the_bound():
    view = FleetView(frozenset({"a"}), tuple(PodView(p, f"{p}:1", slots_total=4, running=4) for p in ("p1", "p2")),
                     1.0)
    bounded_picker, cost_only = PodPicker(lambda: view, load_bound=0.2), PodPicker(lambda: view, load_bound=0)
    for _ in range(4):  # the adapter just sent to p1 is a CPU hit there: 0.5 + its load, against 14 + 4 on p2
        assert bounded_picker.choose("a")[0].pod.id == cost_only.choose("a")[0].pod.id == "p1"
        for picker in (bounded_picker, cost_only):
            picker.started("p1", "a")
    # p1 holds 8 of 12 outstanding; each pod may hold ceil(1.2 * 13 / 2) = 8 with this request: p1 is past it
    assert cost_only.choose("a")[0].pod.id == "p1"
    assert [(c.pod.id, c.decision) for c in bounded_picker.choose("a")] == [("p2", Decision.FREE_SLOT),
                                                                           ("p1", Decision.CPU_HIT)]
    bounded_picker.finished("p1")
    assert bounded_picker.choose("a")[0].pod.id == "p1"  # 7 of 11: ceil(1.2 * 12 / 2) = 8, within again


def test_the_bound_never_sends_an_adapter_request_to_a_pod_without_slots_nor_counts_those_pods():
    idle_base = tuple(PodView(f"base-{i}", f"b{i}:1", slots_total=0) for i in range(8))
    lora = (PodView("l1", "l1:1", slots_total=2, residency={"a": Tier.DEVICE}, running=5),
            PodView("l2", "l2:1", slots_total=2, residency={"a": Tier.DEVICE}, running=4))
    view = FleetView(frozenset({"a"}), (*idle_base, *lora), 1.0)
    # over the two LoRA pods the mean is 4.5 (ceil(1.2 * 10 / 2) = 6): neither is past it, and the idle base-only
    # pods, which would have pulled the mean under 1, are not weighed at all
    assert [c.pod.id for c in PodPicker(lambda: view, load_bound=0.2).choose("a")] == ["l2", "l1"]


def test_the_bound_keeps_the_best_pods_precision():
    def pod(pod_id: str, precision: str, running: int, resident: bool = False) -> PodView:
        return PodView(pod_id, f"{pod_id}:1", slots_total=4, residency={"a": Tier.DEVICE} if resident else {},
                       running=running, precision=precision)

    picker_of = lambda *pods: PodPicker(lambda: FleetView(frozenset({"a"}), pods, 1.0), load_bound=0.2)  # noqa: E731
    # the only bfloat16 pod is the mean of its precision: never past the bound, however idle the others
    alone = picker_of(pod("bf16", "bfloat16", 8, True), pod("f32-a", "float32", 0), pod("f32-b", "float32", 0))
    ranked = alone.choose("a")
    assert ranked[0].pod.id == "bf16"
    assert [c.pod.id for c in same_precision(ranked)] == ["bf16"]
    # past the bound among bfloat16 pods, the request spills to another bfloat16 pod, not to the idle float32 one
    two = picker_of(pod("bf16-hot", "bfloat16", 8, True), pod("bf16-b", "bfloat16", 1),
                    pod("f32", "float32", 0))
    assert [c.pod.id for c in two.choose("a")] == ["bf16-b", "f32", "bf16-hot"]  # f32 ranked second: it stays there
    assert [c.pod.id for c in same_precision(two.choose("a"))] == ["bf16-b", "bf16-hot"]


def test_the_bound_at_the_shipped_default_is_a_fifth_above_the_mean_counting_the_new_request():
    assert LOAD_BOUND == RouterConfig.load_bound == 0.2
    loads = (9, 6, 5, 4, 4, 4, 4, 4, 4, 1)  # cheapest first; 45 outstanding: ceil(1.2 * 46 / 10) = 6 each
    ranked = [Choice(PodView(f"p{i}", f"p{i}:1"), Decision.BASE, float(i), outstanding=n) for i, n in enumerate(loads)]
    assert [c.pod.id for c in bounded(ranked, LOAD_BOUND)] == [f"p{i}" for i in (2, 3, 4, 5, 6, 7, 8, 9, 0, 1)]
    assert bounded(ranked, 0) == ranked  # 0: no bound


def test_on_a_lightly_loaded_fleet_a_pod_under_four_requests_keeps_its_adapters_requests():
    holder = PodView("holder", "h:1", slots_total=4, residency={"a": Tier.DEVICE}, running=2, waiting=1)
    idle = tuple(PodView(f"idle-{i}", f"i{i}:1", slots_total=4) for i in range(9))
    view = FleetView(frozenset({"a"}), (holder, *idle), 1.0)
    # 3 outstanding over 10 pods: ceil(1.2 * 4 / 10) = 1, raised to the floor of 4, which the holder is under
    assert PodPicker(lambda: view, load_bound=0.2).choose("a")[0].pod.id == "holder"
    at_floor = dataclasses.replace(holder, waiting=2)
    view = FleetView(frozenset({"a"}), (at_floor, *idle), 2.0)
    assert PodPicker(lambda: view, load_bound=0.2).choose("a")[0].pod.id == "idle-0"
