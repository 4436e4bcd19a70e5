"""Two LRU tiers of adapters with pinning: host memory (``max_cpu_loras``) and compute-device
slots (``max_loras``).

Invariants: every adapter in a slot is also in the CPU tier; a pinned adapter is in both tiers
and is never evicted; an adapter in use by a running request keeps its slot. Pinning past
capacity raises CapacityExceeded instead of evicting another pinned adapter.

Not thread-safe: the engine thread owns the cache and calls it between steps, so slot copies
never race with a forward pass.
"""

from __future__ import annotations

import enum
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from data_plane.errors import AdapterBusy, AdapterNotFound, CapacityExceeded
from data_plane.lora.layer import LoRAProjection, slot_pools
from data_plane.lora.load_times import LoadTimes
from data_plane.lora.lora_adapter import LoraAdapter, SliceDelta


class Tier(enum.Enum):
    CPU = "cpu"
    GPU = "gpu"  # a compute-device slot (the CPU compute slots on a CPU-only pod)


@dataclass(frozen=True)
class Residency:
    name: str
    tier: Tier
    pinned: bool
    rank: int
    sha256: str
    slot: int  # -1 unless tier is GPU


@dataclass(frozen=True)
class TierUsage:
    capacity: int
    used: int
    pinned: int
    busy: int = 0  # held by an adapter that is pinned or serving a request: not to be taken now


@dataclass
class CacheStats:
    """Monotonic counters read by the metrics collector."""

    loads: Counter = field(default_factory=Counter)  # (tier, outcome) -> count
    evictions: Counter = field(default_factory=Counter)  # tier -> count


