"""Seats: who gives up a seat (one of ``max_num_seqs`` running requests) for an account without one.

Under fair share, when every seat is taken and a backlogged flow that can run has no request of its
account running, the account holding the most seats (ties: the most served) gives up its latest admitted
request, which is queued again first of its flow: an account's first request waits one step, not for a
seat to turn over behind another account's burst. Only an account with no seat takes one, and only from
an account with more than one, so two busy accounts never trade seats back and forth. Seats are an
account's (``fair_share.py``): a tenant's seats across its adapters are its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq

from data_plane.engine.fair_share import Account, FairShare, Flow, account_of
from data_plane.engine.sequence import Sequence


class Seats:
    def __init__(self, max_num_seqs: int, shares: FairShare) -> None:
        self.max_num_seqs = max_num_seqs
        self._shares = shares

    @staticmethod
    def held(running: Seq[Sequence]) -> Counter[Account]:
        """Running requests per account."""
        return Counter(account_of(seq.adapter, seq.tenant) for seq in running)

    def trade(self, running: Seq[Sequence], queues: Mapping[Flow, Seq[Sequence]], can_run_now: Callable[[Flow], bool],
              preempt: Callable[[Sequence], None]) -> tuple[Flow] | None:
        """Preempts (``preempt``) the running request that gives up its seat and returns (the flow whose next
        request takes it,); None, preempting nothing, when a seat is free, no backlogged flow that can run
        lacks one (but the giver's own, whose next request it would be queued before), or no account holds
        two."""
        if len(running) < self.max_num_seqs or not queues:
            return None
        seats = self.held(running)
        seatless = [flow for flow, queue in queues.items()
                    if account_of(flow, queue[0].tenant) not in seats and can_run_now(flow)]
        holder = max(seats, key=lambda a: (seats[a], self._shares.account_served(a)), default=None)
        if not seatless or seats[holder] < 2:
            return None
        victim = next(seq for seq in reversed(running) if account_of(seq.adapter, seq.tenant) == holder)
        # queued again first of its flow, it would take back the seat it gave up in front of its flow's next
        seatless = [flow for flow in seatless if flow != victim.adapter]
        if not seatless:
            return None
        preempt(victim)
        return (min(seatless, key=lambda flow: (self._shares.served(flow), queues[flow][0].arrival)),)
