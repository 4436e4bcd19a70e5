"""The routing score: which pods should serve a request for one adapter, best first. Pure.

A pod's cost is what the request would wait for there, in units of "one request already running":
the residency of its adapter (a device slot costs nothing, the CPU cache a copy into a slot, a free
slot a read of the weights, a full pod that read plus another adapter's eviction, and either of the last two
waits for a slot besides where every slot holds a pinned or serving adapter; an adapter with a remote
source that the pod's disk tier lacks adds its download, that cold cost again times what a download takes
on that pod against a read from its disk, as the pod measured both; a copy, read or download in proportion to
the adapter's bytes against the fleet's mean adapter's, by rank, ``FleetView.size``) plus the pod's load
(running and waiting requests, KV-cache pressure), plus the prefill of the part of the prompt the pod does
not hold in its prefix cache (by the routing-prefix chain, conventions/prefix_chain.py). So a device hit
wins until its pod is busier than a cold load is slow, and then the next pod takes the overflow; a pod
holding the prompt's beginning wins among pods about as loaded, and loses to one with a few fewer requests.

Then two bounds on load over that ranking (``bounded``; consistent hashing with bounded loads), each moving the
pods past it behind the others, so that the request goes to the next-best pod by cost. The share bound: a pod that
lately received more than (1 + epsilon) times the mean of the requests this router sent the pods (counted with a
decay, router/decayed.py) is past it; over minutes that share is the pod's share of the tokens decoded, since a
request's length does not depend on its pod. It moves only requests of an adapter that asks for a fair part of a
pod's traffic itself: a rarely used adapter is held by one pod, each of its requests moved would load it
elsewhere, and it cannot carry a pod past the bound alone. The bound on outstanding requests: where the best pod
would make the request wait, for an adapter slot (every slot serving or pinned) or for a seat (as many requests
running as it runs at once, ``max_num_seqs``), a pod whose requests running and waiting would pass (1 + epsilon)
times the mean is past it, since the wait there is longest. Where the best pod has a seat and a slot for the
request, its ranking stands: a request that would not wait is not moved by a momentary queue.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from conventions.pod_cost import Weights
from router.view import PodView, Tier

__all__ = ["LOAD_BOUND", "SHARE_BOUND", "SHARE_DECAY_S", "Choice", "Decision", "Weights", "bounded",
           "decision", "rank"]

# How far above the mean of the candidate pods' outstanding requests (a fraction) a pod may go before a request
# that would wait there for a slot or a seat goes to the next-best pod by cost: the shipped --load-bound. How far
# above the mean of the requests the router sent the pods lately one may go before an adapter's requests spill to
# the next: the shipped --share-bound. The fleet simulator (benchmarks/fleet_sim.py) measured both against the
# imbalance target of 1.2 (max / mean of tokens per pod) and the queue p99 of the peers (benchmarks/RESULTS.md,
# "Fleet simulation: a bound on the share of requests"; the seat: "Fleet simulation: the outstanding bound where a
# request would wait for a seat").
LOAD_BOUND = 0.2
SHARE_BOUND = 0.1
# The time constant of the share each pod and adapter had of the router's requests lately (router/decayed.py):
# long against a request (seconds) so that a pod's momentary queue does not move it, short against the drift of
# the hot adapters (minutes).
SHARE_DECAY_S = 30.0
# A pod with fewer outstanding requests than this is never past the bound, however idle the others: a step of
# a few sequences takes hardly longer than a step of one (9.64 ms for 1, 9.85 ms for 4 on the H100 the fleet
# simulator is fitted to), while a second copy of the adapter costs a load (0.4-1 s), a slot and a CPU entry.
# Without it a lightly loaded fleet would spread a cold adapter's first concurrent requests over as many pods.
_BOUND_FLOOR = 4
# Likewise a pod sent fewer than one request every two seconds lately (15 at a 30 s decay) is never past the share
# bound. The floor keeps a light fleet's adapters on one pod each; at one request a second the fleet simulator's
# bursty load (quiet spells at a third of the mean rate) was often all under it, and imbalance rose to 1.29 (1.15).
_SHARE_FLOOR = 0.5 * SHARE_DECAY_S
# An adapter whose own share of the router's requests is under this fraction of a pod's mean share keeps its
# ranking under the share bound. At a fifth, the fleet simulator's rarely used adapters kept their pods (at 1.5x
# the rate, 144.6 cold loads per 1,000 requests against 182.6 under the bound on outstanding requests alone) while
# hot ones spilled (imbalance 1.09-1.19).
_SPILL_SHARE = 0.2


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
    share: float = 0.0  # requests the router sent there lately, decayed (router/decayed.py)
    waits_for_slot: bool = False  # its adapter would wait there for a slot: every slot serving or pinned
    waits_for_seat: bool = False  # it would wait there for a seat: as many running as the pod runs at once

    @property
    def waits(self) -> bool:
        """Whether the request would wait there before its first step, for a slot or for a seat."""
        return self.waits_for_slot or self.waits_for_seat


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
         chain: Sequence[int] = (), remote_key: int | None = None,
         shares: Mapping[str, float] | None = None, size: float = 1.0) -> list[Choice]:
    """``pods`` best first for a request naming ``adapter`` ("" = the base model), cheapest cost first,
    ties by pod id. ``extra_running`` adds requests the router started on a pod since its state was read
    (negative when some finished); ``just_sent_to`` are pods this adapter was routed to moments ago;
    ``chain`` is the request's routing prefix (empty: a prompt shorter than one chunk); ``remote_key`` is the
    disk key of the adapter's registered weights when its source is remote (None: a local source); ``shares``
    are the requests the router sent each pod lately (``Choice.share``; missing: 0); ``size`` is how many times
    the fleet's mean adapter the adapter weighs (``FleetView.size``): its copies and loads take as much longer."""
    extra_running = extra_running or {}
    shares = shares or {}
    residency_cost = {Decision.BASE: 0.0, Decision.DEVICE_HIT: 0.0, Decision.CPU_HIT: weights.cpu_hit * size,
                      Decision.FREE_SLOT: weights.cold(True) * size, Decision.EVICT: weights.cold(False) * size}
    choices = []
    for pod in pods:
        d = decision(adapter, pod, pod.id in just_sent_to)
        running = max(0, pod.running + extra_running.get(pod.id, 0))
        load = weights.load(running, pod.waiting, pod.kv_usage)
        matched = pod.matched(chain) if weights.prefix else 0
        download = d in (Decision.FREE_SLOT, Decision.EVICT) and pod.must_download(remote_key)
        residency = residency_cost[d] * (1 + pod.load_times.download_factor() if download else 1)
        waits = d in (Decision.CPU_HIT, Decision.EVICT) and not pod.slot_takeable
        if waits:
            residency += weights.slot_wait  # every slot pinned or serving: it waits for one to go idle
        choices.append(Choice(pod, d, residency + load + weights.prefill(matched, len(chain)), matched, download,
                              running + pod.waiting, shares.get(pod.id, 0.0), waits, pod.seats_taken(running)))
    return sorted(choices, key=lambda c: (c.cost, c.pod.id))


