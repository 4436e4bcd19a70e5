"""The simulated fleet's one configuration: sizes, the step-time model and the adapter-load times.

Defaults that the product also has (slots, seats, the router's refresh interval, the reconcile interval,
the slots kept free of pins, the disk tier's bytes) are read from the product's own config dataclasses, so
the simulated fleet runs as the real one is shipped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from control_plane.config import ControlPlaneConfig
from data_plane.config import DataPlaneConfig
from router.config import RouterConfig


def shipped(config: type, name: str):
    """The default of field ``name`` of the product's config dataclass ``config``."""
    return next(f.default for f in dataclasses.fields(config) if f.name == name)


# The H100 figures the step model is fitted to (benchmarks/RESULTS.md, "GPU evaluation, first run";
# benchmarks/results/gpu-8b-cuda-2026-11-27-run1.json and -run2-serving.json): inter-token p50, ms, of the
# Llama-3-8B shape in bfloat16 with CUDA graphs, as (batch, distinct rank-16 adapters, ms).
H100_STEPS_MS = ((1, 0, 9.642), (64, 0, 13.984), (64, 8, 17.987), (64, 64, 21.410))
REFERENCE_RANK = 16  # the rank of the measured adapters


@dataclass(frozen=True)
class StepModel:
    """Seconds one decode step takes on a pod:
    ``(base_s + per_seq_s * batch) * (1 + per_log2_adapters * log2(1 + distinct) * mean_rank / 16)``.

    Fitted to the H100 run (``H100_STEPS_MS``, ``fit_step_model``): the base-model steps at batch 1 and 64 give
    the line (9.57 ms + 0.0689 ms a sequence); the two adapter points at batch 64 give one least-squares
    factor for the distinct adapters, 1 + 0.0886 * log2(1 + distinct), which misses them by -0.07 ms (8 adapters)
    and +0.04 ms (64). A per-adapter term linear in the count cannot fit both: its least-squares slope (0.0087
    a distinct adapter) misses 8 adapters by -3.0 ms and 64 by +0.4 ms. The LoRA kernels group tokens by
    adapter, so their cost grows less than in proportion to the adapters' number (more, smaller groups in the
    same launches).

    Rank: the LoRA term is taken in proportion to the mean rank of the distinct adapters in the batch against
    the measured rank 16 (a rank-64 adapter's LoRA work costs 4 times a rank-16 one's), since the bytes the
    shrink and expand read and the FLOPs they do are linear in the rank. The run's own kernel rows grow less
    (rank 64 against 16 at batch 64: 1.81 times the time, the kernels being partly latency-bound), so this
    charges high ranks an upper bound; no step of mixed ranks was measured."""

    base_s: float = 0.0095731
    per_seq_s: float = 0.00006892
    per_log2_adapters: float = 0.08864

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.per_seq_s < 0 or self.per_log2_adapters < 0:
            raise ValueError(f"step model needs base_s > 0 and non-negative costs: {self}")

    def step_s(self, batch: int, distinct_adapters: int, rank_sum: int = 0) -> float:
        """``rank_sum``: the ranks of the distinct adapters, summed (0: each of the reference rank)."""
        lora = 0.0
        if distinct_adapters:
            mean_rank = rank_sum / distinct_adapters if rank_sum else REFERENCE_RANK
            lora = self.per_log2_adapters * math.log2(1 + distinct_adapters) * mean_rank / REFERENCE_RANK
        return (self.base_s + self.per_seq_s * batch) * (1.0 + lora)


