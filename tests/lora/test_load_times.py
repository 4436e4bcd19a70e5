"""A pod's load times per tier: decayed averages of its own loads, 0 until measured."""

from __future__ import annotations

import math

import pytest

from data_plane.lora.load_times import DECAY, LoadTimes, LoadTimesNow


def test_each_move_starts_at_its_first_measurement_then_decays_toward_new_ones():
    times = LoadTimes()
    assert times.now() == LoadTimesNow()
    times.disk_to_host(0.5)
    times.disk_to_host(1.5)
    assert times.now().disk_to_host_s == pytest.approx(0.5 * (1 - DECAY) + 1.5 * DECAY)
    assert times.now().host_to_slot_s == 0.0  # the other moves are untouched


def test_a_download_records_its_time_and_rate_and_nonsense_is_not_recorded():
    times = LoadTimes()
    times.remote_to_disk(2.0, 50_000_000)
    assert (times.now().remote_to_disk_s, times.now().remote_mb_per_s) == (2.0, 25.0)
    for bad in (math.nan, -1.0):
        times.host_to_slot(bad)
    times.remote_to_disk(0.0, 10)  # no time: no rate
    assert times.now().host_to_slot_s == 0.0 and times.now().remote_mb_per_s == 25.0
