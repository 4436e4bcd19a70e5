"""Virtual token counters: how much service each account has had.

Two words keep two things apart. A *flow* is what the scheduler queues by: an adapter, or the base
model (None); it decides slots and arrival order. An *account* is who is served: the request's tenant
(the customer or team the router bills, ``GenerateRequest.tenant``), or, for a request with no
tenant, its flow alone. Counters are kept per account, so a tenant's ten adapters share one share
instead of taking ten.

An account's counter grows by the tokens computed for it (prefill and decode) divided by the flow's
weight; a flow's priority is the lowest counter among the accounts that have requests in it, and the
scheduler admits from the backlogged flow with the lowest. An account that becomes active (its first
request queued or running) starts no lower than the floor, the lowest counter among active accounts,
so time spent idle earns no credit and a returning account cannot crowd out those that kept working.
In the spirit of VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

Flow = str | None  # an adapter's name; None for the base model
Account = tuple[str, Flow]  # ("tenant", name) or ("flow", the flow of a request without a tenant)


def account_of(flow: Flow, tenant: str | None) -> Account:
    """Who a request of ``flow`` for ``tenant`` (None or "": no tenant) is served as."""
    return ("tenant", tenant) if tenant else ("flow", flow)


class FairShare:
    def __init__(self, weights: Mapping[Flow, float] | None = None) -> None:
        self._weights = dict(weights or {})
        bad = {t: w for t, w in self._weights.items() if not w > 0}
        if bad:
            raise ValueError(f"fair-share weights must be positive, got {bad}")
        self._served: dict[Account, float] = {}
        self._requests: Counter[Account] = Counter()  # queued or running, per active account
        self._in_flow: dict[Flow, Counter[Account]] = {}  # each active flow's requests by account
        self._floor = 0.0  # never decreases: counters only grow and joiners start at it

    def served(self, flow: Flow) -> float:
        """The flow's priority: the lowest counter among the accounts with requests in it (the floor if none)."""
        accounts = self._in_flow.get(flow)
        if not accounts:
            return self._served.get(account_of(flow, None), self._floor)
        return min(self.account_served(a) for a in accounts)

    def standing(self, flow: Flow) -> float:
        """The flow's priority as it would stand now: ``served`` for a flow with requests; for one without,
        the counter its next request would join at (no lower than the lowest among active accounts)."""
        if self._in_flow.get(flow):
            return self.served(flow)
        floor = min((self._served[a] for a in self._requests), default=self._floor)
        return max(self._served.get(account_of(flow, None), 0.0), floor, self._floor)

    def account_served(self, account: Account) -> float:
        """The account's counter (the floor for one with no requests)."""
        return self._served.get(account, self._floor)

    def active(self, flow: Flow, tenant: str | None = None) -> bool:
        """Whether the account of ``flow`` for ``tenant`` has requests queued or running."""
        return self._requests[account_of(flow, tenant)] > 0

    def weight(self, flow: Flow) -> float:
        return self._weights.get(flow, 1.0)

    def join(self, flow: Flow, tenant: str | None = None) -> None:
        """One more request of ``flow`` for ``tenant`` is queued or running."""
        account = account_of(flow, tenant)
        if not self._requests[account]:
            self._advance_floor()
            self._served[account] = max(self._served.get(account, 0.0), self._floor)
        self._requests[account] += 1
        self._in_flow.setdefault(flow, Counter())[account] += 1

    def leave(self, flow: Flow, tenant: str | None = None) -> None:
        """One request of ``flow`` for ``tenant`` has ended."""
        account = account_of(flow, tenant)
        self._advance_floor()  # while the account still counts: the last one to leave sets the floor
        in_flow = self._in_flow.get(flow, Counter())
        in_flow[account] -= 1
        if in_flow[account] <= 0:
            del in_flow[account]
            if not in_flow:
                self._in_flow.pop(flow, None)
        self._requests[account] -= 1
        if self._requests[account] <= 0:
            del self._requests[account]
            # an idle account at or below the floor would rejoin at the floor anyway: forget it
            self._served = {a: c for a, c in self._served.items() if a in self._requests or c > self._floor}

    def charge(self, flow: Flow, tokens: int, tenant: str | None = None) -> None:
        account = account_of(flow, tenant)
        self._served[account] = self._served.get(account, self._floor) + tokens / self.weight(flow)

    def _advance_floor(self) -> None:
        if self._requests:
            self._floor = max(self._floor, min(self._served[a] for a in self._requests))
