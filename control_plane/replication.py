"""Replicas that follow popularity: how many pods should hold each hot adapter, and which. Pure.

No I/O and no clock of its own: time enters only as ``now``, and the same inputs always give the
same plan (every iteration is in a fixed order, ties broken by name). The leader calls it once per
reconciliation pass; the fleet simulator drives it the same way.

Public interface (stable):

    plan_replicas(rates, holders, pins, pods, policy, state, now, *, pinned_on={}, excluded=())
        -> ReplicaPlan(targets, add, release, state)

- ``rates``: adapter -> fleet-wide requests per second (the sum of the pods' reports).
- ``holders``: adapter -> ids of the pods holding it now (resident in any tier, or being loaded).
- ``pins``: adapter -> its pin's replica count (0 = every pod), for pinned adapters only.
- ``pods``: the ready pods, each a ``PodLoad`` (its spare room for extra replicas and its load).
- ``policy``: the thresholds (``Policy``); ``state``: what the previous call returned in
  ``ReplicaPlan.state`` (``ReplicaState()`` at first); ``now``: seconds on any monotonic clock.
- ``pinned_on``: adapter -> pods holding it pinned (never released here; the pin placement owns them).
- ``excluded``: (adapter, pod) pairs never to load on (loads there failed for good).

The rule. An adapter's replicas are the ready pods holding it. Its per-replica rate is its rate over
its replicas (over one when none). Above ``high_rate`` it is raised at once to ``ceil(rate /
high_rate)`` replicas, and from then it is *managed*: its target is remembered in the state, replicas
the router added on demand count towards it, and lost ones are replaced. Below ``low_rate`` per
target replica for ``hold_s`` it is lowered by one replica, and the hold starts again, but never to
fewer than ``ceil(rate / high_rate)`` (so a lowering cannot itself trigger a raise), one, or its pin's
count. Once its target is down to that floor and no extra replica is left, it is no longer managed and
its remaining replica is left to the pods' own LRU. Targets are capped by ``max_replicas``, the number
of ready pods and the pods' spare room. A new replica goes to the pod the router would send the
adapter's overflow to (``conventions.pod_cost``: a free slot before an eviction, then the least load,
then the fewest extra replicas, then the id), one replica per adapter per round, hottest adapter first,
so that scarce room is shared. A released replica is the unpinned one on the busiest pod.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from control_plane.errors import ConfigError
from conventions.pod_cost import Weights


@dataclass(frozen=True)
class Policy:
    """When an adapter gets more replicas and when it loses them (rates in requests per second per replica)."""

    high_rate: float = 5.0
    low_rate: float = 1.0
    hold_s: float = 120.0
    max_replicas: int = 0  # most replicas of one adapter; 0 = every ready pod
    weights: Weights = Weights()

    def __post_init__(self) -> None:
        if not 0 < self.high_rate < math.inf:
            raise ConfigError(f"--replica-high-rate must be a positive number of requests/s, got {self.high_rate}")
        if not 0 <= self.low_rate < self.high_rate:
            raise ConfigError(f"--replica-low-rate must be >= 0 and below the high rate {self.high_rate} "
                              f"(the gap is the hysteresis), got {self.low_rate}")
        if not 0 <= self.hold_s < math.inf:
            raise ConfigError(f"--replica-hold must be >= 0 seconds, got {self.hold_s}")
        if self.max_replicas < 0:
            raise ConfigError(f"--max-replicas must be >= 0 (0 = every pod), got {self.max_replicas}")


@dataclass(frozen=True)
class PodLoad:
    """What the replica decision needs to know of one ready pod."""

    id: str
    capacity: int  # unpinned replicas of managed adapters it may hold (its room beside its pins)
    has_free_slot: bool = True
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV-cache blocks in use, 0..1


@dataclass(frozen=True)
class ReplicaState:
    """What one decision hands the next: the managed adapters' targets and hold timers."""

    targets: Mapping[str, int] = field(default_factory=dict)  # managed adapter -> replicas wanted
    low_since: Mapping[str, float] = field(default_factory=dict)  # adapter -> when it fell below low_rate


@dataclass(frozen=True)
class ReplicaPlan:
    """One decision: each managed adapter's target, the loads and releases that move towards it, and
    the state for the next call."""

    targets: dict[str, int]
    add: dict[str, tuple[str, ...]]  # adapter -> pods to pre-load it on (LoadAdapter, not pinned)
    release: dict[str, tuple[str, ...]]  # adapter -> pods to unload it from
    state: ReplicaState


