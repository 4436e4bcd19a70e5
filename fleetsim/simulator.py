"""The event loop: a trace's requests arrive, the policy routes each to a pod, pods download and load adapters
and run their batches, the router's view is refreshed and the control plane reconciles on their intervals.
Seeded: the same trace, policy and seed give the same result."""

from __future__ import annotations

import enum
import hashlib
import heapq
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from control_plane.placement import Pin
from conventions.disk_key import disk_key
from fleetsim.config import FleetConfig
from fleetsim.control import ControlPlane
from fleetsim.pod import InvariantViolated, PodCounters, SimPod
from fleetsim.policies import Policy
from fleetsim.trace import Trace
from router.view import FleetView, LoadTimes, PodView, Tier


class FleetEvent(enum.IntEnum):
    """Fleet-wide events on the queue, beside the pods' own (fleetsim.pod.Event)."""

    VIEW = 10  # the router reads the fleet
    RECONCILE = 11  # the control plane's pass
    WARM = 12  # the warm-up ends: counters start


_DRAIN_LIMIT_S = 3600.0  # a request unfinished this long after the last arrival is stuck, not slow


@dataclass(frozen=True)
class SimResult:
    policy: str
    requests: int
    completed: int
    device_hit_rate: float  # requests whose adapter was in a ready slot of their pod on arrival
    cpu_hit_rate: float
    cold_per_1k: float  # loads into memory started by requests, per 1,000 requests
    downloads_per_1k: float  # downloads into a disk tier that loads started, per 1,000 requests
    prefetches: int  # downloads the control plane asked for ahead of demand
    preloads: int  # loads the control plane started (pins, extra replicas)
    copies_per_1k: float  # CPU tier -> slot copies per 1,000 requests
    queue_p50_ms: float  # arrival at the pod -> first step, adapter loads included
    queue_p99_ms: float
    imbalance: float  # max / mean of tokens decoded per pod
    peak_slots: int  # most slots any pod held at once
    peak_cpu: int
    pins_held: int  # (adapter, pod) pins held in a slot at the end
    pins_assigned: int
    sim_s: float
    wall_s: float


