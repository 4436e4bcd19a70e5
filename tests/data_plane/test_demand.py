"""The pod's per-adapter request rates: decayed over a window, bounded in memory, reported top first."""

from __future__ import annotations

import math

import pytest

from data_plane.demand import DemandMeter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_steady_stream_reads_its_rate_and_a_burst_fades_with_the_window():
    clock = Clock()
    meter = DemandMeter(window_s=10.0, clock=clock)
    for _ in range(600):  # 4 requests a second for 150 s: fifteen windows, long past the warm-up
        meter.record("steady")
        clock.now += 0.25
    assert meter.rates()["steady"] == pytest.approx(4.0, rel=0.15)
    before = meter.rates()["steady"]
    clock.now += 10.0  # one window of silence
    assert meter.rates()["steady"] == pytest.approx(before / math.e)


def test_the_report_lists_the_busiest_first_and_sums_the_rest():
    clock = Clock()
    meter = DemandMeter(window_s=10.0, clock=clock)
    for name, count in (("a", 5), ("b", 9), ("c", 1), ("d", 2)):
        for _ in range(count):
            meter.record(name)
    report = meter.report(top=2)
    assert report.window_s == 10.0
    assert [a for a, _ in report.top] == ["b", "a"]
    assert report.top[0][1] == pytest.approx(0.9)
    assert report.other_rate == pytest.approx(0.3)
    assert report.tracked == 4


def test_memory_is_bounded_and_the_busiest_adapters_are_kept():
    clock = Clock()
    meter = DemandMeter(window_s=10.0, max_tracked=100, clock=clock)
    for _ in range(3):
        meter.record("hot")
    for i in range(1000):  # a scan over a thousand adapters, once each
        meter.record(f"cold-{i}")
    assert len(meter.rates()) <= 100
    assert meter.report(top=1).top[0][0] == "hot"


def test_adapters_quiet_for_many_windows_are_forgotten():
    clock = Clock()
    meter = DemandMeter(window_s=1.0, clock=clock)
    meter.record("once")
    clock.now += 20.0  # e^-20 of a request per second
    assert meter.report(top=5).tracked == 0
    assert meter.rates() == {}


@pytest.mark.parametrize("window", [0.0, -1.0, float("inf"), float("nan")])
def test_a_window_that_is_not_a_positive_number_is_refused(window):
    with pytest.raises(ValueError, match="positive number of seconds"):
        DemandMeter(window)
