"""Request traces: arrival times (Poisson or bursty), adapters by Zipf popularity, optional drift of the
hot set, each adapter's rank, and each request's decode length. Seeded and made up front, so every policy sees
the same trace."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class Arrivals(enum.Enum):
    POISSON = "poisson"
    # On/off modulated Poisson: exponentially long bursts at ``burst_factor`` times the mean rate,
    # between quiet spells at the rate that keeps the mean.
    BURSTY = "bursty"


@dataclass(frozen=True)
class TraceConfig:
    """``rate`` is the mean over the whole trace, requests per second. Drift: every ``drift_period_s`` the
    ``drift_step`` hottest adapters turn coldest and every other one moves ``drift_step`` ranks up, so the
    hot set rotates (0 = no drift). Each adapter's rank is drawn uniformly from ``ranks``, independently of its
    popularity."""

    adapters: int = 10_000
    rate: float = 400.0
    duration_s: float = 120.0
    alpha: float = 1.0
    arrivals: Arrivals = Arrivals.POISSON
    drift_period_s: float = 0.0
    drift_step: int = 250
    min_tokens: int = 64
    max_tokens: int = 448
    burst_factor: float = 3.0
    burst_mean_s: float = 2.0
    quiet_mean_s: float = 6.0
    ranks: tuple[int, ...] = (16,)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.adapters < 1 or self.rate <= 0 or self.duration_s <= 0 or self.alpha < 0:
            raise ValueError(f"need adapters >= 1, rate > 0, duration_s > 0, alpha >= 0: {self}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens: {self}")
        if not self.ranks or min(self.ranks) < 1:
            raise ValueError(f"need at least one rank, each >= 1: {self}")
        if self.drift_period_s < 0 or self.drift_step < 0:
            raise ValueError(f"drift must not be negative: {self}")
        if self.arrivals is Arrivals.BURSTY and self._quiet_factor() < 0:
            raise ValueError(f"bursts of {self.burst_factor}x for {self.burst_mean_s} s in every "
                             f"{self.burst_mean_s + self.quiet_mean_s} s exceed the mean rate; lower burst_factor")

    def _quiet_factor(self) -> float:
        high = self.burst_mean_s / (self.burst_mean_s + self.quiet_mean_s)
        return (1.0 - high * self.burst_factor) / (1.0 - high)


@dataclass(frozen=True)
class Trace:
    config: TraceConfig
    times: np.ndarray  # [n] float64 seconds, non-decreasing
    adapters: np.ndarray  # [n] int64 index into names
    tokens: np.ndarray  # [n] int64 decode steps each request takes
    names: tuple[str, ...]  # [adapters]
    ranks: np.ndarray  # [adapters] int64 each adapter's rank

    def __len__(self) -> int:
        return len(self.times)


def adapter_names(count: int) -> tuple[str, ...]:
    return tuple(f"a{i:05d}" for i in range(count))


def make_trace(config: TraceConfig) -> Trace:
    rng = np.random.default_rng(config.seed)
    times = _arrival_times(config, rng)
    n = len(times)
    weights = 1.0 / np.arange(1, config.adapters + 1, dtype=np.float64) ** config.alpha
    cdf = np.cumsum(weights / weights.sum())
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), config.adapters - 1)
    if config.drift_period_s > 0:
        shift = (times // config.drift_period_s).astype(np.int64) * config.drift_step
        ranks = (ranks + shift) % config.adapters
    which = rng.permutation(config.adapters)[ranks]  # popularity rank -> adapter, so names carry no rank
    tokens = rng.integers(config.min_tokens, config.max_tokens + 1, size=n)
    # drawn from a generator of their own, so that a rank mix leaves the arrivals and adapters as they are
    ranks = np.random.default_rng([config.seed, 1]).choice(np.array(config.ranks, dtype=np.int64), config.adapters)
    return Trace(config, times, which.astype(np.int64), tokens.astype(np.int64), adapter_names(config.adapters),
                 ranks)


def _arrival_times(config: TraceConfig, rng: np.random.Generator) -> np.ndarray:
    if config.arrivals is Arrivals.POISSON:
        return _poisson(rng, 0.0, config.duration_s, config.rate)
    parts, start, burst = [], 0.0, False
    while start < config.duration_s:
        length = rng.exponential(config.burst_mean_s if burst else config.quiet_mean_s)
        end = min(config.duration_s, start + length)
        factor = config.burst_factor if burst else config._quiet_factor()
        if factor > 0:
            parts.append(_poisson(rng, start, end, config.rate * factor))
        start, burst = end, not burst
    return np.concatenate(parts) if parts else np.zeros(0)


def _poisson(rng: np.random.Generator, start: float, end: float, rate: float) -> np.ndarray:
    count = rng.poisson(rate * (end - start))
    return np.sort(rng.uniform(start, end, size=count))
