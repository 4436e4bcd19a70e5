"""The leader's side of replicas that follow popularity: reads the fleet as the reconciler sees it,
asks ``replication.plan_replicas``, and turns the plan into pod commands. Holds the decision's state
between passes in memory; the replicas themselves are in the registry as placement records of
unpinned loads, so that a new leader takes over the ones it finds and releases them once cold."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from control_plane.placement import pinned_capacity
from control_plane.plan import Action, Command, retry_due
from control_plane.prefetch import demand_rates
from control_plane.records import AdapterRecord, PlacementRecord, PlacementState, PodRecord
from control_plane.replication import PodLoad, Policy, ReplicaPlan, ReplicaState, plan_replicas


class Replicator:
    """Each pass: the fleet-wide rate of each registered adapter (the sum of what the ready pods report),
    the pods holding it, its pin, and each pod's room go into the replica decision; its loads become
    LOAD commands (LoadAdapter, unpinned: the pod's LRU may still evict a replica, which is then
    replaced) and its releases RELEASE commands (UnloadAdapter)."""

    def __init__(self, policy: Policy, reserved_slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._policy = policy
        self._reserved = reserved_slots
        self._clock = clock
        self._state = ReplicaState()
        self.last: ReplicaPlan | None = None

    def actions(self, adapters: list[AdapterRecord], ready: list[PodRecord], pins: dict[str, tuple[str, ...]],
                placements: dict[str, list[PlacementRecord]], now: float, max_attempts: int,
                backoff_s: float) -> list[Action]:
        """The commands of this pass. ``ready``: the ready pods; ``pins``: adapter -> pods it is pinned on
        after this pass's pin placement; ``now``: the registry's clock, for placement records' times."""
        registered = {a.name: a for a in adapters}
        by_pod = {p.id: p for p in ready}
        rates = demand_rates(adapters, ready)
        holders: dict[str, set[str]] = defaultdict(set)
        for pod in ready:
            for res in pod.residents:
                rec = registered.get(res.name)
                if rec is not None and res.sha256 in ("", rec.sha256):
                    holders[res.name].add(pod.id)
        excluded = set()
        replicas: dict[str, int] = defaultdict(int)  # adapter -> replicas a leader loaded that pods still hold
        for name, recs in placements.items():
            for r in recs:
                pod = by_pod.get(r.pod)
                if pod is not None and r.ready_since(pod):
                    holders[name].add(r.pod)  # loaded since its pod last reported
                if r.state is PlacementState.READY and not r.pinned and r.pod in holders[name]:
                    replicas[name] += 1
                if r.state is PlacementState.FAILED and (r.attempts >= max_attempts or
                                                         not retry_due(r, now, backoff_s)):
                    excluded.add((name, r.pod))
        for name, pods in pins.items():
            holders[name].update(p for p in pods if p in by_pod)
        pin_counts = {a.name: a.pin_replicas for a in adapters if a.pinned}
        loads = [PodLoad(p.id, max(0, pinned_capacity(p.slots_total, p.cpu_cache_capacity, self._reserved)
                                   - p.slots_pinned), p.slots_used < p.slots_total, p.running_requests,
                         p.waiting_requests, p.kv_usage) for p in ready]
        # adapters with replicas an earlier leader loaded are managed from their current count on
        taken_over = {a: len(holders[a]) for a in replicas if a not in self._state.targets}
        state = replace(self._state, targets={**self._state.targets, **taken_over})
        plan = plan_replicas(dict(rates), holders, pin_counts, loads, self._policy, state, self._clock(),
                             pinned_on=pins, excluded=excluded)
        self._state, self.last = plan.state, plan
        out = []
        for name, pod_ids in plan.add.items():
            rec = registered[name]
            out += [Action(p, by_pod[p].endpoint, Command.LOAD, name, rec.source, rec.sha256) for p in pod_ids]
        for name, pod_ids in plan.release.items():
            out += [Action(p, by_pod[p].endpoint, Command.RELEASE, name) for p in pod_ids]
        return out
