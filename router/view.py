"""What the router knows of the fleet at one moment: the registered adapters and every routable pod
with its residency, its disk tier, its measured load times and its load. Built from the control plane's
registry and the pods' own GetState."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property

from lorafleet.v1 import adapter_admin_pb2 as admin_pb
from lorafleet.v1 import data_plane_admin_pb2 as pod_pb

from conventions.disk_key import disk_key

_REMOTE = ("http://", "https://", "s3://", "hf://")  # sources a pod downloads into its disk tier
_MAX_DOWNLOAD_FACTOR = 1000.0  # a report beyond reason is not allowed to outweigh everything else
_SHA256 = re.compile(r"[0-9a-f]{64}")  # a registry record that holds anything else is left out, not fatal


class Tier(IntEnum):
    """Where a pod holds an adapter; a higher tier serves sooner."""

    NONE = 0
    CPU = 1
    DEVICE = 2


_TIER = {pod_pb.CPU: Tier.CPU, pod_pb.GPU: Tier.DEVICE}


@dataclass(frozen=True)
class LoadTimes:
    """Seconds a pod measured for each move between its tiers (PodState.load_times); 0: not measured yet."""

    host_to_slot_s: float = 0.0
    disk_to_host_s: float = 0.0
    remote_to_disk_s: float = 0.0

    def download_factor(self) -> float:
        """How many times a read from disk a download into the disk tier takes on this pod: what a cold load
        that must download costs beyond one that reads its disk's copy. 1 until both were measured (a
        download is at least a second read: its copy is then read from disk)."""
        if 0 < self.disk_to_host_s < math.inf and 0 < self.remote_to_disk_s < math.inf:
            return min(self.remote_to_disk_s / self.disk_to_host_s, _MAX_DOWNLOAD_FACTOR)
        return 1.0


@dataclass(frozen=True)
class PodView:
    """One ready, serving pod whose state was read."""

    id: str
    endpoint: str
    slots_total: int = 0
    slots_used: int = 0
    slots_busy: int = 0  # slots whose adapter is pinned or serving: not to be given to another adapter now
    residency: Mapping[str, Tier] = field(default_factory=dict)  # adapter -> fastest tier holding it
    running: int = 0
    waiting: int = 0
    seats: int = 0  # the most requests it runs at once (PodState.max_num_seqs); 0: not reported
    kv_usage: float = 0.0  # fraction of KV-cache blocks in use, 0..1
    precision: str = ""  # what it computes in (PodState.precision); pods of one precision answer alike
    prefixes: frozenset[int] = frozenset()  # routing-prefix hashes whose KV blocks it holds (PodState.prefix_hashes)
    disk: frozenset[int] = frozenset()  # the disk tier's copies, by disk_key of their sha256 (PodState.disk_digests)
    load_times: LoadTimes = LoadTimes()

    def tier(self, adapter: str) -> Tier:
        return self.residency.get(adapter, Tier.NONE)

    def matched(self, chain: Sequence[int]) -> int:
        """How many chunks of a request's routing-prefix ``chain`` this pod holds from the start: one past the
        last hash it reports (hash i covers every chunk up to i, so the ones before need not be listed)."""
        if self.prefixes:
            for i in range(len(chain) - 1, -1, -1):
                if chain[i] in self.prefixes:
                    return i + 1
        return 0

    @property
    def has_free_slot(self) -> bool:
        return self.slots_used < self.slots_total

    @property
    def slot_takeable(self) -> bool:
        """Whether an adapter not in a slot could get one now (free, or held by an idle, unpinned adapter)."""
        return self.slots_busy < self.slots_total

    def seats_taken(self, running: int) -> bool:
        """Whether a new request would wait here for a seat, with ``running`` requests running (False where the pod
        reports no seats)."""
        return 0 < self.seats <= running

    def must_download(self, key: int | None) -> bool:
        """Whether a load of the adapter whose remote copy has disk key ``key`` (None: a local source) must
        download it first: it is not on this pod's disk tier."""
        return key is not None and key not in self.disk


@dataclass(frozen=True)
class FleetView:
    """The registered adapters and the routable pods, as read starting at ``read_at`` (monotonic seconds),
    and the base model the pods serve ("" until a pod's state has named it)."""

    adapters: frozenset[str]
    pods: tuple[PodView, ...]
    read_at: float
    base_model: str = ""
    # Adapters with a remote source (http, s3, hf): the disk key of their registered sha256. A pod loads one
    # from its disk tier when it holds that copy, else downloads it first.
    remote: Mapping[str, int] = field(default_factory=dict)
    # Adapters' LoRA ranks as the registry has them from the pods holding them (Adapter.rank); an adapter no pod
    # holds is missing.
    ranks: Mapping[str, int] = field(default_factory=dict)

    def size(self, adapter: str) -> float:
        """How many times the bytes of the fleet's mean adapter ``adapter`` weighs, by rank (an adapter's
        weights grow in proportion to its rank on the same modules): what its loads take against the mean load
        the pods measured. 1 where its rank is not known."""
        rank = self.ranks.get(adapter, 0)
        return rank / self._mean_rank if rank else 1.0

    @cached_property
    def _mean_rank(self) -> float:
        return sum(self.ranks.values()) / len(self.ranks)


def build_view(adapters: Iterable[admin_pb.Adapter], pods: Iterable[admin_pb.Pod],
               states: Mapping[str, pod_pb.PodState], read_at: float, base_model: str = "") -> FleetView:
    """The view of ``pods`` that are ready and whose ``states`` were read. A pod's own state is the
    fresher fact; a READY pinned placement in the registry means a device slot as well, since a pinned
    adapter is never evicted, so the two agree even between reads. The base model is the one the read
    pods name (every pod of a fleet serves the same one), else ``base_model``: the last one known."""
    adapters = list(adapters)
    pinned_on: dict[str, set[str]] = {}
    for adapter in adapters:
        for placement in adapter.placements:
            if placement.state == admin_pb.READY and placement.pinned:
                pinned_on.setdefault(placement.pod, set()).add(adapter.name)
    views = []
    for pod in pods:
        state = states.get(pod.id)
        if not pod.ready or state is None:
            continue
        residency = {a.name: _TIER[a.tier] for a in state.adapters if a.tier in _TIER}
        for name in pinned_on.get(pod.id, ()):
            residency[name] = Tier.DEVICE
        times = state.load_times
        views.append(PodView(id=pod.id, endpoint=pod.endpoint, slots_total=state.slots.capacity,
                             slots_used=state.slots.used, slots_busy=state.slots.busy, residency=residency,
                             running=state.running_requests,
                             waiting=state.waiting_requests, seats=state.max_num_seqs, kv_usage=state.kv_cache_usage,
                             precision=state.precision, prefixes=frozenset(state.prefix_hashes),
                             disk=frozenset(state.disk_digests),
                             load_times=LoadTimes(times.host_to_slot_seconds, times.disk_to_host_seconds,
                                                  times.remote_to_disk_seconds)))
    base_model = next((s.base_model for s in states.values() if s.base_model), base_model)
    remote = {a.name: disk_key(a.sha256) for a in adapters
              if a.source.startswith(_REMOTE) and _SHA256.fullmatch(a.sha256)}
    return FleetView(frozenset(a.name for a in adapters), tuple(sorted(views, key=lambda v: v.id)), read_at,
                     base_model, remote, {a.name: a.rank for a in adapters if a.rank})
