"""Fair order: which request gets prefill work first, and which running request gives its blocks back.

Under the ``fair`` policy the least-served flow goes first (``fair_share.py``: each account has a virtual
token counter; a flow stands where the least-served account with requests in it stands), its oldest
request first. A started prompt keeps the standing its flow had when it started for the first
STARTED_QUANTUM tokens it computes, and stands behind by what it computes past them, but never more
than a quantum behind its flow's counter as it is now: prompts up to that long are finished in the order
they started, not side by side chunk by chunk, so each first token comes as early as the budget allows
and later arrivals of flows served as much do not slow it; a longer prompt then shares the budget with
the rest, so nobody waits behind one for more than about a quantum of it; a request of a flow served
less still goes first. When KV blocks run out, the most recently admitted running request of the
most-served flow gives its blocks back (so fair admission is not undone by preempting the newcomer it let
in). Under ``fcfs`` the oldest request goes first and the most recently admitted gives its blocks back.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Mapping
from collections.abc import Sequence as Seq

from data_plane.engine.fair_share import FairShare, Flow
from data_plane.engine.sequence import Sequence

# Prompt tokens a started prompt computes at the standing it started with before it shares the prefill
# budget with other flows' work.
STARTED_QUANTUM = 128


class Policy(enum.Enum):
    """The order waiting requests are admitted in (the pod's --scheduling-policy)."""

    FAIR = "fair"  # least-served flow first, arrival order within a flow
    FCFS = "fcfs"  # arrival order across all flows


class FairOrder:
    def __init__(self, policy: Policy, shares: FairShare) -> None:
        self.policy = policy
        self._shares = shares

    def key(self, seq: Sequence) -> tuple:
        """``seq``'s place in the order of prefill work, waiting or started (lowest first)."""
        if self.policy is Policy.FCFS:
            return (seq.arrival,)
        served = self._shares.served(seq.adapter)
        if seq.started_at_standing is None:
            return served, seq.arrival
        weight = self._shares.weight(seq.adapter)
        past_quantum = max(0, seq.num_computed - seq.started_at_computed - STARTED_QUANTUM) / weight
        # its flow's other work (decodes, other prompts) moves its counter on meanwhile: never more than a
        # quantum behind it
        return max(seq.started_at_standing + past_quantum, served - STARTED_QUANTUM / weight), seq.arrival

    def in_order(self, started: Iterable[Sequence], queues: Mapping[Flow, Seq[Sequence]]) -> list[Sequence]:
        """``started`` and every request of ``queues``, lowest ``key`` first (ties in the order given):
        ``sorted`` by ``key``, with each flow's standing read once rather than once per request (a waiting
        request's key is its flow's standing and its arrival)."""
        keyed = [(self.key(seq), i, seq) for i, seq in enumerate(started)]
        fcfs = self.policy is Policy.FCFS
        for flow, queue in queues.items():
            served = None if fcfs else self._shares.served(flow)
            keyed += [((seq.arrival,) if fcfs else (served, seq.arrival), len(keyed) + j, seq)
                      for j, seq in enumerate(queue)]
        keyed.sort(key=lambda item: (item[0], item[1]))
        return [seq for _, _, seq in keyed]

    def next_waiting(self, queues: Mapping[Flow, Seq[Sequence]], passed: Collection[Flow],
                     held: Collection[Sequence]) -> Sequence | None:
        """The oldest waiting request of the least-served flow not ``passed`` over (ties: oldest first); under
        FCFS the oldest waiting request not passed over. A flow whose next request is ``held`` (preempted by
        this step, until the step's postprocess resets its progress) waits."""
        heads = [queue[0] for flow, queue in queues.items() if flow not in passed and queue[0] not in held]
        if self.policy is Policy.FCFS:
            return min(heads, key=lambda seq: seq.arrival, default=None)
        return min(heads, key=lambda seq: (self._shares.served(seq.adapter), seq.arrival), default=None)

    def victim(self, running: Iterable[Sequence]) -> Sequence | None:
        """The running request (of ``running``, in admission order) that gives its KV blocks back first."""
        candidates = list(running)[::-1]
        if not candidates or self.policy is Policy.FCFS:
            return candidates[0] if candidates else None  # the latest admitted
        return max(candidates, key=lambda seq: self._shares.served(seq.adapter))  # the first max: latest admitted
