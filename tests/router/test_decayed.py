"""Counts that fade with time (router/decayed.py): a count is a rate times the time constant, and faded keys
are forgotten as the map grows."""

from __future__ import annotations

import math

import pytest

from router.decayed import DecayedCounts


def test_an_event_counts_one_and_fades_by_e_every_time_constant():
    counts = DecayedCounts(30.0)
    assert counts.get("p", 0.0) == 0.0
    counts.add("p", 10.0)
    counts.add("p", 10.0)
    assert counts.get("p", 10.0) == 2.0
    assert counts.get("p", 40.0) == pytest.approx(2 / math.e)
    counts.add("p", 40.0)
    assert counts.get("p", 70.0) == pytest.approx((2 / math.e + 1) / math.e)
    assert counts.get("q", 70.0) == 0.0


def test_a_steady_rate_counts_the_rate_times_the_time_constant():
    counts = DecayedCounts(30.0)
    for i in range(3000):  # two a second for 1,500 s
        counts.add("p", i * 0.5)
    assert counts.get("p", 1499.5) == pytest.approx(2 * 30.0, rel=0.01)


def test_faded_keys_are_forgotten_as_the_map_grows_and_live_ones_kept():
    counts = DecayedCounts(1.0)
    for i in range(10_000):  # a new key every 10 ms: a key fades under 1e-3 after about 7 s
        counts.add(f"k{i}", i * 0.01)
    assert len(counts) < 5000
    assert counts.get("k9999", 99.99) == 1.0 and counts.get("k9000", 99.99) == pytest.approx(math.exp(-9.99))
    assert counts.get("k0", 99.99) == 0.0


@pytest.mark.parametrize("tau", [0.0, -1.0, float("nan")])
def test_a_time_constant_that_is_not_positive_is_refused(tau):
    with pytest.raises(ValueError, match="time constant must be positive"):
        DecayedCounts(tau)
