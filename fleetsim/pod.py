"""One simulated data-plane pod: a disk tier, a CPU (host) tier and device slots, each LRU (the two upper ones
with pins), a waiting queue and a continuous batch whose step time follows the step model.

What it keeps of the real pod (data_plane/lora/adapter_cache.py, disk_tier.py, load_times.py,
data_plane/engine): an adapter's source is remote, so a load of one its disk tier (``DiskTier``) lacks
downloads it into the tier first; the pod
measures each move between tiers (``LoadTimes``, the real class) and reports them; every adapter in a slot
is in the CPU tier; a pinned adapter is in both and never evicted; an adapter serving a running
request keeps its slot; a request for an adapter on disk starts one load (later requests join it) whose
CPU entry is taken when the load starts; a waiting request runs once its adapter is in a slot and a seat
(``max_num_seqs``) is free, in arrival order, passing over requests whose adapter is not ready.
What it leaves out: prefill (a request is its decode steps), KV-block limits and preemption, admission
refusals (every request queues), and the scheduler's slot reservation (a slot goes to the least recently
used idle adapter).

The batch is simulated as a fluid: every running request advances one token per step, so between two
events the pod's step count grows at 1 / step_s, and the next completion is the running request with
the fewest steps left. Events come only at arrivals, download and load ends and completions. A step's time
depends on the batch, the distinct adapters in it and their ranks (``StepModel``).
"""

from __future__ import annotations

import enum
import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from data_plane.demand import DemandMeter
from data_plane.lora.load_times import LoadTimes
from fleetsim.config import REFERENCE_RANK, FleetConfig, adapter_bytes
from fleetsim.disk_tier import DiskTier


class InvariantViolated(AssertionError):
    """The simulated pod broke a promise the real one keeps (a bug in the simulator or a policy)."""


class Event(enum.IntEnum):
    """Kinds of pod events on the simulator's queue."""

    DISK_DONE = 1
    COPY_DONE = 2
    COMPLETE = 3
    DOWNLOAD_DONE = 4


class Arrival(enum.IntEnum):
    """Where a request's adapter was on its pod when the request arrived."""

    SLOT = 0  # in a ready slot
    HOST = 1  # in host memory, not in a slot
    LOADING = 2  # a load of it was under way
    COLD = 3  # nowhere in memory: the request started a load


@dataclass
class PodCounters:
    requests: int = 0
    device_hits: int = 0  # the adapter was in a ready slot when the request arrived
    cpu_hits: int = 0  # in the CPU tier only
    joined_loads: int = 0  # already loading from disk
    cold_loads: int = 0  # not in memory: this request started a load (from the disk tier, or a download first)
    downloads: int = 0  # downloads into the disk tier that loads started (requests' and the control plane's)
    prefetches: int = 0  # downloads the control plane asked for ahead of demand (PrefetchAdapter)
    preloads: int = 0  # disk loads the control plane asked for (pins)
    slot_copies: int = 0
    evictions: int = 0  # adapters dropped from the CPU tier
    tokens: int = 0
    peak_slots: int = 0
    peak_cpu: int = 0
    peak_running: int = 0


# (time, kind, pod index, payload); the simulator puts it on its queue
Schedule = Callable[[float, int, int, object], None]
# told when a request enters the batch, and when it completes: (request id, now)
Told = Callable[[int, float], None]


