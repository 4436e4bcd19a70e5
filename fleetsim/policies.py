"""Routing policies on the same simulated pods: ours is the router's real PodPicker over a FleetView the
simulator refreshes as the router's refresher does; the peers' are written from their published rules.

The peers read each pod's live state at every request (running and waiting requests, the adapters of
both): an advantage over ours, which reads a view refreshed every ``view_interval_s`` plus its own count
of the requests it started and finished since, as the real router does.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import numpy as np

from control_plane.config import ControlPlaneConfig
from control_plane.placement import Pin
from control_plane.prefetch import Prefetch
from control_plane.replication import Policy as ReplicaPolicy
from conventions.pod_cost import Weights
from fleetsim.config import shipped
from fleetsim.pod import SimPod
from router.config import RouterConfig
from router.picker import PodPicker
from router.view import FleetView


class Policy(abc.ABC):
    """Picks a pod for each request. ``places_pins``: the policy places pinned adapters itself
    (``place_pins``) instead of the control plane's placement; ``replication``: the control plane's
    replica thresholds when it runs replicas that follow popularity (None: it does not); ``prefetch``: the
    control plane's prefetch settings when it prefetches adapters to pods' disks (None: it does not)."""

    name = ""
    places_pins = False
    replication: ReplicaPolicy | None = None
    prefetch: Prefetch | None = None

    def attach(self, pods: Sequence[SimPod], clock: Callable[[], float], view: Callable[[], FleetView],
               rng: np.random.Generator) -> None:
        self.pods, self.clock, self.view, self.rng = pods, clock, view, rng

    @abc.abstractmethod
    def route(self, adapter: str) -> int:
        """The index of the pod a request for ``adapter`` goes to."""

    def started(self, pod: int, adapter: str) -> None:  # noqa: B027 (an optional hook)
        """A request for ``adapter`` went to ``pod``."""

    def finished(self, pod: int) -> None:  # noqa: B027 (an optional hook)
        """A request sent to ``pod`` completed."""

    def place_pins(self, pins: Sequence[Pin]) -> dict[str, tuple[int, ...]]:
        """Adapter -> indexes of the pods it is pinned on; only called when ``places_pins``."""
        raise TypeError(f"{self.name} leaves pin placement to the control plane")

    def _least_requests(self, pods: Sequence[SimPod]) -> int:
        """The pod with the fewest running plus waiting requests, ties at random."""
        loads = [p.running + len(p.waiting) for p in pods]
        low = min(loads)
        best = [p for p, load in zip(pods, loads, strict=True) if load == low]
        return best[int(self.rng.integers(len(best)))].index if len(best) > 1 else best[0].index


def shipped_replication() -> ReplicaPolicy:
    """The replica thresholds the control plane ships with (its --replica-* defaults)."""
    return ReplicaPolicy(*(shipped(ControlPlaneConfig, f) for f in ("replica_high_rate", "replica_low_rate",
                                                                      "replica_hold", "max_replicas")))


def shipped_prefetch() -> Prefetch:
    """The prefetch settings the control plane ships with (its --prefetch-* defaults)."""
    return Prefetch(shipped(ControlPlaneConfig, "prefetch_rate"), shipped(ControlPlaneConfig, "prefetch_per_pass"))


class Ours(Policy):
    """The router's PodPicker (router/picker.py, router/scoring.py) on the simulator's clock, over the pods'
    residency, disk tiers and measured load times, with its bounds on load at ``load_bound`` and ``share_bound``
    (the shipped ``--load-bound`` and ``--share-bound`` unless given; 0 for both: the cost's ranking alone); pins
    are placed by the control plane's
    reconcile pass (control_plane/placement.py, control_plane/plan.py); with ``replicas`` (as shipped) hot
    adapters get extra replicas (control_plane/replicator.py), and the control plane prefetches rising remote
    adapters and pins' standby copies to pods' disks (control_plane/prefetch.py, plan.prefetch_actions) as
    shipped."""

    def __init__(self, weights: Weights | None = None, replicas: bool = True,
                 replication: ReplicaPolicy | None = None, load_bound: float | None = None,
                 share_bound: float | None = None) -> None:
        self.weights = weights
        self.load_bound = shipped(RouterConfig, "load_bound") if load_bound is None else load_bound
        self.share_bound = shipped(RouterConfig, "share_bound") if share_bound is None else share_bound
        self.replication = (replication or shipped_replication()) if replicas else None
        self.prefetch = shipped_prefetch()
        self.name = "ours" if replicas else "ours-no-replicas"

    def attach(self, pods, clock, view, rng) -> None:
        super().attach(pods, clock, view, rng)
        self._index = {p.id: p.index for p in pods}
        self._picker = PodPicker(view, self.weights, clock=clock, load_bound=self.load_bound,
                                 share_bound=self.share_bound)

    def route(self, adapter: str) -> int:
        return self._index[self._picker.choose(adapter)[0].pod.id]

    def started(self, pod: int, adapter: str) -> None:
        self._picker.started(self.pods[pod].id, adapter)

    def finished(self, pod: int) -> None:
        self._picker.finished(self.pods[pod].id)


class RoundRobin(Policy):
    """What a Kubernetes Service does: each pod in turn, blind to adapters and load (kube-proxy's IPVS ``rr``
    scheduler; its default iptables mode picks a pod at random, which spreads requests alike)."""

    name = "round-robin"

    def attach(self, pods, clock, view, rng) -> None:
        super().attach(pods, clock, view, rng)
        self._next = 0

    def route(self, adapter: str) -> int:
        self._next = (self._next + 1) % len(self.pods)
        return self._next


class LeastLoaded(Policy):
    """The pod with the fewest running plus waiting requests, blind to adapters, ties at random: AIBrix's
    least-request router (vllm-project/aibrix, pkg/plugins/gateway/algorithms/least_request.go,
    ``selectTargetPodWithLeastRequestCount``: the requests the gateway has in flight on each pod)."""

    name = "least-loaded"

    def route(self, adapter: str) -> int:
        return self._least_requests(self.pods)


class GatewayLoraAffinity(Policy):
    """The Gateway API inference extension's endpoint picker with its LoRA-affinity scorer, as published in
    kubernetes-sigs/gateway-api-inference-extension:

    - LoRA affinity (pkg/epp/scheduling/framework/plugins/loraaffinityscorer/lora_affinity.go, ``Score``): 1.0
      when the adapter is among the pod's active (running) adapters, else 0.8 when its active plus waiting
      adapters are fewer than ``MaxActiveModels`` (vLLM's ``max_lora``: the pod's slots), else 0.6 when the
      adapter is among its waiting ones, else 0;
    - queue (pkg/epp/scheduling/framework/plugins/scorer/queue.go): (max - queue) / (max - min) of the
      candidates' waiting-queue sizes, 1 for all when they are equal;
    - KV cache (scorer/kvcache_utilization.go): 1 - the pod's KV-cache usage;
    - weights: every scorer the profile names without a weight weighs ``DefaultScorerWeight`` = 1
      (pkg/epp/config/loader/defaults.go), as in the repository's own EPP integration test profile, which names
      queue, KV-cache, prefix-cache and LoRA-affinity scorers without weights (test/integration/epp/harness.go). The
      chart's default profile (config/charts/inferencepool/templates/epp-config.yaml: queue 2, KV cache 2,
      prefix cache 3) has no LoRA scorer at all, so it would route as least-loaded does; its prefix-cache
      scorer scores every pod alike here (no prompts), so it is left out;
    - picker (plugins/picker/max_score_picker.go): the highest weighted sum, ties at random.
    Its metrics are scraped every 50 ms; here it reads every pod's live state, an advantage."""

    name = "gateway-lora-affinity"

    def route(self, adapter: str) -> int:
        queues = [len(p.waiting) for p in self.pods]
        low, span = min(queues), max(queues) - min(queues)
        best, best_score = [], -1.0
        for pod, queue in zip(self.pods, queues, strict=True):
            if pod.in_use[adapter]:
                lora = 1.0
            elif len(pod.in_use) + sum(1 for a in pod.wanted if a not in pod.in_use) < pod.config.slots:
                lora = 0.8
            elif pod.wanted[adapter]:
                lora = 0.6
            else:
                lora = 0.0
            score = lora + (1.0 - (queue - low) / span if span else 1.0) + (1.0 - pod.kv_usage)
            if score > best_score + 1e-12:
                best, best_score = [pod.index], score
            elif score > best_score - 1e-12:
                best.append(pod.index)
        return best[int(self.rng.integers(len(best)))] if len(best) > 1 else best[0]


