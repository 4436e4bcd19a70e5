"""Counts that fade with time: what share of its requests the router sent each pod, and each adapter, lately.

An event counts 1 when it happens and ``exp(-age / tau_s)`` after, so a count is a rate times ``tau_s`` once the
rate holds for a few ``tau_s``: a pod sent one request a second for a minute counts about 30 at ``tau_s`` = 30.
Keys that faded to almost nothing are forgotten now and then, so that the map holds about the keys of the last
few ``tau_s``, however many keys were ever counted.
"""

from __future__ import annotations

import math

# A count under this is forgotten (an event about 7 tau old): it would not move a comparison with a live count.
_FADED = 1e-3
# The map is swept for faded keys when it grows past this (and past twice what the last sweep kept).
_SWEEP_AT = 4096


class DecayedCounts:
    """Per-key counts decayed with time constant ``tau_s`` (seconds, > 0), read at times that never go back."""

    def __init__(self, tau_s: float) -> None:
        if not tau_s > 0:
            raise ValueError(f"the decay's time constant must be positive seconds, got {tau_s}")
        self._tau_s = tau_s
        self._counts: dict[str, tuple[float, float]] = {}  # key -> (count at its time, that time)
        self._sweep_at = _SWEEP_AT

    def __len__(self) -> int:
        return len(self._counts)

    def add(self, key: str, now: float) -> None:
        """One event of ``key`` at ``now``."""
        self._counts[key] = (self.get(key, now) + 1.0, now)
        if len(self._counts) > self._sweep_at:
            self._counts = {k: (count, at) for k, (count, at) in self._counts.items()
                            if self._faded(count, now - at) >= _FADED}
            self._sweep_at = max(_SWEEP_AT, 2 * len(self._counts))

    def get(self, key: str, now: float) -> float:
        """``key``'s count at ``now``: 0 for a key never counted (or forgotten)."""
        count, at = self._counts.get(key, (0.0, now))
        return self._faded(count, now - at)

    def _faded(self, count: float, age_s: float) -> float:
        return count * math.exp(-max(0.0, age_s) / self._tau_s)