class SimPod:
    def __init__(self, index: int, config: FleetConfig, adapter_of: np.ndarray, tokens_of: np.ndarray,
                 names: tuple[str, ...], schedule: Schedule, admitted: Told, finished: Told,
                 rng: np.random.Generator, clock: Callable[[], float], rank_of: dict[str, int] | None = None) -> None:
        self.index = index
        self.id = f"pod-{index:03d}"
        self.config = config
        self._adapter_of, self._tokens_of, self._names = adapter_of, tokens_of, names
        self._schedule_event, self._admitted, self._finished, self._rng = schedule, admitted, finished, rng
        self.cpu: OrderedDict[str, bool] = OrderedDict()  # LRU first; False while its disk load runs
        self.slots: OrderedDict[str, bool] = OrderedDict()  # LRU first; False while its slot copy runs
        self.disk = DiskTier(config.disk_bytes, self._bytes)
        self._after_download: set[str] = set()  # host loads waiting for their download
        self._unkept: set[str] = set()  # downloads the full disk tier could not keep: straight to host memory
        self._rank = rank_of or {}
        self._rank_sum = 0  # ranks of the distinct adapters running, summed
        self.load_times = LoadTimes()
        self.pinned: set[str] = set()
        self.held: set[str] = set()  # pinned and in a ready slot since: must stay there until unpinned
        self.in_use: Counter[str] = Counter()  # adapter -> running requests
        self.wanted: Counter[str] = Counter()  # adapter -> waiting requests
        self.waiting: deque[int] = deque()  # request ids, in arrival order
        self._running: list[tuple[float, int]] = []  # heap of (step count it finishes at, request id)
        self._blocked: list[str] = []  # disk loads waiting for an evictable CPU entry
        self._steps = 0.0  # steps this pod has run, fluid
        self._last = 0.0
        self._step_s = config.step.step_s(0, 0)
        self._version = 0  # the completion event still current
        self.counters = PodCounters()
        self.demand = DemandMeter(config.demand_window_s, clock=clock)  # what its heartbeats report

    # ---- what routers read ------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def kv_usage(self) -> float:
        return len(self._running) / self.config.max_num_seqs

    # ---- events -----------------------------------------------------------------------------
    def arrive(self, rid: int, now: float) -> Arrival:
        """Request ``rid`` joins the queue; returns where its adapter was when it arrived."""
        self._advance(now)
        name = self._names[self._adapter_of[rid]]
        c = self.counters
        c.requests += 1
        self.demand.record(name)
        if self.slots.get(name):
            c.device_hits += 1
            found = Arrival.SLOT
        elif self.cpu.get(name):
            c.cpu_hits += 1
            found = Arrival.HOST
        elif name in self.cpu or name in self._blocked:
            c.joined_loads += 1
            found = Arrival.LOADING
        else:
            c.cold_loads += 1
            found = Arrival.COLD
            self._start_disk_load(name, now)
        self.wanted[name] += 1
        self.waiting.append(rid)
        self._run_scheduler(now)
        return found

    def handle(self, kind: int, payload: object, now: float) -> None:
        self._advance(now)
        if kind == Event.DISK_DONE:
            self.cpu[payload] = True
        elif kind == Event.COPY_DONE:
            self.slots[payload] = True
        elif kind == Event.COMPLETE:
            if payload != self._version:
                return
            self._complete(now)
        elif kind == Event.DOWNLOAD_DONE:
            self._downloaded(payload, now)
        self._run_scheduler(now)

    # ---- control plane commands -------------------------------------------------------------
    def load_and_pin(self, name: str, now: float) -> None:
        """LoadAdapter then PinAdapter: the adapter goes to the CPU tier and a slot, and stays."""
        if name not in self.pinned and len(self.pinned) >= min(self.config.slots, self.config.cpu_entries):
            raise InvariantViolated(f"{self.id}: pin of {name} past capacity {sorted(self.pinned)}")
        self._advance(now)
        self.pinned.add(name)
        if name not in self.cpu and name not in self._blocked:
            self.counters.preloads += 1
            self._start_disk_load(name, now)
        self._run_scheduler(now)

    def load(self, name: str, now: float) -> None:
        """LoadAdapter alone (an extra replica): the adapter goes to the CPU tier, unpinned."""
        if name not in self.cpu and name not in self._blocked:
            self._advance(now)
            self.counters.preloads += 1
            self._start_disk_load(name, now)
            self._run_scheduler(now)

    def prefetch(self, name: str, now: float) -> bool:
        """PrefetchAdapter: a download into the disk tier ahead of demand, only into free room (it never evicts a
        copy); False when skipped (already on disk or downloading, or no room)."""
        if name in self.disk or name in self._unkept or not self.disk.fits(name):
            return False
        self.counters.prefetches += 1
        self._download(name, now)
        return True

    def release(self, name: str) -> bool:
        """UnloadAdapter of an extra replica: refused (False) while it serves, waits or loads, or is pinned."""
        if name in self.pinned or self.in_use[name] or self.wanted[name] or not self.cpu.get(name):
            return False
        if self.slots.get(name) is False:
            return False
        self._drop(name)
        return True

    def unpin(self, name: str) -> None:
        self.pinned.discard(name)
        self.held.discard(name)

    def unload(self, name: str) -> None:
        """UnloadAdapter of a stale adapter; left alone while it serves, waits or loads."""
        if self.cpu.get(name) and not self.in_use[name] and not self.wanted[name] and self.slots.get(name) is not False:
            self.unpin(name)
            self._drop(name)

    # ---- internals ----------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        if self._running:
            self._steps += (now - self._last) / self._step_s
        self._last = now

    def _run_scheduler(self, now: float) -> None:
        if self._blocked:
            blocked, self._blocked = self._blocked, []
            for name in dict.fromkeys(blocked):
                self._start_disk_load(name, now)
        for name in self.pinned:
            if self.slots.get(name):
                self.held.add(name)
            elif self.cpu.get(name) and name not in self.slots:
                self._start_copy(name, now)
        seats = self.config.max_num_seqs - len(self._running)
        kept: list[int] = []
        scanned = 0
        while self.waiting and seats > 0 and scanned < self.config.scan_limit:
            rid = self.waiting.popleft()
            scanned += 1
            name = self._names[self._adapter_of[rid]]
            if self.slots.get(name):
                self._admit(rid, name)
                seats -= 1
                continue
            if self.cpu.get(name) and name not in self.slots:
                self._start_copy(name, now)
            kept.append(rid)
        self.waiting.extendleft(reversed(kept))
        self._plan_completion()

    def _admit(self, rid: int, name: str) -> None:
        if not self.in_use[name]:
            self._rank_sum += self._rank.get(name, REFERENCE_RANK)
        self.in_use[name] += 1
        self.wanted[name] -= 1
        if not self.wanted[name]:
            del self.wanted[name]
        self.slots.move_to_end(name)
        self.cpu.move_to_end(name)
        heapq.heappush(self._running, (self._steps + float(self._tokens_of[rid]), rid))
        self._admitted(rid, self._last)
        self.counters.peak_running = max(self.counters.peak_running, len(self._running))

    def _complete(self, now: float) -> None:
        while self._running and self._running[0][0] <= self._steps + 1e-6:
            _, rid = heapq.heappop(self._running)
            name = self._names[self._adapter_of[rid]]
            self.in_use[name] -= 1
            if not self.in_use[name]:
                del self.in_use[name]
                self._rank_sum -= self._rank.get(name, REFERENCE_RANK)
            self.counters.tokens += int(self._tokens_of[rid])
            self._finished(rid, now)

    def _plan_completion(self) -> None:
        self._step_s = self.config.step.step_s(len(self._running), len(self.in_use), self._rank_sum)
        self._version += 1
        if self._running:
            at = self._last + max(0.0, self._running[0][0] - self._steps) * self._step_s
            self._schedule_event(at, Event.COMPLETE, self.index, self._version)

    def _start_disk_load(self, name: str, now: float) -> None:
        if len(self.cpu) >= self.config.cpu_entries:
            victim = next((a for a, ready in self.cpu.items() if ready and a not in self.pinned and not self.in_use[a]
                           and not self.wanted[a] and self.slots.get(a) is not False), None)
            if victim is None:
                self._blocked.append(name)
                return
            self._drop(victim)
            self.counters.evictions += 1
        self.cpu[name] = False
        self.counters.peak_cpu = max(self.counters.peak_cpu, len(self.cpu))
        if self.disk.ready(name):
            self.disk.used_now(name)
            self._read(name, now)
            return
        self._after_download.add(name)
        if name not in self.disk and name not in self._unkept:
            self.counters.downloads += 1
            self._download(name, now)

    def _read(self, name: str, now: float) -> None:
        """Disk tier -> host memory: read and validate, the disk-to-slot time less the slot copy."""
        total, copy = self._draw(self.config.load.disk_to_slot_s), self._draw(self.config.load.cpu_to_slot_s)
        seconds = (total - copy) * self._scale(name)
        self.load_times.disk_to_host(seconds)
        self._schedule_event(now + seconds, Event.DISK_DONE, self.index, name)

    def _download(self, name: str, now: float) -> None:
        """Remote store -> disk tier (``DiskTier.reserve``); a copy the tier cannot keep goes to host memory
        without staying on disk."""
        if not self.disk.reserve(name):
            self._unkept.add(name)
        size = self._bytes(name)
        seconds = self.config.load.download_s(self._rank.get(name, REFERENCE_RANK))
        self.load_times.remote_to_disk(seconds, size)
        self._schedule_event(now + seconds, Event.DOWNLOAD_DONE, self.index, name)

    def _downloaded(self, name: str, now: float) -> None:
        if name in self._unkept:
            self._unkept.discard(name)
        else:
            self.disk.landed(name)
        if name in self._after_download:
            self._after_download.discard(name)
            self._read(name, now)

    def _scale(self, name: str) -> float:
        return self._rank.get(name, REFERENCE_RANK) / REFERENCE_RANK

    def _bytes(self, name: str) -> int:
        return adapter_bytes(self._rank.get(name, REFERENCE_RANK))


    def _start_copy(self, name: str, now: float) -> bool:
        if len(self.slots) >= self.config.slots:
            victim = next((a for a, ready in self.slots.items() if ready and a not in self.pinned
                           and not self.in_use[a]), None)
            if victim is None:
                return False
            del self.slots[victim]
        self.slots[name] = False
        self.cpu.move_to_end(name)
        self.counters.slot_copies += 1
        self.counters.peak_slots = max(self.counters.peak_slots, len(self.slots))
        seconds = self._draw(self.config.load.cpu_to_slot_s) * self._scale(name)
        self.load_times.host_to_slot(seconds)
        self._schedule_event(now + seconds, Event.COPY_DONE, self.index, name)
        return True

    def _drop(self, name: str) -> None:
        self.slots.pop(name, None)
        del self.cpu[name]

    def _draw(self, bounds: tuple[float, float]) -> float:
        return float(self._rng.uniform(*bounds))

    # ---- audit ------------------------------------------------------------------------------
    def check(self) -> None:
        """Raises InvariantViolated unless this pod keeps the real pod's promises."""
        cfg, problems = self.config, []
        if len(self.slots) > cfg.slots:
            problems.append(f"{len(self.slots)} adapters in {cfg.slots} slots")
        if len(self.cpu) > cfg.cpu_entries:
            problems.append(f"{len(self.cpu)} adapters in {cfg.cpu_entries} CPU entries")
        problems += self.disk.problems()
        if len(self._running) > cfg.max_num_seqs:
            problems.append(f"{len(self._running)} running with {cfg.max_num_seqs} seats")
        if not self.slots.keys() <= self.cpu.keys():
            problems.append(f"in a slot but not in the CPU tier: {sorted(self.slots.keys() - self.cpu.keys())}")
        if not self.held <= self.slots.keys():
            problems.append(f"pinned adapters lost their slot: {sorted(self.held - self.slots.keys())}")
        if not self.pinned <= self.cpu.keys() | set(self._blocked):
            problems.append(f"pinned adapters left the CPU tier: {sorted(self.pinned - self.cpu.keys())}")
        running = Counter(self._names[self._adapter_of[rid]] for _, rid in self._running)
        if running != self.in_use:
            problems.append("the in-use count disagrees with the running requests")
        if any(not self.slots.get(a) for a in running):
            problems.append(f"running without a ready slot: {sorted(a for a in running if not self.slots.get(a))}")
        waiting = Counter(self._names[self._adapter_of[rid]] for rid in self.waiting)
        if waiting != +self.wanted:
            problems.append("the waiting count disagrees with the queue")
        if problems:
            raise InvariantViolated(f"{self.id}: " + "; ".join(problems))
