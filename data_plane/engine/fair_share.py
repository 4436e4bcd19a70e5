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
less a fixed credit (``join_credit`` tokens, divided by the flow's weight), so time spent idle earns
no more than that credit and a returning account cannot crowd out those that kept working for longer
than it lasts. The scheduler gives one quantum (``fair_order.STARTED_QUANTUM``): a started prompt keeps
its standing for a quantum, so without the credit a tenant sending a request now and then would join
level with a flood's counter and wait behind each of its started prompts; with it, that tenant's
requests go first for as long as it stays that far behind. In the spirit of VTC (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024), whose joiners start at the floor.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping

Flow = str | None  # an adapter's name; None for the base model
Account = tuple[str, Flow]  # ("tenant", name) or ("flow", the flow of a request without a tenant)


def account_of(flow: Flow, tenant: str | None) -> Account:
    """Who a request of ``flow`` for ``tenant`` (None or "": no tenant) is served as."""
    return ("tenant", tenant) if tenant else ("flow", flow)


class FairShare:
    def __init__(self, weights: Mapping[Flow, float] | None = None, join_credit: float = 0.0) -> None:
        """``weights``: a flow's share relative to the others (default 1.0); ``join_credit``: the tokens an
        account that becomes active starts below the floor (at its flow's weight)."""
        self._weights = dict(weights or {})
        bad = {t: w for t, w in self._weights.items() if not w > 0}
        if bad:
            raise ValueError(f"fair-share weights must be positive, got {bad}")
        if not 0 <= join_credit < math.inf:
            raise ValueError(f"join_credit must be a number of tokens >= 0, got {join_credit}")
        self._credit = join_credit
        # the most any joiner starts below the floor: an idle account at least that far below is forgotten
        self._most_credit = join_credit / min([1.0, *self._weights.values()])
        self._served: dict[Account, float] = {}
        self._requests: Counter[Account] = Counter()  # queued or running, per active account
        self._in_flow: dict[Flow, Counter[Account]] = {}  # each active flow's requests by account
        self._floor = 0.0  # never decreases: counters only grow and joiners start at it less the credit

    def served(self, flow: Flow) -> float:
        """The flow's priority: the lowest counter among the accounts with requests in it (for a flow without
        any, its remembered counter or the floor)."""
        accounts = self._in_flow.get(flow)
        if not accounts:
            return self._served.get(account_of(flow, None), self._floor)
        return min(self.account_served(a) for a in accounts)

    def account_served(self, account: Account) -> float:
        """The account's counter (for one never charged or forgotten, the floor)."""
        return self._served.get(account, self._floor)

    def weight(self, flow: Flow) -> float:
        return self._weights.get(flow, 1.0)

    def join(self, flow: Flow, tenant: str | None = None) -> None:
        """One more request of ``flow`` for ``tenant`` is queued or running."""
        account = account_of(flow, tenant)
        if not self._requests[account]:
            self._advance_floor()
            joins_at = self._floor - self._credit / self.weight(flow)
            self._served[account] = max(self._served.get(account, -math.inf), joins_at)
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
            # an idle account at or below where any joiner starts would rejoin there anyway: forget it
            self._served = {a: c for a, c in self._served.items()
                            if a in self._requests or c > self._floor - self._most_credit}

    def charge(self, flow: Flow, tokens: int, tenant: str | None = None) -> None:
        account = account_of(flow, tenant)
        self._served[account] = self._served.get(account, self._floor) + tokens / self.weight(flow)

    def _advance_floor(self) -> None:
        if self._requests:
            self._floor = max(self._floor, min(self._served[a] for a in self._requests))