def fit_step_model(points_ms=H100_STEPS_MS) -> tuple[StepModel, list[float]]:
    """The StepModel through ``points_ms`` ((batch, distinct adapters, ms), base-model points first), and its
    residuals (model - measured, ms) in the same order: the line through the base-model points, then the
    least-squares factor over the adapter points."""
    base = [(b, ms) for b, d, ms in points_ms if d == 0]
    (b0, m0), (b1, m1) = base[0], base[-1]
    per_seq = (m1 - m0) / (b1 - b0)
    intercept = m0 - per_seq * b0
    xs = [(math.log2(1 + d), ms / (intercept + per_seq * b) - 1) for b, d, ms in points_ms if d]
    k = sum(x * y for x, y in xs) / sum(x * x for x, _ in xs)
    model = StepModel(intercept / 1000, per_seq / 1000, k)
    return model, [model.step_s(b, d) * 1000 - ms for b, d, ms in points_ms]


# What a rank-16 adapter of the Llama-3-8B shape (all seven projections, bfloat16) weighs: the file of
# benchmarks/RESULTS.md's "Adapter load" and "Adapter download" rows. Other ranks weigh in proportion.
ADAPTER_MB_AT_RANK_16 = 83.95


@dataclass(frozen=True)
class LoadModel:
    """Adapter load times of a rank-16 adapter of the Llama-3-8B shape, each scaled by rank / 16 for other ranks
    (every move is a copy of the adapter's bytes). Host tier to slot and disk tier to slot are drawn
    uniformly between the two measured medians of benchmarks/RESULTS.md, "Adapter load" (1 and 2 threads):
    disk to a ready slot 375.76-386.27 ms (read + validate + host insert + slot copy), host to slot
    24.31-25.16 ms (the slot copy). A download from the remote store into the disk tier is what "Adapter
    download" measured a cold S3 load to add to a local one for the same file (one thread): 1538.8 - 936.6 ms
    = 602 ms for 83.95 MB, 7.17 ms a MB (139 MB/s). That store ran on loopback on the pod's own two cores; a
    store across a real network is likely slower, so downloads here are a lower bound."""

    disk_to_slot_s: tuple[float, float] = (0.37576, 0.38627)
    cpu_to_slot_s: tuple[float, float] = (0.02431, 0.02516)
    download_s_per_mb: float = (1.5388 - 0.9366) / ADAPTER_MB_AT_RANK_16

    def __post_init__(self) -> None:
        for lo, hi in (self.disk_to_slot_s, self.cpu_to_slot_s):
            if not 0 < lo <= hi:
                raise ValueError(f"load times need 0 < low <= high: {self}")
        if self.cpu_to_slot_s[1] >= self.disk_to_slot_s[0]:
            raise ValueError(f"a disk load includes the slot copy, so it must take longer: {self}")
        if self.download_s_per_mb < 0:
            raise ValueError(f"a download cannot take negative time: {self}")

    def download_s(self, rank: int) -> float:
        return self.download_s_per_mb * adapter_bytes(rank) / 1e6


def adapter_bytes(rank: int) -> int:
    """The size of an adapter of ``rank`` (Llama-3-8B shape, all seven projections, bfloat16)."""
    return int(ADAPTER_MB_AT_RANK_16 * 1e6 * rank / REFERENCE_RANK)


@dataclass(frozen=True)
class FleetConfig:
    """The simulated fleet. Each pod has ``slots`` device slots, ``cpu_entries`` adapters in host memory and a
    disk tier of ``disk_bytes`` (least recently used copies go first); every adapter's source is remote, so a
    pod that lacks it on disk downloads it first. ``kv_usage`` a pod reports is its running sequences over
    ``max_num_seqs`` (a full batch is taken to fill the KV cache); ``scan_limit`` bounds how many waiting requests one
    scheduling pass looks at, as the real scheduler's step budget does."""

    pods: int = 100
    slots: int = shipped(DataPlaneConfig, "max_loras")
    cpu_entries: int = 64
    disk_bytes: int = shipped(DataPlaneConfig, "adapter_disk_cache_bytes")
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
        if self.disk_bytes < 0:
            raise ValueError(f"disk_bytes must not be negative: {self}")
        if self.view_interval_s <= 0 or self.reconcile_interval_s <= 0:
            raise ValueError(f"intervals must be positive: {self}")
