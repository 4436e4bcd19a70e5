"""``EngineState``: what a pod's engine holds at one moment, as one frozen value.

Read at scrape time by the metrics collector, and by ``GetState`` and the heartbeats that
report the pod to the control plane; nothing reads the engine's state any other way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from data_plane.lora.adapter_cache import Residency, Tier, TierUsage
from data_plane.lora.disk_tier import DiskUsage


@dataclass(frozen=True)
class EngineState:
    slots: TierUsage  # adapter slots on the compute device
    cpu: TierUsage  # the CPU tier of the adapter cache
    adapters: tuple[Residency, ...]  # every resident adapter, most recently used first
    loads: Mapping[tuple[Tier, str], int]  # (tier, outcome) -> adapter loads so far
    evictions: Mapping[Tier, int]  # tier -> LRU evictions so far
    running: int  # requests holding KV blocks
    waiting: int  # requests queued for admission
    kv_usage: float  # fraction of KV-cache blocks in use
    preemptions: int  # sequences preempted for lack of KV blocks so far
    prefix: PrefixState | None = None  # the prefix cache's counts; None without prefix caching
    disk: DiskUsage | None = None  # the disk tier of downloaded adapters; None on a pod without one
    eager_steps: int = 0  # steps a pod replaying CUDA graphs ran eagerly (no captured shape fits them) so far


@dataclass(frozen=True)
class PrefixState:
    cached_blocks: int  # full KV blocks findable by their tokens
    queried_tokens: int  # prompt tokens of admitted requests looked up so far
    hit_tokens: int  # of those, found cached (not computed)
    evictions: int  # cached blocks given to another use so far
