"""The control plane's reconcile pass over the simulated pods, with the real placement, plan and replica
decision: each pass reads every pod's state as a heartbeat reports it (its per-adapter request rates
from the pod's own ``DemandMeter`` among them), places the pins (``place``), sends the commands
``plan_actions`` returns, then those of the leader's ``Replicator`` when replication is on, then, when prefetch
is on, the standby copies of pins (``plan.prefetch_actions``) and prefetch by popularity
(``prefetch.popular_prefetches`` over ``prefetch.demand_rates``), in the reconciler's order
(control_plane/reconciler.py). A prefetch asked of a pod is not asked of it again, as the reconciler records
one that succeeded. Command round trips take no simulated time; downloads and loads do."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from control_plane.placement import Pin, PodSlots, pinned_capacity, place
from control_plane.plan import Command, plan_actions, prefetch_actions
from control_plane.prefetch import Prefetch, demand_rates, popular_prefetches
from control_plane.records import AdapterRecord, PodRecord, Residency
from control_plane.replication import Policy as ReplicaPolicy
from control_plane.replicator import Replicator
from fleetsim.config import FleetConfig
from fleetsim.pod import SimPod


class ControlPlane:
    def __init__(self, config: FleetConfig, pods: Sequence[SimPod], names: Sequence[str], sha256: dict[str, str],
                 pins: Sequence[Pin], replication: ReplicaPolicy | None, prefetch: Prefetch | None,
                 clock: Callable[[], float]) -> None:
        self._config = config
        self.replicator = Replicator(replication, config.reserved_unpinned_slots, clock) if replication else None
        self.releases_refused = 0
        self.prefetch = prefetch
        self.prefetches_skipped = 0  # asked, and refused by the pod (no room on its disk tier)
        self._prefetched: set[tuple[str, str]] = set()  # (adapter, pod) asked once
        self._pods = pods
        self._by_id = {p.id: p for p in pods}
        self.pins = list(pins)
        replicas = {p.adapter: p.replicas for p in pins}
        self._adapters = [AdapterRecord(name, f"s3://adapters/{name}", sha256[name], "sim", pinned=name in replicas,
                                        pin_replicas=replicas.get(name, 0)) for name in names]
        self.assigned: dict[str, tuple[str, ...]] = {}
        self.unsatisfied: dict[str, str] = {}

    def reconcile(self, now: float) -> int:
        """One pass; returns the number of commands sent."""
        cfg = self._config
        slots = [PodSlots(p.id, pinned_capacity(cfg.slots, cfg.cpu_entries, cfg.reserved_unpinned_slots),
                          frozenset(p.pinned)) for p in self._pods]
        assignment = place(self.pins, slots)
        self.assigned, self.unsatisfied = assignment.pods, assignment.unsatisfied
        ready = [heartbeat(p, now) for p in self._pods]
        actions = plan_actions(self._adapters, ready, assignment.pods, {}, now, cfg.max_load_attempts,
                               cfg.retry_backoff_s)
        if self.replicator is not None:
            actions += self.replicator.actions(self._adapters, ready, assignment.pods, {}, now,
                                               cfg.max_load_attempts, cfg.retry_backoff_s)
        if self.prefetch is not None:
            pinned = [a for a in self._adapters if a.pinned]
            actions += prefetch_actions(pinned, ready, assignment.pods, self._asked)
            actions += popular_prefetches(self._adapters, ready, demand_rates(self._adapters, ready), self.prefetch,
                                          self._asked)
        for action in actions:
            pod = self._by_id[action.pod]
            if action.command in (Command.LOAD_AND_PIN, Command.PIN):
                pod.load_and_pin(action.adapter, now)
            elif action.command is Command.UNPIN:
                pod.unpin(action.adapter)
            elif action.command is Command.UNLOAD:
                pod.unload(action.adapter)
            elif action.command is Command.LOAD:
                pod.load(action.adapter, now)
            elif action.command is Command.RELEASE:
                self.releases_refused += not pod.release(action.adapter)
            elif action.command is Command.PREFETCH:
                self._prefetched.add((action.adapter, action.pod))
                self.prefetches_skipped += not pod.prefetch(action.adapter, now)
        return len(actions)

    def _asked(self, adapter: str, pod: str, sha256: str) -> bool:
        return (adapter, pod) in self._prefetched


def heartbeat(pod: SimPod, now: float) -> PodRecord:
    """What ``pod`` reports of itself at ``now``: the adapters in its CPU tier (loaded), pinned or not, on a
    slot or not, and its disk tier's capacity, usage and copies."""
    cfg = pod.config
    residents = tuple(Residency(name, pinned=name in pod.pinned, on_device=bool(pod.slots.get(name)))
                      for name, ready in pod.cpu.items() if ready)
    return PodRecord(pod.id, f"{pod.id}:1", "sim", True, now, cfg.slots, len(pod.slots),
                     sum(1 for n in pod.slots if n in pod.pinned), cfg.cpu_entries, len(pod.cpu), len(pod.pinned),
                     pod.running, len(pod.waiting), residents, pod.kv_usage,
                     pod.demand.report(cfg.demand_report_top).top, disk_capacity_bytes=cfg.disk_bytes,
                     disk_used_bytes=pod.disk.used, disk_entries=len(pod.disk))
