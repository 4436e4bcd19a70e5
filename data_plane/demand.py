"""How often this pod is asked for each adapter: exponentially decayed request rates, in bounded memory.

A request counts with weight ``exp(-age / window_s) / window_s``, so a steady stream of λ requests per
second reads λ, a burst fades with time constant ``window_s``, and nothing needs a timer: each entry
keeps its rate as of its last request and decays it when read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class DemandReport:
    """The busiest adapters (highest rate first), the rest summed, and how many adapters are tracked."""

    window_s: float
    top: tuple[tuple[str, float], ...]
    other_rate: float
    tracked: int


class DemandMeter:
    """Per-adapter request rates over ``window_s``. At most ``max_tracked`` adapters are kept: past that,
    the quietest quarter is forgotten (a pod that has seen thousands of adapters keeps the ones in use)."""

    def __init__(self, window_s: float, max_tracked: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < window_s < math.inf:
            raise ValueError(f"the demand window must be a positive number of seconds, got {window_s}")
        if max_tracked < 1:
            raise ValueError(f"max_tracked must be at least 1, got {max_tracked}")
        self.window_s = window_s
        self._max = max_tracked
        self._clock = clock
        self._entries: dict[str, tuple[float, float]] = {}  # adapter -> (rate at its last request, that time)

    def record(self, adapter: str) -> None:
        """Counts one request for ``adapter``."""
        now = self._clock()
        self._entries[adapter] = (self._decayed(adapter, now) + 1.0 / self.window_s, now)
        if len(self._entries) > self._max:
            rates = self.rates()
            keep = sorted(rates, key=lambda a: (-rates[a], a))[: self._max * 3 // 4]
            self._entries = {a: self._entries[a] for a in keep}

    def rates(self) -> dict[str, float]:
        """Every tracked adapter's rate now, in requests per second."""
        now = self._clock()
        return {a: self._decayed(a, now) for a in self._entries}

    def report(self, top: int) -> DemandReport:
        """The ``top`` busiest adapters and the others' summed rate. Adapters whose rate has decayed to
        under one request per thousand windows are forgotten here."""
        rates = {a: r for a, r in self.rates().items() if r * self.window_s >= 1e-3}
        self._entries = {a: self._entries[a] for a in rates}
        ranked = sorted(rates.items(), key=lambda item: (-item[1], item[0]))
        return DemandReport(self.window_s, tuple(ranked[:top]), sum(r for _, r in ranked[top:]), len(ranked))

    def _decayed(self, adapter: str, now: float) -> float:
        rate, at = self._entries.get(adapter, (0.0, now))
        return rate * math.exp(-(now - at) / self.window_s)