def bounded(ranked: list[Choice], load_bound: float, share_bound: float = 0.0,
            adapter_share: float = math.inf) -> list[Choice]:
    """``ranked`` (best first) with the pods past either bound moved behind the others, each part in its order
    (consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam, 2018, over the cost's ranking).
    The pods weighed are those of the best pod's precision, the ones the request may be sent to
    (router/forwarder.py). With this request, each may hold:

    - when the best pod would make the request wait, for a slot or for a seat (``Choice.waits``),
      ``ceil((1 + load_bound) * (their outstanding requests + 1) / their number)``, never fewer than
      ``_BOUND_FLOOR``;
    - when ``adapter_share`` (the adapter's own requests lately, as ``Choice.share`` counts them) is at least
      ``_SPILL_SHARE`` of their mean share, ``(1 + share_bound) * (their shares + 1) / their number`` of the
      requests lately, never less than ``_SHARE_FLOOR``.

    One already at a bound is past it. Pods of another precision stay where they ranked, but never first: the
    first choice is the best pod of that precision within both bounds, so the bounds never change the precision
    a request is computed in; where every pod of it is past one bound or the other (each bound leaves its least
    loaded pod within), the ranking stays as it was. The pods offered are the same ones. A bound of 0: none."""
    if len(ranked) < 2:
        return ranked
    precision = ranked[0].pod.precision
    peers = [c for c in ranked if c.pod.precision == precision]
    past: set[str] = set()
    if load_bound > 0 and ranked[0].waits:
        cap = max(math.ceil((1 + load_bound) * (sum(c.outstanding for c in peers) + 1) / len(peers)), _BOUND_FLOOR)
        past.update(c.pod.id for c in peers if c.outstanding >= cap)
    shares = sum(c.share for c in peers)
    if share_bound > 0 and adapter_share >= _SPILL_SHARE * shares / len(peers):
        cap = max((1 + share_bound) * (shares + 1) / len(peers), _SHARE_FLOOR)
        past.update(c.pod.id for c in peers if c.share >= cap)
    kept = [c for c in ranked if c.pod.id not in past]
    first = next((c for c in kept if c.pod.precision == precision), None)
    if not past or first is None:
        return ranked
    return [first, *(c for c in kept if c is not first), *(c for c in ranked if c.pod.id in past)]