def plan_replicas(rates: Mapping[str, float], holders: Mapping[str, Collection[str]], pins: Mapping[str, int],
                  pods: Sequence[PodLoad], policy: Policy, state: ReplicaState, now: float, *,
                  pinned_on: Mapping[str, Collection[str]] | None = None,
                  excluded: Collection[tuple[str, str]] = ()) -> ReplicaPlan:
    """The replica targets of hot adapters and the pods to load them on or release them from; see the
    module docstring for the rule. An adapter absent from both ``rates`` and ``holders`` is forgotten."""
    pinned_on = pinned_on or {}
    ready = {p.id: p for p in pods}
    held = {a: frozenset(h) & ready.keys() for a, h in holders.items()}
    cap = min(policy.max_replicas or len(ready), len(ready))
    everywhere = {a for a, n in pins.items() if n == 0}  # pinned on every pod: nothing to add
    names = sorted((set(state.targets) | {a for a, r in rates.items() if r > 0}) - everywhere,
                   key=lambda a: (-rates.get(a, 0.0), a))
    names = [a for a in names if a in rates or a in holders]

    targets: dict[str, int] = {}
    low_since: dict[str, float] = {}
    floors: dict[str, int] = {}  # one replica, or the pin's count (as far as there are pods)
    for a in names:
        rate, n = rates.get(a, 0.0), len(held.get(a, ()))
        floor = floors[a] = max(1, min(pins.get(a, 0), len(ready)))
        decided = _target(rate, n, state.targets.get(a), state.low_since.get(a), floor, policy, now)
        if decided is None:
            continue  # neither hot nor managed: its replicas are the pods' own business
        target, since = decided
        target = max(min(target, cap), floor)
        if target > floor or n > target:
            targets[a] = target
            if since is not None:
                low_since[a] = since

    def cost(pod: PodLoad) -> float:
        return policy.weights.load(pod.running, pod.waiting, pod.kv_usage)

    unpinned = {a: held.get(a, frozenset()) - frozenset(pinned_on.get(a, ())) for a in targets}
    used = {p: sum(p in unpinned[a] for a in targets) for p in ready}
    add: dict[str, list[str]] = {a: [] for a in targets}
    short = [a for a in targets if targets[a] > len(held.get(a, ()))]
    while short:  # round robin, hottest first: one new replica per adapter per round
        still = []
        for a in short:
            options = [p for p in ready.values() if p.id not in held.get(a, ()) and p.id not in add[a]
                       and (a, p.id) not in excluded and used[p.id] < p.capacity]
            if not options:
                targets[a] = len(held.get(a, ())) + len(add[a])  # as many as there is room for
                continue
            best = min(options, key=lambda p: (policy.weights.cold(p.has_free_slot) + cost(p), used[p.id], p.id))
            add[a].append(best.id)
            used[best.id] += 1
            if len(held.get(a, ())) + len(add[a]) < targets[a]:
                still.append(a)
        short = still

    release: dict[str, tuple[str, ...]] = {}
    for a, target in targets.items():
        extra = len(held.get(a, ())) - target
        if extra > 0:
            busiest = sorted((ready[p] for p in unpinned[a]), key=lambda p: (-cost(p), p.id))
            release[a] = tuple(sorted(p.id for p in busiest[:extra]))
    # An adapter stays managed while it has more than its floor, or replicas still to release (a pod
    # refuses to unload one in use; the release is decided again after the next hold).
    kept = {a: t for a, t in targets.items() if t > floors[a] or len(held.get(a, ())) > t}
    return ReplicaPlan(targets=kept, add={a: tuple(sorted(p)) for a, p in add.items() if p}, release=release,
                       state=ReplicaState(kept, {a: t for a, t in low_since.items() if a in kept}))


def _target(rate: float, n: int, previous: int | None, low_since: float | None, floor: int, policy: Policy,
            now: float) -> tuple[int, float | None] | None:
    """(replicas wanted, when the hold below low_rate started or None) for one adapter; None for an
    adapter that is neither managed nor hot."""
    needed = math.ceil(rate / policy.high_rate)  # fewest replicas that keep each at or under high_rate
    if previous is None:  # not managed: only a hot adapter becomes managed
        return (needed, None) if rate > policy.high_rate * max(n, 1) else None
    current = max(previous, n)  # replicas the router added on demand count too
    if needed > current:
        return needed, None
    if rate >= policy.low_rate * current:
        return current, None
    since = now if low_since is None else low_since
    if now - since < policy.hold_s:
        return current, since
    lowered = max(current - 1, needed, floor)
    return lowered, (now if lowered < current else None)