class AIBrix(Policy):
    """AIBrix (vllm-project/aibrix), its placement and its lora-affinity router as published:

    - placement (pkg/controller/modeladapter/scheduling/leastadapters.go, ``SelectPod``): each pinned adapter's
      replica goes to the pod with the fewest adapters placed so far (the first such pod in list order);
    - routing (pkg/plugins/gateway/algorithms/lora_affinity.go, ``Route``): the pods where the adapter is among
      the running or waiting adapters (vLLM's ``lora_requests_info`` labels) are the affinity group, the pods
      with room for another adapter the available group; with probability ``loraAffinityThreshold`` (0.999)
      the affinity group when both have pods, else whichever has any; within it the pod with the fewest
      requests the gateway has in flight there (``selectTargetPodWithLeastRequestCount``, ties at random); a
      random ready pod when both groups are empty.
    - the room check as published (``evaluatePodForLoraAffinity``): ``maxAdapters`` is read from the
      ``WaitingLoraAdapters`` metric, not ``MaxLora``, and ``strconv.Atoi`` of its label (a comma-separated
      list of adapter names) fails to 0, so ``running + waiting < 0`` never holds and the available group is
      always empty. With ``room_check=False`` (the default, the code as it is) a request goes to a pod that
      runs or queues its adapter whenever there is one, else to a random pod; ``room_check=True`` models the
      intended check (the pod's slots) for comparison.
    Its metrics are refreshed every 50 ms; here it reads every pod's live state, an advantage."""

    name = "aibrix"
    places_pins = True

    def __init__(self, affinity: float = 0.999, room_check: bool = False) -> None:
        self.affinity = affinity
        self.room_check = room_check
        if room_check:
            self.name = "aibrix-room-check"

    def route(self, adapter: str) -> int:
        near, free = [], []
        for pod in self.pods:
            if pod.in_use[adapter] or pod.wanted[adapter]:
                near.append(pod)
            elif self.room_check and (len(pod.in_use) + sum(1 for a in pod.wanted if a not in pod.in_use)
                                      < pod.config.slots):
                free.append(pod)
        if near and free:
            group = near if self.rng.random() < self.affinity else free
        else:
            group = near or free
        if not group:
            return int(self.rng.integers(len(self.pods)))
        return self._least_requests(group)

    def place_pins(self, pins: Sequence[Pin]) -> dict[str, tuple[int, ...]]:
        placed = [0] * len(self.pods)
        chosen = {}
        for pin in sorted(pins, key=lambda p: p.adapter):
            want = pin.replicas or len(self.pods)
            pods = sorted(range(len(self.pods)), key=lambda i: (placed[i], i))[:want]
            for i in pods:
                placed[i] += 1
            chosen[pin.adapter] = tuple(sorted(pods))
        return chosen


POLICIES: dict[str, Callable[[], Policy]] = {
    **{p.name: p for p in (RoundRobin, LeastLoaded, AIBrix, GatewayLoraAffinity)},
    "aibrix-room-check": lambda: AIBrix(room_check=True),
    "ours-no-replicas": lambda: Ours(replicas=False),
    "ours": Ours,
}
