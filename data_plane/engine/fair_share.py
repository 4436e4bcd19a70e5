"""Virtual token counters: how much service each tenant (an adapter, or the base model) has had.

A tenant's counter grows by the tokens computed for it (prefill and decode) divided by its
weight; the scheduler admits from the backlogged tenant with the lowest counter. A tenant that
becomes active (its first request queued or running) starts no lower than the floor, the lowest
counter among active tenants, so time spent idle earns no credit and a returning tenant cannot
crowd out those that kept working. In the spirit of VTC (Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

Tenant = str | None  # an adapter's name; None for the base model


class FairShare:
    def __init__(self, weights: Mapping[Tenant, float] | None = None) -> None:
        self._weights = dict(weights or {})
        bad = {t: w for t, w in self._weights.items() if not w > 0}
        if bad:
            raise ValueError(f"fair-share weights must be positive, got {bad}")
        self._served: dict[Tenant, float] = {}
        self._requests: Counter[Tenant] = Counter()  # queued or running, per active tenant
        self._floor = 0.0  # never decreases: counters only grow and joiners start at it

    def served(self, tenant: Tenant) -> float:
        """The tenant's counter: weighted tokens computed for it since it joined, floor included."""
        return self._served.get(tenant, self._floor)

    def weight(self, tenant: Tenant) -> float:
        return self._weights.get(tenant, 1.0)

    def join(self, tenant: Tenant) -> None:
        """One more request of ``tenant`` is queued or running."""
        if not self._requests[tenant]:
            self._advance_floor()
            self._served[tenant] = max(self._served.get(tenant, 0.0), self._floor)
        self._requests[tenant] += 1

    def leave(self, tenant: Tenant) -> None:
        """One request of ``tenant`` has ended."""
        self._advance_floor()  # while the tenant still counts: the last one to leave sets the floor
        self._requests[tenant] -= 1
        if self._requests[tenant] <= 0:
            del self._requests[tenant]
            # an idle tenant at or below the floor would rejoin at the floor anyway: forget it
            self._served = {t: c for t, c in self._served.items() if t in self._requests or c > self._floor}

    def charge(self, tenant: Tenant, tokens: int) -> None:
        self._served[tenant] = self.served(tenant) + tokens / self.weight(tenant)

    def _advance_floor(self) -> None:
        if self._requests:
            self._floor = max(self._floor, min(self._served[t] for t in self._requests))