class AdapterCache:
    def __init__(self, layers: dict[str, LoRAProjection], max_loras: int, max_cpu_loras: int,
                 pin_host_memory: bool = False, load_times: LoadTimes | None = None) -> None:
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})")
        self._layers = layers
        self._pools = slot_pools(layers)
        self._device = next((pool.a.device for pool in self._pools.values()), torch.device("cpu"))  # the slots'
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._pin_host_memory = pin_host_memory
        self._cpu: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._slots: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._free_slots = list(range(max_loras))
        self._pinned: set[str] = set()
        self._in_use: Counter[str] = Counter()
        self.stats = CacheStats()
        self._load_times = load_times or LoadTimes()  # each slot copy's time is recorded there

    # ---- queries -------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._cpu

    def get(self, name: str) -> LoraAdapter:
        try:
            return self._cpu[name]
        except KeyError:
            raise AdapterNotFound(f"adapter {name!r} is not loaded on this pod; load it first") from None

    def slot_of(self, name: str) -> int | None:
        return self._slots.get(name)

    def residency(self, name: str) -> Residency:
        adapter = self.get(name)
        slot = self._slots.get(name, -1)
        return Residency(name, Tier.GPU if slot >= 0 else Tier.CPU, name in self._pinned, adapter.rank,
                         adapter.sha256, slot)

    def list(self) -> list[Residency]:
        """Every resident adapter, most recently used first."""
        return [self.residency(name) for name in reversed(self._cpu)]

    def slot_usage(self) -> TierUsage:
        return TierUsage(self.max_loras, len(self._slots), sum(1 for n in self._slots if n in self._pinned),
                         sum(1 for n in self._slots if n in self._pinned or self.in_use(n)))

    def cpu_usage(self) -> TierUsage:
        return TierUsage(self.max_cpu_loras, len(self._cpu), len(self._pinned))

    def in_use(self, name: str) -> bool:
        return self._in_use[name] > 0

    def is_pinned(self, name: str) -> bool:
        return name in self._pinned

    def pinned_out(self, name: str) -> bool:
        """True when every slot holds a pinned adapter other than ``name``: it gets none until one is unpinned."""
        return name not in self._pinned and len(self._pinned) >= self.max_loras

    def unpinned_in_slots(self) -> list[str]:
        """Adapters in a slot that a waiting adapter may take once they are idle, least recently used first."""
        return [name for name in self._slots if name not in self._pinned]

    # ---- CPU tier ------------------------------------------------------------------------
    def insert(self, adapter: LoraAdapter) -> Residency:
        """Adds a validated adapter to the CPU tier, evicting the least recently used unpinned,
        idle adapter if the tier is full. Re-inserting the same weights only refreshes recency."""
        current = self._cpu.get(adapter.name)
        if current is not None and current.sha256 == adapter.sha256:
            self._cpu.move_to_end(adapter.name)
            return self.residency(adapter.name)
        if current is not None:
            if self.in_use(adapter.name):
                raise AdapterBusy(f"adapter {adapter.name!r} is serving requests; retry the reload when they finish")
            self._drop(adapter.name)
        if len(self._cpu) >= self.max_cpu_loras:
            victim = self._lru_evictable(self._cpu)
            if victim is None:
                raise CapacityExceeded(
                    f"cannot load {adapter.name!r}: all {self.max_cpu_loras} CPU cache entries are pinned or in use; "
                    "unpin an adapter or raise --max-cpu-loras"
                )
            self._drop(victim)
            self.stats.evictions[Tier.CPU] += 1
        self._cpu[adapter.name] = adapter.pin_memory() if self._pin_host_memory else adapter
        self.stats.loads[(Tier.CPU, "ok")] += 1
        return self.residency(adapter.name)

    def unload(self, name: str) -> bool:
        """Removes ``name`` from both tiers (dropping its pin). False if it was not resident."""
        if name not in self._cpu:
            return False
        if self.in_use(name):
            raise AdapterBusy(f"adapter {name!r} is serving {self._in_use[name]} requests; unload it when they finish")
        self._drop(name)
        return True

    # ---- device tier ---------------------------------------------------------------------
    def acquire(self, name: str) -> int:
        """Puts ``name`` in a slot if it is not in one and marks it in use; returns the slot.
        Raises CapacityExceeded when every slot is pinned or in use (the caller waits and retries)."""
        slot = self._ensure_slot(name)
        self._in_use[name] += 1
        return slot

    def release(self, name: str) -> None:
        self._in_use[name] -= 1
        if self._in_use[name] <= 0:
            del self._in_use[name]

    def can_acquire(self, name: str) -> bool:
        return name in self._slots or bool(self._free_slots) or self._lru_evictable(self._slots) is not None

    # ---- pins ----------------------------------------------------------------------------
    def pin(self, name: str) -> Residency:
        """Holds ``name`` in both tiers until unpinned."""
        self.get(name)
        if name not in self._pinned:
            limit = min(self.max_loras, self.max_cpu_loras)
            if len(self._pinned) >= limit:
                raise CapacityExceeded(
                    f"cannot pin {name!r}: {len(self._pinned)} adapters are already pinned and this pod holds at "
                    f"most {limit} pinned; unpin one first"
                )
            self._ensure_slot(name)
            self._pinned.add(name)
        return self.residency(name)

    def unpin(self, name: str) -> Residency:
        self.get(name)
        self._pinned.discard(name)
        return self.residency(name)

    # ---- warm-up -------------------------------------------------------------------------
    def fill_with_dummies(self, rank: int) -> None:
        """Writes a zero adapter of ``rank`` into every free slot (warm-up: first use of every
        slot and every code path happens before the first request)."""
        for slot in self._free_slots:
            for layer in self._layers.values():
                layer.set_slot(slot, _zero_deltas(layer, rank))

    def clear_free_slots(self) -> None:
        for slot in self._free_slots:
            for layer in self._layers.values():
                layer.clear_slot(slot)

    # ---- internals -----------------------------------------------------------------------
    def _ensure_slot(self, name: str) -> int:
        adapter = self.get(name)
        self._cpu.move_to_end(name)
        if name in self._slots:
            self._slots.move_to_end(name)
            return self._slots[name]
        if not self._free_slots:
            victim = self._lru_evictable(self._slots)
            if victim is None:
                raise CapacityExceeded(
                    f"no adapter slot for {name!r}: all {self.max_loras} slots are pinned or serving requests"
                )
            self._free_slot(victim)
            self.stats.evictions[Tier.GPU] += 1
        slot = self._free_slots.pop(0)
        start = time.perf_counter()
        by_kind: dict[str, list] = {kind: [] for kind in self._pools}
        for group in adapter.on(self._device).groups:
            by_kind[group.kind].append(group)
        for kind, pool in self._pools.items():
            pool.write(slot, by_kind[kind])
        self._load_times.host_to_slot(time.perf_counter() - start)  # the host's part of an asynchronous copy
        self._slots[name] = slot
        self.stats.loads[(Tier.GPU, "ok")] += 1
        return slot

    def _lru_evictable(self, tier: OrderedDict) -> str | None:
        for name in tier:
            if name not in self._pinned and not self.in_use(name):
                return name
        return None

    def _free_slot(self, name: str) -> None:
        slot = self._slots.pop(name)
        for pool in self._pools.values():
            pool.clear(slot)
        self._free_slots.append(slot)

    def _drop(self, name: str) -> None:
        if name in self._slots:
            self._free_slot(name)
        self._pinned.discard(name)
        del self._cpu[name]


def _zero_deltas(layer: LoRAProjection, rank: int) -> dict[str, SliceDelta]:
    dtype = layer.base.dtype  # the activations' (and slots') dtype: an FP8 base's weights are not
    return {
        name: SliceDelta(torch.zeros(rank, layer.base.in_features, dtype=dtype), torch.zeros(width, rank, dtype=dtype))
        for name, width in layer.base.slices.items()
    }
