"""Traces: Zipf popularity, a rotating hot set, bursts around the same mean rate, and clear errors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from fleetsim.trace import Arrivals, TraceConfig, make_trace


def top(adapters: np.ndarray, k: int) -> set[int]:
    return {a for a, _ in Counter(adapters.tolist()).most_common(k)}


def test_a_higher_alpha_concentrates_traffic_on_fewer_adapters():
    shares = []
    for alpha in (0.8, 1.0, 1.2):
        t = make_trace(TraceConfig(adapters=1000, rate=2000, duration_s=10, alpha=alpha))
        shares.append(sum(n for _, n in Counter(t.adapters.tolist()).most_common(10)) / len(t))
    assert shares[0] < shares[1] < shares[2]
    assert 0.35 < shares[1] < 0.45  # Zipf 1.0 over 1,000: the top 10 take H(10) / H(1000) = 39%


def test_drift_rotates_the_hot_set_and_without_drift_it_stays():
    cfg = dict(adapters=1000, rate=2000, duration_s=20, alpha=1.2, seed=3)
    drifting = make_trace(TraceConfig(**cfg, drift_period_s=10, drift_step=50))
    still = make_trace(TraceConfig(**cfg))
    for t, overlap in ((drifting, lambda n: n == 0), (still, lambda n: n >= 8)):
        first, second = t.adapters[t.times < 10], t.adapters[t.times >= 10]
        assert overlap(len(top(first, 10) & top(second, 10)))


def test_bursty_arrivals_keep_the_mean_rate_and_vary_more_than_poisson():
    counts = {}
    for arrivals in Arrivals:
        t = make_trace(TraceConfig(adapters=10, rate=200, duration_s=200, arrivals=arrivals, seed=5))
        assert abs(len(t) / 200 - 200) < 30
        assert np.all(np.diff(t.times) >= 0)
        counts[arrivals] = np.bincount(t.times.astype(int), minlength=200)
    assert counts[Arrivals.BURSTY].std() > 3 * counts[Arrivals.POISSON].std()


def test_request_lengths_stay_in_bounds():
    t = make_trace(TraceConfig(adapters=10, rate=100, duration_s=10, min_tokens=5, max_tokens=9))
    assert t.tokens.min() >= 5 and t.tokens.max() <= 9


@pytest.mark.parametrize("bad, match", [
    (dict(rate=0), "rate > 0"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens <= max_tokens"),
    (dict(drift_step=-1), "drift must not be negative"),
    (dict(ranks=()), "at least one rank"),
    (dict(arrivals=Arrivals.BURSTY, burst_factor=5.0), "exceed the mean rate"),
])
def test_a_bad_trace_config_is_refused_with_the_reason(bad, match):
    with pytest.raises(ValueError, match=match):
        TraceConfig(**bad)


def test_a_rank_mix_draws_each_adapters_rank_from_the_mix_and_leaves_the_requests_as_they_were():
    cfg = dict(adapters=500, rate=200, duration_s=5, seed=4)
    plain, mixed = make_trace(TraceConfig(**cfg)), make_trace(TraceConfig(**cfg, ranks=(8, 16, 32, 64, 128)))
    assert set(plain.ranks.tolist()) == {16}
    assert set(mixed.ranks.tolist()) == {8, 16, 32, 64, 128} and len(mixed.ranks) == 500
    assert np.array_equal(plain.adapters, mixed.adapters) and np.array_equal(plain.times, mixed.times)
