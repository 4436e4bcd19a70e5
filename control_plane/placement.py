"""Where pinned adapters go: a pure function from desired pins and pods to assignments."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PodSlots:
    """What placement needs to know of one pod."""

    id: str
    capacity: int  # adapters it may hold pinned
    pinned: frozenset[str] = frozenset()  # adapters it holds pinned now
    # False while the pod's lease has lapsed but its grace period has not: it keeps the pins
    # it has (so that a short blip causes no churn) but receives no new ones.
    schedulable: bool = True


@dataclass(frozen=True)
class Pin:
    adapter: str
    replicas: int  # 0 = every schedulable pod


@dataclass(frozen=True)
class Assignment:
    pods: dict[str, tuple[str, ...]] = field(default_factory=dict)  # adapter -> pod ids, sorted
    unsatisfied: dict[str, str] = field(default_factory=dict)  # adapter -> why it has too few pods


def pinned_capacity(slots_total: int, cpu_cache_capacity: int, reserved: int) -> int:
    """Pins a pod can hold: a pinned adapter takes a device slot and a CPU cache entry, and
    ``reserved`` slots stay free for unpinned adapters."""
    return max(0, min(slots_total, cpu_cache_capacity) - reserved)


def place(pins: list[Pin], pods: list[PodSlots], failed: frozenset[tuple[str, str]] = frozenset()) -> Assignment:
    """Assigns each pin to its replicas' worth of pods (every schedulable pod for replicas=0).

    Promises: no pod gets more pins than its capacity; an adapter is never assigned to a pod in
    ``failed`` ((adapter, pod) pairs that gave up loading it); pins already held stay where they
    are while that is allowed, on a pod in its grace period too (for replicas=0 it counts among
    "every pod" while it holds the pin); new replicas go to the pods with the most free capacity, one
    replica per adapter per round so that scarce capacity is shared across adapters; a pin that
    gets fewer pods than asked is in ``unsatisfied`` with the reason. Deterministic.
    """
    pins = sorted(pins, key=lambda p: p.adapter)
    by_id = {p.id: p for p in pods}
    free = {p.id: p.capacity for p in pods}
    chosen: dict[str, list[str]] = {p.adapter: [] for p in pins}
    schedulable = [p for p in pods if p.schedulable]
    want = {p.adapter: p.replicas or len(schedulable) + _held_in_grace(p.adapter, pods, failed) for p in pins}

    holding: dict[str, list[str]] = {}  # adapter -> the pods that hold it pinned, in id order
    for pod in sorted(by_id.values(), key=lambda p: p.id):
        for a in pod.pinned:
            holding.setdefault(a, []).append(pod.id)
    for pin in pins:  # keep what is already pinned
        a = pin.adapter
        for pod_id in holding.get(a, ()):
            if (a, pod_id) not in failed and free[pod_id] > 0 and len(chosen[a]) < want[a]:
                chosen[a].append(pod_id)
                free[pod_id] -= 1

    progress = True
    while progress:  # round robin over adapters still short of replicas
        progress = False
        for pin in pins:
            a = pin.adapter
            if len(chosen[a]) >= want[a]:
                continue
            candidates = [p for p in schedulable
                          if free[p.id] > 0 and p.id not in chosen[a] and (a, p.id) not in failed]
            if not candidates:
                continue
            best = min(candidates, key=lambda p: (-free[p.id], p.capacity - free[p.id], p.id))
            chosen[a].append(best.id)
            free[best.id] -= 1
            progress = True

    unsatisfied = {p.adapter: _reason(p, len(chosen[p.adapter]), want[p.adapter], schedulable, failed)
                   for p in pins if len(chosen[p.adapter]) < want[p.adapter] or want[p.adapter] == 0}
    return Assignment({a: tuple(sorted(ids)) for a, ids in chosen.items()}, unsatisfied)


def _held_in_grace(adapter: str, pods: list[PodSlots], failed: frozenset[tuple[str, str]]) -> int:
    return sum(1 for p in pods if not p.schedulable and adapter in p.pinned and (adapter, p.id) not in failed)


def _reason(pin: Pin, placed: int, want: int, pods: list[PodSlots], failed: frozenset[tuple[str, str]]) -> str:
    asked = "every pod" if pin.replicas == 0 else f"{pin.replicas} pod{'s' if pin.replicas != 1 else ''}"
    if not pods:
        return f"asked for {asked}, pinned on {placed}: no ready pods"
    parts = []
    if want > len(pods):
        parts.append(f"only {len(pods)} ready pod{'s' if len(pods) != 1 else ''}")
    failed_on = sorted(pod for a, pod in failed if a == pin.adapter)
    if failed_on:
        parts.append(f"loading failed on {', '.join(failed_on)}")
    if not parts or placed + len(failed_on) < min(want, len(pods)):
        parts.append("no free pinned capacity on the other pods (unpin adapters or add pods)")
    return f"asked for {asked}, pinned on {placed}: {'; '.join(parts)}"