class Simulation:
    """One policy on one trace. The results count requests that arrive from ``warmup_s`` on, so that
    caches that start empty do not weigh on them. ``audit`` checks every pod's invariants after each of
    its events (InvariantViolated on the first broken one); it roughly doubles the run time."""

    def __init__(self, config: FleetConfig, trace: Trace, policy: Policy, pins: Sequence[Pin] = (), seed: int = 0,
                 warmup_s: float = 0.0, audit: bool = False) -> None:
        self.config, self.trace, self.policy, self.audit = config, trace, policy, audit
        self.warmup_s = warmup_s
        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, object]] = []
        self._seq = itertools.count()
        rng = np.random.default_rng(seed)
        rank_of = self._rank_of = dict(zip(trace.names, trace.ranks.tolist(), strict=True))
        self.pods = [SimPod(i, config, trace.adapters, trace.tokens, trace.names, self._push, self._admitted,
                            self._finished, np.random.default_rng(rng.integers(1 << 63)), self.clock, rank_of)
                     for i in range(config.pods)]
        self.routed = np.full(len(trace), -1, dtype=np.int64)
        self.queue_s = np.full(len(trace), np.nan)
        self.completed = np.zeros(len(trace), dtype=bool)
        self.arrived_as = np.full(len(trace), -1, dtype=np.int8)  # fleetsim.pod.Arrival of each request
        self.busy_at_arrival = np.zeros((len(trace), 2), dtype=np.int32)  # its pod's running, waiting then
        self._outstanding = 0
        self._all_adapters = frozenset(trace.names)
        # every adapter has a remote source; its weights' sha256 (here of its name) is its identity on disk
        self.sha256 = {name: hashlib.sha256(name.encode()).hexdigest() for name in trace.names}
        self._remote = {name: disk_key(sha) for name, sha in self.sha256.items()}
        self._view = self._read_view()
        policy.attach(self.pods, self.clock, lambda: self._view, np.random.default_rng(rng.integers(1 << 63)))
        self.control = ControlPlane(config, self.pods, trace.names, self.sha256, pins, policy.replication,
                                    policy.prefetch, self.clock)
        self._placed_by_policy: dict[str, tuple[int, ...]] = {}
        if policy.places_pins:
            self._placed_by_policy = policy.place_pins(pins)
            for adapter, pods in self._placed_by_policy.items():
                for i in pods:
                    self.pods[i].load_and_pin(adapter, 0.0)

    def clock(self) -> float:
        return self.now

    def run(self) -> SimResult:
        started = time.perf_counter()
        times, n = self.trace.times, len(self.trace)
        self._push(0.0, FleetEvent.VIEW, -1, None)
        if self.warmup_s > 0:
            self._push(self.warmup_s, FleetEvent.WARM, -1, None)
        if not self.policy.places_pins:
            self._push(0.0, FleetEvent.RECONCILE, -1, None)
        i = 0
        while i < n or self._heap:
            if self._heap and (i >= n or self._heap[0][0] <= times[i]):
                self.now, _, kind, pod, payload = heapq.heappop(self._heap)
                self._handle(kind, pod, payload)
            else:
                self.now = float(times[i])
                self._arrive(i)
                i += 1
            if i >= n and not self._outstanding:
                break  # what is left on the queue are the periodic passes and superseded completions
            if i >= n and self.now > times[-1] + _DRAIN_LIMIT_S:
                raise InvariantViolated(f"{self._outstanding} requests still unfinished {_DRAIN_LIMIT_S:.0f} s "
                                        "after the last arrival")
        return self._result(time.perf_counter() - started)

    # ---- events -------------------------------------------------------------------------------
    def _push(self, at: float, kind: int, pod: int, payload: object) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, pod, payload))

    def _arrive(self, rid: int) -> None:
        name = self.trace.names[self.trace.adapters[rid]]
        pod = self.policy.route(name)
        if not 0 <= pod < len(self.pods):
            raise InvariantViolated(f"policy {self.policy.name} routed request {rid} to pod {pod}, not in the fleet")
        self.routed[rid] = pod
        self._outstanding += 1
        self.policy.started(pod, name)
        self.busy_at_arrival[rid] = self.pods[pod].running, len(self.pods[pod].waiting)
        self.arrived_as[rid] = self.pods[pod].arrive(rid, self.now)
        if self.audit:
            self.pods[pod].check()

    def _handle(self, kind: int, pod: int, payload: object) -> None:
        if kind == FleetEvent.VIEW:
            self._view = self._read_view()
            self._push(self.now + self.config.view_interval_s, FleetEvent.VIEW, -1, None)
        elif kind == FleetEvent.RECONCILE:
            self.control.reconcile(self.now)
            self._push(self.now + self.config.reconcile_interval_s, FleetEvent.RECONCILE, -1, None)
            if self.audit:
                for p in self.pods:
                    p.check()
        elif kind == FleetEvent.WARM:
            for p in self.pods:
                p.counters = PodCounters(peak_slots=p.counters.peak_slots, peak_cpu=p.counters.peak_cpu,
                                         peak_running=p.counters.peak_running)
        else:
            self.pods[pod].handle(kind, payload, self.now)
            if self.audit:
                self.pods[pod].check()

    def _admitted(self, rid: int, now: float) -> None:
        if not math.isnan(self.queue_s[rid]):
            raise InvariantViolated(f"request {rid} entered a batch twice")
        self.queue_s[rid] = now - self.trace.times[rid]

    def _finished(self, rid: int, now: float) -> None:
        if self.completed[rid]:
            raise InvariantViolated(f"request {rid} completed twice")
        self.completed[rid] = True
        self._outstanding -= 1
        self.policy.finished(int(self.routed[rid]))

    def _read_view(self) -> FleetView:
        """What the router's refresher reads: each pod's GetState (slots, residency, disk tier, measured load
        times, load, seats) and the registry's remote adapters, as ``router.view.build_view`` makes them."""
        return FleetView(self._all_adapters, tuple(
            PodView(p.id, f"{p.id}:1", slots_total=self.config.slots, slots_used=len(p.slots),
                    slots_busy=sum(1 for name in p.slots if name in p.pinned or p.in_use[name]),
                    residency={name: Tier.DEVICE if p.slots.get(name) else Tier.CPU
                               for name, ready in p.cpu.items() if ready},
                    running=p.running, waiting=len(p.waiting), seats=self.config.max_num_seqs, kv_usage=p.kv_usage,
                    disk=p.disk.keys(self._remote), load_times=self._load_times(p))
            for p in self.pods), self.now, remote=self._remote,
            ranks={name: self._rank_of[name] for p in self.pods for name, ready in p.cpu.items() if ready})

    @staticmethod
    def _load_times(pod: SimPod) -> LoadTimes:
        now = pod.load_times.now()
        return LoadTimes(now.host_to_slot_s, now.disk_to_host_s, now.remote_to_disk_s)

    # ---- results ------------------------------------------------------------------------------
    def pins_now(self) -> tuple[int, int]:
        """(pins held in a slot, pins assigned): per (adapter, pod) the placement asked for."""
        if self.policy.places_pins:
            assigned = {(a, self.pods[i].id) for a, pods in self._placed_by_policy.items() for i in pods}
        else:
            assigned = {(a, pod) for a, pods in self.control.assigned.items() for pod in pods}
        by_id = {p.id: p for p in self.pods}
        return sum(1 for a, pod in assigned if a in by_id[pod].held), len(assigned)

    def _result(self, wall_s: float) -> SimResult:
        c = [p.counters for p in self.pods]
        n = max(1, sum(x.requests for x in c))
        counted = self.trace.times >= self.warmup_s
        delays = self.queue_s[counted & ~np.isnan(self.queue_s)]
        p50, p99 = (np.percentile(delays, [50, 99]) * 1000).tolist() if len(delays) else (math.nan, math.nan)
        tokens = np.array([x.tokens for x in c], dtype=np.float64)
        held, assigned = self.pins_now()
        return SimResult(
            policy=self.policy.name, requests=int(counted.sum()), completed=int(self.completed[counted].sum()),
            device_hit_rate=sum(x.device_hits for x in c) / n, cpu_hit_rate=sum(x.cpu_hits for x in c) / n,
            cold_per_1k=1000 * sum(x.cold_loads for x in c) / n,
            downloads_per_1k=1000 * sum(x.downloads for x in c) / n, prefetches=sum(x.prefetches for x in c),
            preloads=sum(x.preloads for x in c),
            copies_per_1k=1000 * sum(x.slot_copies for x in c) / n, queue_p50_ms=p50, queue_p99_ms=p99,
            imbalance=float(tokens.max() / tokens.mean()) if tokens.mean() > 0 else math.nan,
            peak_slots=max(x.peak_slots for x in c), peak_cpu=max(x.peak_cpu for x in c),
            pins_held=held, pins_assigned=assigned, sim_s=self.now, wall_s=wall_s)
