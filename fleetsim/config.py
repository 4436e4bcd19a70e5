"""The simulated fleet's one configuration: sizes, the step-time model and the adapter-load times.

Defaults that the product also has (slots, seats, the router's refresh interval, the reconcile interval,
the slots kept free of pins) are read from the product's own config dataclasses, so the simulated fleet
runs as the real one is shipped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from control_plane.config import ControlPlaneConfig
from data_plane.config import DataPlaneConfig
from router.config import RouterConfig


def shipped(config: type, name: str):
    """The default of field ``name`` of the product's config dataclass ``config``."""
    return next(f.default for f in dataclasses.fields(config) if f.name == name)


@dataclass(frozen=True)
class StepModel:
    """Seconds one decode step takes on a pod: ``(base_s + per_seq_s * batch) * (1 + per_adapter * distinct)``.

    ``base_s`` and ``per_seq_s`` are assumptions for an 8B model in bfloat16 on one H100 (no GPU has been
    measured in this repository): reading 16 GB of weights at 3.35 TB/s is ~4.8 ms a step, 10 ms with
    kernel launches and sampling, and each sequence adds attention over its KV cache. ``per_adapter`` is
    measured: on the CPU, 64 distinct rank-16 adapters at batch 64 took the inter-token latency from
    70 ms (base only) to 98 ms (benchmarks/history/serving-cpu.md, "Many adapters on CPU"), (98 / 70 - 1) / 64 =
    0.63% of a step per distinct adapter."""

    base_s: float = 0.010
    per_seq_s: float = 0.00025
    per_adapter: float = 0.0063

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.per_seq_s < 0 or self.per_adapter < 0:
            raise ValueError(f"step model needs base_s > 0 and non-negative costs: {self}")

    def step_s(self, batch: int, distinct_adapters: int) -> float:
        return (self.base_s + self.per_seq_s * batch) * (1.0 + self.per_adapter * distinct_adapters)


@dataclass(frozen=True)
class LoadModel:
    """Adapter load times, drawn uniformly between the two measured medians of benchmarks/RESULTS.md,
    "Adapter load", Llama-3-8B shape, rank 16, all seven projections (1 and 2 threads): disk to a ready
    slot 375.76-386.27 ms (read + validate + CPU insert + slot copy), CPU tier to slot 24.31-25.16 ms
    (the slot copy)."""

    disk_to_slot_s: tuple[float, float] = (0.37576, 0.38627)
    cpu_to_slot_s: tuple[float, float] = (0.02431, 0.02516)

    def __post_init__(self) -> None:
        for lo, hi in (self.disk_to_slot_s, self.cpu_to_slot_s):
            if not 0 < lo <= hi:
                raise ValueError(f"load times need 0 < low <= high: {self}")
        if self.cpu_to_slot_s[1] >= self.disk_to_slot_s[0]:
            raise ValueError(f"a disk load includes the slot copy, so it must take longer: {self}")


@dataclass(frozen=True)
class FleetConfig:
    """The simulated fleet. ``kv_usage`` a pod reports is its running sequences over ``max_num_seqs``
    (a full batch is taken to fill the KV cache); ``scan_limit`` bounds how many waiting requests one
    scheduling pass looks at, as the real scheduler's step budget does."""

    pods: int = 100
    slots: int = shipped(DataPlaneConfig, "max_loras")
    cpu_entries: int = 64
    max_num_seqs: int = shipped(DataPlaneConfig, "max_num_seqs")
    view_interval_s: float = shipped(RouterConfig, "refresh_interval")
    reconcile_interval_s: float = shipped(ControlPlaneConfig, "reconcile_interval")
    reserved_unpinned_slots: int = shipped(ControlPlaneConfig, "reserved_unpinned_slots")
    max_load_attempts: int = shipped(ControlPlaneConfig, "max_load_attempts")
    retry_backoff_s: float = shipped(ControlPlaneConfig, "retry_backoff_s")
    demand_window_s: float = shipped(DataPlaneConfig, "demand_window")
    demand_report_top: int = shipped(DataPlaneConfig, "demand_report_top")
    scan_limit: int = 256
    step: StepModel = field(default_factory=StepModel)
    load: LoadModel = field(default_factory=LoadModel)

    def __post_init__(self) -> None:
        if self.pods < 1 or self.max_num_seqs < 1 or self.scan_limit < 1:
            raise ValueError(f"need at least one pod, one seat and a scan limit of 1: {self}")
        if not 1 <= self.slots <= self.cpu_entries:
            raise ValueError(f"need 1 <= slots ({self.slots}) <= cpu_entries ({self.cpu_entries})")
        if self.view_interval_s <= 0 or self.reconcile_interval_s <= 0:
            raise ValueError(f"intervals must be positive: {self}")
