"""Fleet membership: pods join and stay by heartbeat; a lease decides who is live."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import dataclass

from control_plane.errors import BaseModelMismatch, InvalidArgument
from control_plane.records import PodRecord
from control_plane.store import Store
from conventions.names import NAME_RULE, is_valid_name

_ENDPOINT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")
# Adapter rates one heartbeat may list: the pod lists its busiest few dozen, and every listed rate
# is stored with the pod's record in Redis on each beat.
MAX_DEMAND_RATES = 1000


@dataclass(frozen=True)
class PodView:
    """A pod and whether it may receive work now."""

    pod: PodRecord
    ready: bool


class Fleet:
    """Pod leases: a heartbeat renews a pod's lease for ``lease_ttl_s``; a pod silent for the
    lease plus ``grace_s`` is no longer listed, and the leader removes it for good.

    With ``view_cache_s`` > 0 the pod records read from Redis are reused for that long: every admin
    call and every pass joins with all pods, and reading and decoding a hundred records each time
    is most of the control plane's work at that size. Heartbeats this replica records and pods it
    removes show at once; those other replicas record show within ``view_cache_s``."""

    def __init__(self, store: Store, base_model: str, lease_ttl_s: float, grace_s: float,
                 view_cache_s: float = 0.0, clock=time.monotonic) -> None:
        self._store = store
        self._base_model = base_model
        self.lease_ttl_s = lease_ttl_s
        self.grace_s = grace_s
        self._cache_s, self._clock = view_cache_s, clock
        self._cached: dict[str, PodRecord] | None = None
        self._read_at = 0.0
        self._recorded: dict[str, PodRecord] = {}  # heartbeats recorded here since the last read began
        self._removals = 0

    async def heartbeat(self, pod: PodRecord) -> int:
        """Validates and records a heartbeat; returns the newest fencing token for the pod."""
        if not is_valid_name(pod.id):
            raise InvalidArgument(f"pod_id {pod.id!r} is invalid: use {NAME_RULE}; set --pod-id")
        match = _ENDPOINT_RE.match(pod.endpoint)
        if not match or not 0 < int(match.group(2)) < 65536:
            raise InvalidArgument(f"endpoint {pod.endpoint!r} must be host:port with a port in 1-65535")
        _check_demand(pod)
        if self._base_model and pod.base_model and pod.base_model != self._base_model:
            raise BaseModelMismatch(f"pod {pod.id!r} serves base model {pod.base_model!r} but this fleet serves "
                                    f"{self._base_model!r}; start the pod with the fleet's model")
        pod = dataclasses.replace(pod, last_heartbeat=self._store.now())
        token = await self._store.put_pod(pod)
        if self._cache_s > 0:
            self._recorded[pod.id] = pod
            if self._cached is not None:
                self._cached[pod.id] = pod
        return token

    async def pods(self) -> list[PodView]:
        """Every pod within its lease plus grace, in id order, READY when its lease runs and it
        reported itself ready."""
        now = self._store.now()
        cutoff = now - self.lease_ttl_s - self.grace_s
        if self._cache_s <= 0:
            pods = await self._store.list_pods(heard_since=cutoff)
        else:
            pods = sorted((p for p in (await self._cached_records(cutoff)).values() if p.last_heartbeat >= cutoff),
                          key=lambda p: p.id)
        return [PodView(p, p.reported_ready and p.is_live(now, self.lease_ttl_s)) for p in pods]

    async def _cached_records(self, cutoff: float) -> dict[str, PodRecord]:
        if self._cached is None or self._clock() - self._read_at > self._cache_s:
            self._read_at, self._recorded, removals = self._clock(), {}, self._removals
            read = {p.id: p for p in await self._store.list_pods(heard_since=cutoff, known=self._cached)}
            read |= self._recorded  # a heartbeat recorded here during the read is newer than what it read
            if removals != self._removals:  # a pod was removed during the read, which may still show it
                return read
            self._cached = read
        return self._cached

    def _forget(self) -> None:
        self._cached = None
        self._removals += 1

    async def remove(self, pod_id: str, heard_until: float, token: int) -> bool:
        """Removes one pod with its placements unless it has beaten since ``heard_until`` (see
        Store.remove_pod); fenced by the leader's ``token``."""
        removed = await self._store.remove_pod(pod_id, heard_until, token)
        if removed:
            self._forget()
        return removed

    async def remove_lost(self, token: int) -> list[str]:
        """Removes pods silent for longer than lease plus grace; returns their ids. Only the leader
        holding fencing token ``token`` may (NotLeader otherwise)."""
        removed = await self._store.remove_pods_silent_since(self._store.now() - self.lease_ttl_s - self.grace_s, token)
        if removed:
            self._forget()
        return removed


def _check_demand(pod: PodRecord) -> None:
    if len(pod.demand) > MAX_DEMAND_RATES:
        raise InvalidArgument(f"the heartbeat lists {len(pod.demand)} adapter rates, more than {MAX_DEMAND_RATES}; "
                              "lower the pod's --demand-report-top")
    for adapter, rate in pod.demand:
        if not is_valid_name(adapter):
            raise InvalidArgument(f"demand lists adapter {adapter!r}, not a valid adapter name ({NAME_RULE})")
        if not 0 <= rate < math.inf:
            raise InvalidArgument(f"demand rate {rate} for adapter {adapter!r} must be a finite number >= 0")
