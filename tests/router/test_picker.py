"""The pod picker: the latest view plus what this router did since it was read."""

from __future__ import annotations

import pytest

from router.errors import AdapterNotRegistered, NoPodAvailable
from router.picker import PodPicker
from router.scoring import Decision
from router.view import FleetView, PodView


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
