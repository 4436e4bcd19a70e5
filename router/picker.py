"""Chooses pods for a request from the latest FleetView plus what this router did since that view was
read: requests it started or finished on each pod, adapters it just sent somewhere, pods that just
refused a connection or said they are full. All local; no call leaves the process."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

from router.decayed import DecayedCounts
from router.errors import AdapterNotRegistered, NoPodAvailable
from router.scoring import LOAD_BOUND, SHARE_BOUND, SHARE_DECAY_S, Choice, Weights, bounded, rank
from router.view import FleetView

# How long a pod counts an adapter the router just sent it as resident: long enough for the load to
# finish and show up in the pod's state, short enough that an eviction since is soon believed.
_JUST_SENT_S = 5.0
# How long a pod that refused a request as full without a retry hint goes last in the ranking.
_FULL_WITHOUT_HINT_S = 1.0


class PodPicker:
    """Ranks the routable pods for an adapter; ``view`` returns the latest FleetView or None. ``load_bound``
    and ``share_bound`` are the bounds' epsilons (router/scoring.py, ``bounded``; 0: none)."""

    def __init__(self, view: Callable[[], FleetView | None], weights: Weights | None = None,
                 clock: Callable[[], float] = time.monotonic, load_bound: float = LOAD_BOUND,
                 share_bound: float = SHARE_BOUND) -> None:
        self._view = view
        self._weights = weights or Weights()
        self._load_bound = load_bound
        self._share_bound = share_bound
        # the requests this router sent each pod, and for each adapter, lately: the share bound's measure
        self._pod_shares = DecayedCounts(SHARE_DECAY_S)
        self._adapter_shares = DecayedCounts(SHARE_DECAY_S)
        self._clock = clock  # monotonic seconds; the fleet simulator passes its own
        self._inflight: Counter[str] = Counter()  # pod -> requests this router is forwarding there now
        self._baseline: Counter[str] = Counter()  # _inflight when the current view was first used
        self._seen: FleetView | None = None
        # adapter -> pod -> monotonic time last routed; keyed by adapter first so that a request looks
        # only at its own adapter's entries, however many adapters the router has seen
        self._sent: dict[str, dict[str, float]] = {}
        self._sent_count = 0  # entries in _sent, expired ones included
        self._suspect: dict[str, float] = {}  # pod -> monotonic time it refused a connection
        self._full_until: dict[str, float] = {}  # pod -> monotonic time until which it said it is full

    @property
    def weighs_prefixes(self) -> bool:
        """Whether a request's routing prefix counts in its ranking (a prefix weight above 0)."""
        return self._weights.prefix > 0

    def choose(self, adapter: str, chain: Sequence[int] = ()) -> list[Choice]:
        """The routable pods for ``adapter`` ("" = base model), best first, for a request whose routing prefix
        is ``chain``. AdapterNotRegistered for an adapter the registry lacks; NoPodAvailable when no pod is
        routable."""
        view = self._view()
        if view is None:
            raise NoPodAvailable("the router has not read the fleet's state yet; retry in a moment")
        if adapter and adapter not in view.adapters:
            raise AdapterNotRegistered(f"adapter {adapter!r} is not registered; register it with "
                                       "`lorafleet adapters register`, or send an empty adapter for the base model")
        if view is not self._seen:
            self._seen, self._baseline = view, Counter(self._inflight)
        # A pod that refused a connection is left out until a view read after the refusal says otherwise.
        pods = [p for p in view.pods if self._suspect.get(p.id, float("-inf")) < view.read_at] if self._suspect \
            else view.pods
        if not pods:
            raise NoPodAvailable("no data-plane pod is ready to serve; check `lorafleet pods` and the pods' logs")
        if adapter:  # a pod started without LoRA (--no-enable-lora) has no adapter slot: the base model only
            pods = [p for p in pods if p.slots_total > 0]
            if not pods:
                raise NoPodAvailable(f"no ready pod serves adapters (each was started with --no-enable-lora); send "
                                     f"the request without adapter {adapter!r}, or start pods with LoRA")
        now = self._clock()
        just_sent = {pod for pod, at in self._sent.get(adapter, {}).items() if now - at < _JUST_SENT_S}
        # only the pods whose count moved since the view was read (most do not, in a large fleet)
        extra = {pod: n - self._baseline[pod] for pod, n in self._inflight.items() if n != self._baseline[pod]}
        shares = {pod.id: self._pod_shares.get(pod.id, now) for pod in pods} if self._share_bound > 0 else None
        ranked = bounded(rank(adapter, pods, self._weights, extra, just_sent, chain, view.remote.get(adapter), shares,
                              view.size(adapter)),
                         self._load_bound, self._share_bound, self._adapter_shares.get(adapter, now))
        if not any(until > now for until in self._full_until.values()):
            return ranked
        # pods that said they are full go last, in rank order, for as long as they said
        return sorted(ranked, key=lambda choice: self._full_until.get(choice.pod.id, 0.0) > now)

    def started(self, pod: str, adapter: str) -> None:
        """A request for ``adapter`` was sent to ``pod``."""
        self._inflight[pod] += 1
        now = self._clock()
        self._pod_shares.add(pod, now)
        self._adapter_shares.add(adapter, now)  # "" counts the base model's requests alike
        if adapter:
            pods = self._sent.setdefault(adapter, {})
            self._sent_count += pod not in pods
            pods[pod] = now
            if self._sent_count > 4096:  # forget expired entries now and then, so the map stays small
                self._sent = {name: fresh for name, sent in self._sent.items()
                              if (fresh := {p: at for p, at in sent.items() if now - at < _JUST_SENT_S})}
                self._sent_count = sum(map(len, self._sent.values()))

    def finished(self, pod: str) -> None:
        """A request sent to ``pod`` ended, however it ended."""
        self._inflight[pod] -= 1

    def refused(self, pod: str) -> None:
        """``pod`` could not be reached; route around it until the next state read."""
        self._suspect[pod] = self._clock()

    def pushed_back(self, pod: str, retry_after_s: float | None) -> None:
        """``pod`` refused a request as full and asked for ``retry_after_s`` (None: no hint); rank it last
        until then."""
        self._full_until[pod] = self._clock() + (_FULL_WITHOUT_HINT_S if retry_after_s is None else retry_after_s)
