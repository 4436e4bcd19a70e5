"""The routing score: which pods should serve a request for one adapter, best first. Pure.

A pod's cost is what the request would wait for there, in units of "one request already running":
the residency of its adapter (a device slot costs nothing, the CPU cache a copy into a slot, a free
slot a read of the weights, a full pod that read plus another adapter's eviction, and either of the last two
waits for a slot besides where every slot holds a pinned or serving adapter; an adapter with a remote
source that the pod's disk tier lacks adds its download, that cold cost again times what a download takes
on that pod against a read from its disk, as the pod measured both) plus the pod's load
(running and waiting requests, KV-cache pressure), plus the prefill of the part of the prompt the pod does
not hold in its prefix cache (by the routing-prefix chain, conventions/prefix_chain.py). So a device hit
wins until its pod is busier than a cold load is slow, and then the next pod takes the overflow; a pod
holding the prompt's beginning wins among pods about as loaded, and loses to one with a few fewer requests.

Then a bound on load (``bounded``): a pod whose outstanding requests would pass (1 + epsilon) times the mean of
the pods that could take the request goes behind the others, so a hot adapter's requests spill to the next-best
pod by cost instead of piling onto the pods that hold it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from conventions.pod_cost import Weights
from router.view import PodView, Tier

__all__ = ["LOAD_BOUND", "Choice", "Decision", "Weights", "bounded", "decision", "rank"]

# How far above the mean of the candidate pods' outstanding requests a pod may go (a fraction) before the
# next-best pod by cost takes a request: the shipped --load-bound. The fleet simulator (benchmarks/fleet_sim.py)
# measured it against the imbalance target of 1.2 (max / mean of tokens per pod; benchmarks/RESULTS.md,
# "Fleet simulation: a bound on load").
LOAD_BOUND = 0.2
# A pod with fewer outstanding requests than this is never past the bound, however idle the others: a step of
# a few sequences takes hardly longer than a step of one (9.64 ms for 1, 9.85 ms for 4 on the H100 the fleet
# simulator is fitted to), while a second copy of the adapter costs a load (0.4-1 s), a slot and a CPU entry.
# Without it a lightly loaded fleet would spread a cold adapter's first concurrent requests over as many pods.
_BOUND_FLOOR = 4


class Decision(Enum):
    """What serving a request on a pod implies for its adapter."""

    BASE = "base"  # no adapter: every pod is equally warm
    DEVICE_HIT = "device_hit"
    CPU_HIT = "cpu_hit"
    FREE_SLOT = "free_slot"  # not resident; loads into a free slot
    EVICT = "evict"  # not resident; loads and evicts another adapter

    @property
    def label(self) -> str:
        """The routing-decision metric's label: base, device_hit, cpu_hit or cold."""
        return "cold" if self in (Decision.FREE_SLOT, Decision.EVICT) else self.value


@dataclass(frozen=True)
class Choice:
    pod: PodView
    decision: Decision
    cost: float
    matched: int = 0  # routing-prefix chunks of the request the pod holds from the start
    download: bool = False  # a cold load there downloads the adapter first (its disk tier lacks it)
    outstanding: int = 0  # requests running and waiting there, with those the router started since its read


def decision(adapter: str, pod: PodView, just_sent: bool = False) -> Decision:
    """What serving ``adapter`` on ``pod`` implies; ``just_sent`` counts a request the router sent
    there moments ago, whose load the pod's state may not show yet, as a CPU hit."""
    if not adapter:
        return Decision.BASE
    tier = pod.tier(adapter)
    if tier == Tier.DEVICE:
        return Decision.DEVICE_HIT
    if tier == Tier.CPU or just_sent:
        return Decision.CPU_HIT
    return Decision.FREE_SLOT if pod.has_free_slot else Decision.EVICT


def rank(adapter: str, pods: Collection[PodView], weights: Weights = Weights(),
         extra_running: Mapping[str, int] | None = None, just_sent_to: Collection[str] = (),
         chain: Sequence[int] = (), remote_key: int | None = None) -> list[Choice]:
    """``pods`` best first for a request naming ``adapter`` ("" = the base model), cheapest cost first,
    ties by pod id. ``extra_running`` adds requests the router started on a pod since its state was read
    (negative when some finished); ``just_sent_to`` are pods this adapter was routed to moments ago;
    ``chain`` is the request's routing prefix (empty: a prompt shorter than one chunk); ``remote_key`` is the
    disk key of the adapter's registered weights when its source is remote (None: a local source)."""
    extra_running = extra_running or {}
    residency_cost = {Decision.BASE: 0.0, Decision.DEVICE_HIT: 0.0, Decision.CPU_HIT: weights.cpu_hit,
                      Decision.FREE_SLOT: weights.cold(True), Decision.EVICT: weights.cold(False)}
    choices = []
    for pod in pods:
        d = decision(adapter, pod, pod.id in just_sent_to)
        running = max(0, pod.running + extra_running.get(pod.id, 0))
        load = weights.load(running, pod.waiting, pod.kv_usage)
        matched = pod.matched(chain) if weights.prefix else 0
        download = d in (Decision.FREE_SLOT, Decision.EVICT) and pod.must_download(remote_key)
        residency = residency_cost[d] * (1 + pod.load_times.download_factor() if download else 1)
        if d in (Decision.CPU_HIT, Decision.EVICT) and not pod.slot_takeable:
            residency += weights.slot_wait  # every slot pinned or serving: it waits for one to go idle
        choices.append(Choice(pod, d, residency + load + weights.prefill(matched, len(chain)), matched, download,
                              running + pod.waiting))
    return sorted(choices, key=lambda c: (c.cost, c.pod.id))


def bounded(ranked: list[Choice], epsilon: float) -> list[Choice]:
    """``ranked`` (best first) with the pods past the load bound moved behind the others, each part in its
    order: consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018) over the cost's
    ranking. The pods weighed are those of the best pod's precision, the ones the request may be sent to
    (router/forwarder.py); each may hold ``ceil((1 + epsilon) * (their outstanding requests + 1) / their
    number)`` with this request, and never fewer than ``_BOUND_FLOOR``; one already at that bound is past it.
    Pods of another precision stay where they ranked, but never first: the first choice is the best pod of that
    precision within the bound (the least loaded always is), so the bound never changes the precision a request
    is computed in. The pods offered are the same ones (a pod without adapter slots was never among them).
    ``epsilon`` 0: no bound."""
    if epsilon <= 0 or len(ranked) < 2:
        return ranked
    precision = ranked[0].pod.precision
    peers = [c.outstanding for c in ranked if c.pod.precision == precision]
    cap = max(math.ceil((1 + epsilon) * (sum(peers) + 1) / len(peers)), _BOUND_FLOOR)

    def past(c: Choice) -> bool:
        return c.pod.precision == precision and c.outstanding >= cap

    kept = [c for c in ranked if not past(c)]
    first = next(c for c in kept if c.pod.precision == precision)
    return [first, *(c for c in kept if c is not first), *(c for c in ranked if past(c))]
