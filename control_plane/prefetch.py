"""Prefetch by popularity: copies of adapters whose demand rises, put on pods' disk tiers before their
requests come. Pure: the leader calls it once per reconciliation pass.

An adapter with a remote source (http, s3, hf) whose fleet-wide rate (the pods' decayed demand reports,
summed) is at least ``Prefetch.rate`` should be on the disks of ``ceil(rate / Prefetch.rate)`` pods,
counting the pods that hold it in memory: when the router spreads its overflow, or the replicator adds a
replica, the pod it picks reads the adapter from disk instead of downloading it. The pods asked are the
ones the router would send that overflow to first (``conventions.pod_cost``: the least loaded, then the
id). Bounded per pass: at most ``Prefetch.per_pass`` prefetches in the fleet, hottest adapters first, so
that a burst of new adapters cannot saturate the pods' or the store's network in one pass. A pod is asked
only when its disk tier has room for one more copy of the size its copies have on average: a prefetch
never makes a pod's disk tier evict (the copies it holds, standby copies of pins among them, stay), and it
never touches memory or slots. The registry does not know an adapter's size, so the bound is in
prefetches per pass, not bytes (an adapter's size is what its copies on disk take).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from control_plane.errors import ConfigError
from control_plane.plan import REMOTE_SCHEMES, Action, Command
from control_plane.records import AdapterRecord, PodRecord
from conventions.pod_cost import Weights


@dataclass(frozen=True)
class Prefetch:
    """When an adapter's demand earns it disk copies, and how many prefetches one pass may ask."""

    rate: float = 1.0  # requests per second, fleet-wide, per disk copy; 0 turns prefetch by popularity off
    per_pass: int = 4

    def __post_init__(self) -> None:
        if not 0 <= self.rate < math.inf:
            raise ConfigError(f"--prefetch-rate must be >= 0 requests/s (0 turns it off), got {self.rate}")
        if not 1 <= self.per_pass <= 1000:
            raise ConfigError(f"--prefetch-per-pass must be within 1-1000, got {self.per_pass}")


def demand_rates(adapters: list[AdapterRecord], pods: list[PodRecord]) -> dict[str, float]:
    """Each registered adapter's fleet-wide rate: the sum of what the ``pods`` report for it."""
    registered = {a.name for a in adapters}
    rates: dict[str, float] = {}
    for pod in pods:
        for name, rate in pod.demand:
            if name in registered:
                rates[name] = rates.get(name, 0.0) + rate
    return rates


def disk_has_room(pod: PodRecord) -> bool:
    """Whether ``pod``'s disk tier takes one more copy without evicting: free bytes for a copy of the size its
    copies have on average (any size while it holds none)."""
    if pod.disk_capacity_bytes <= 0:
        return False
    free = pod.disk_capacity_bytes - pod.disk_used_bytes
    return free > 0 and (pod.disk_entries == 0 or free >= pod.disk_used_bytes / pod.disk_entries)


def popular_prefetches(adapters: list[AdapterRecord], pods: list[PodRecord], rates: Mapping[str, float],
                       policy: Prefetch, skip: Callable[[str, str, str], bool],
                       weights: Weights = Weights()) -> list[Action]:
    """PREFETCH commands for the remote adapters whose demand ``rates`` (adapter -> fleet-wide requests/s) earn
    them copies on more of the ready ``pods``' disks, as the module says. ``skip(adapter, pod, sha256)``: a
    prefetch already asked of that pod (it counts as a copy) or not due again."""
    if policy.rate == 0:
        return []
    by_load = sorted(pods, key=lambda p: (weights.load(p.running_requests, p.waiting_requests, p.kv_usage), p.id))
    hot = sorted((a for a in adapters if urlparse(a.source).scheme in REMOTE_SCHEMES
                  and rates.get(a.name, 0.0) >= policy.rate), key=lambda a: (-rates[a.name], a.name))
    actions: list[Action] = []
    for a in hot:
        wanted = min(len(pods), math.ceil(rates[a.name] / policy.rate))
        have = [p for p in pods if p.resident(a.name) is not None or skip(a.name, p.id, a.sha256)]
        for pod in by_load:
            if len(have) >= wanted or len(actions) >= policy.per_pass:
                break
            if pod in have or not disk_has_room(pod):
                continue
            actions.append(Action(pod.id, pod.endpoint, Command.PREFETCH, a.name, a.source, a.sha256))
            have.append(pod)
    return actions
