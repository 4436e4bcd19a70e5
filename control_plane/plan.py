"""What to tell each pod: a pure diff of desired state against what the pods report."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

from control_plane.records import AdapterRecord, PlacementRecord, PlacementState, PodRecord


class Command(enum.Enum):
    LOAD_AND_PIN = "load_and_pin"  # LoadAdapter, then PinAdapter
    PIN = "pin"
    UNPIN = "unpin"
    UNLOAD = "unload"
    LOAD = "load"  # LoadAdapter only: an extra replica of a hot adapter (control_plane/replicator.py)
    RELEASE = "release"  # UnloadAdapter of an extra replica gone cold; refused while in use, tried again later
    PREFETCH = "prefetch"  # PrefetchAdapter: a copy on a standby pod's disk, ahead of demand (prefetch_actions)


REMOTE_SCHEMES = ("http", "https", "s3", "hf")  # sources a pod downloads into its disk tier


@dataclass(frozen=True)
class Action:
    pod: str
    endpoint: str
    command: Command
    adapter: str
    source: str = ""
    sha256: str = ""


def retry_due(rec: PlacementRecord, now: float, backoff_s: float) -> bool:
    """Whether a failed load may be tried again: the wait doubles with each failure."""
    return now >= rec.updated_at + backoff_s * 2 ** max(0, rec.attempts - 1)


def plan_actions(adapters: list[AdapterRecord], pods: list[PodRecord], assigned: dict[str, tuple[str, ...]],
                 placements: dict[str, list[PlacementRecord]], now: float, max_attempts: int,
                 backoff_s: float) -> list[Action]:
    """Commands that move ``pods`` (the ready ones) towards ``assigned`` (adapter -> pods that
    should hold it pinned), in per-pod order: unpins first, so that pins never exceed a pod's
    capacity in passing, then unloads, then loads and pins.

    Promises: empty when the pods already agree (so reconciling is idempotent), and for a pin
    the pod accepted after its last heartbeat (no repeated loads while its report catches up);
    an adapter that is not registered, or is resident with other weights than registered, is
    unpinned and unloaded; a failed load is retried only after its backoff and at most ``max_attempts`` times.
    """
    registered = {a.name: a for a in adapters}
    wanted_on: dict[str, set[str]] = {}
    for adapter, pod_ids in assigned.items():
        for pod_id in pod_ids:
            wanted_on.setdefault(pod_id, set()).add(adapter)
    records = {(r.adapter, r.pod): r for recs in placements.values() for r in recs}
    failures = {key: r for key, r in records.items() if r.state is PlacementState.FAILED}

    actions: list[Action] = []
    for pod in sorted(pods, key=lambda p: p.id):
        unpins, unloads, loads = [], [], []
        wanted = wanted_on.get(pod.id, set())
        for res in pod.residents:
            rec = registered.get(res.name)
            stale = rec is None or (res.sha256 and res.sha256 != rec.sha256)
            if res.pinned and (stale or res.name not in wanted):
                unpins.append(Action(pod.id, pod.endpoint, Command.UNPIN, res.name))
            if stale:
                unloads.append(Action(pod.id, pod.endpoint, Command.UNLOAD, res.name))
        for name in sorted(wanted):
            rec, res = registered.get(name), pod.resident(name)
            if rec is None:
                continue
            asked = records.get((name, pod.id))
            if asked is not None and asked.pinned and asked.ready_since(pod):
                continue  # loaded and pinned since the pod's last report: not sent again before it reports
            if res is not None and res.sha256 in ("", rec.sha256):
                if not res.pinned:
                    loads.append(Action(pod.id, pod.endpoint, Command.PIN, name))
                continue
            failed = failures.get((name, pod.id))
            if failed and (failed.attempts >= max_attempts or not retry_due(failed, now, backoff_s)):
                continue
            loads.append(Action(pod.id, pod.endpoint, Command.LOAD_AND_PIN, name, rec.source, rec.sha256))
        actions += unpins + unloads + loads
    return actions


def prefetch_actions(adapters: list[AdapterRecord], pods: list[PodRecord], assigned: dict[str, tuple[str, ...]],
                     skip: Callable[[str, str, str], bool]) -> list[Action]:
    """PREFETCH commands that put each pinned adapter with a replica count (``pin_replicas`` >= 1) and a
    remote source on the disks of as many ready pods beyond its holders, so that the pod its pin moves
    to when a holder goes usually loads it from disk instead of from storage. The standbys of an adapter
    are picked by rendezvous hashing of (adapter, pod): spread over the fleet, and the same picks while
    the fleet changes little. Placement after a loss may still choose another pod, which then downloads.

    ``skip(adapter, pod, sha256)`` leaves out what was already prefetched or is not due again."""
    actions = []
    for a in adapters:
        if not a.pinned or a.pin_replicas < 1 or urlparse(a.source).scheme not in REMOTE_SCHEMES:
            continue
        holders = set(assigned.get(a.name, ()))
        others = [p for p in pods if p.id not in holders and p.resident(a.name) is None]
        others.sort(key=lambda p, n=a.name: hashlib.sha256(f"{n}/{p.id}".encode()).digest())
        actions += [Action(p.id, p.endpoint, Command.PREFETCH, a.name, a.source, a.sha256)
                    for p in others[:a.pin_replicas] if not skip(a.name, p.id, a.sha256)]
    return actions
