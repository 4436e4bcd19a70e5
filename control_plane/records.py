"""Domain records the registry stores: adapters, pods, placements and change events.

Plain frozen dataclasses, free of Redis and gRPC, so that placement and the servicers can be
reasoned about (and tested) without either.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field


class PlacementState(enum.Enum):
    """Lifecycle of one adapter on one pod (values match lorafleet.v1.PlacementState)."""

    LOADING = 1
    READY = 2
    FAILED = 3


@dataclass(frozen=True)
class AdapterRecord:
    """A registered adapter and its pin, as the admin API last wrote it."""

    name: str
    source: str
    sha256: str
    base_model: str
    version: int = 0
    pinned: bool = False
    pin_replicas: int = 0  # 0 = every pod, while pinned

    def to_fields(self) -> dict[str, str]:
        """Flat string fields, for a hash."""
        return {"name": self.name, "source": self.source, "sha256": self.sha256, "base_model": self.base_model,
                "version": str(self.version), "pinned": "1" if self.pinned else "0",
                "pin_replicas": str(self.pin_replicas)}

    @classmethod
    def from_fields(cls, h: dict[str, str]) -> AdapterRecord:
        return cls(name=h["name"], source=h["source"], sha256=h["sha256"], base_model=h["base_model"],
                   version=int(h["version"]), pinned=h["pinned"] == "1", pin_replicas=int(h["pin_replicas"]))


@dataclass(frozen=True)
class Residency:
    """One adapter resident on a pod, as the pod reported it."""

    name: str
    pinned: bool = False
    rank: int = 0
    sha256: str = ""
    on_device: bool = False


@dataclass(frozen=True)
class PodRecord:
    """A data-plane pod as of its last heartbeat."""

    id: str
    endpoint: str
    base_model: str = ""
    reported_ready: bool = False
    last_heartbeat: float = 0.0
    slots_total: int = 0
    slots_used: int = 0
    slots_pinned: int = 0
    cpu_cache_capacity: int = 0
    cpu_cache_used: int = 0
    cpu_cache_pinned: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    residents: tuple[Residency, ...] = ()
    kv_usage: float = 0.0  # fraction of KV-cache blocks in use, 0..1
    # (adapter, requests per second) of its busiest adapters, as decayed by the pod, highest first
    demand: tuple[tuple[str, float], ...] = ()
    precision: str = ""  # what the pod computes in (its --dtype, auto resolved); "" before it says
    # its disk tier (PodState.disk): 0 capacity when it has none
    disk_capacity_bytes: int = 0
    disk_used_bytes: int = 0
    disk_entries: int = 0

    def is_live(self, now: float, lease_ttl_s: float) -> bool:
        """Whether the lease from its last heartbeat still runs."""
        return now - self.last_heartbeat <= lease_ttl_s

    def resident(self, name: str) -> Residency | None:
        return next((r for r in self.residents if r.name == name), None)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> PodRecord:
        d = json.loads(raw)
        return cls(**(d | {"residents": tuple(Residency(**r) for r in d["residents"]),
                           "demand": tuple((a, rate) for a, rate in d.get("demand", ()))}))


# How much older than its arrival a heartbeat's report may be: its time in flight and queued at the
# control plane (seconds under load at a hundred pods). A report that lacks a pin recorded this
# little before it does not undo the pin; one that lacks it later does.
REPORT_LAG_S = 2.0


@dataclass(frozen=True)
class PlacementRecord:
    """The reconciler's record of what it asked one pod to do with one adapter."""

    adapter: str
    pod: str
    state: PlacementState
    error: str = ""
    attempts: int = 0  # failed loads so far
    updated_at: float = 0.0
    pinned: bool = True  # asked to load and pin; False for an extra replica of a hot adapter (load only)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self) | {"state": self.state.name})

    def ready_since(self, pod: PodRecord) -> bool:
        """READY, recorded after ``pod``'s last heartbeat: the pod has it, though its report does not show it yet.
        A heartbeat is stamped when it arrives, but the pod took its state when it sent it; under load that
        can be REPORT_LAG_S earlier, so a report that arrives this soon after the record may predate it."""
        return self.state is PlacementState.READY and self.updated_at > pod.last_heartbeat - REPORT_LAG_S

    @classmethod
    def from_json(cls, raw: str) -> PlacementRecord:
        d = json.loads(raw)
        return cls(**(d | {"state": PlacementState[d["state"]]}))


@dataclass(frozen=True)
class Event:
    """One entry of the change feed."""

    id: str  # Redis stream id, increasing
    kind: str  # registered | unregistered | pinned | unpinned | pod_joined | pod_removed
    name: str  # adapter or pod name
    version: int = 0
    fields: dict[str, str] = field(default_factory=dict)
