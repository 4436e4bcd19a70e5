"""Every metric the pod exports, defined here and nowhere else.

Histograms and counters are recorded at step and RPC boundaries by the engine and servicers;
gauges of cache and queue state, and the adapter load and eviction counts, are read from the
engine's ``EngineState`` when Prometheus scrapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from data_plane.lora.adapter_cache import Tier
from data_plane.lora.disk_tier import DiskUsage

if TYPE_CHECKING:  # the engine records into these metrics, so only the type is named here
    from data_plane.engine.state import EngineState

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ERROR_BUCKETS = (-10, -5, -2.5, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class PodMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("lorafleet_time_to_first_token_seconds", "Time from arrival to the first token.",
                              ["adapter_kind"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("lorafleet_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("lorafleet_request_duration_seconds", "Time from arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.load_latency = Histogram("lorafleet_adapter_load_seconds",
                                      "Time to read and validate an adapter into the CPU cache.",
                                      ["outcome"], buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("lorafleet_requests", "Generate requests by outcome.", ["outcome"], registry=r)
        self.refusals = Counter("lorafleet_requests_refused",
                                "Requests refused for load: queue_full, deadline (would start after the caller's "
                                "deadline), queue_delay (after --max-queue-delay), expired (deadline passed "
                                "while queued).", ["reason"], registry=r)
        for reason in ("queue_full", "deadline", "queue_delay", "expired"):
            self.refusals.labels(reason)
        self.generated_tokens = Counter("lorafleet_generated_tokens", "Tokens generated.", registry=r)
        self.prompt_tokens = Counter("lorafleet_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.step_duration = Histogram("lorafleet_engine_step_seconds", "Duration of one engine step.",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_estimate_error = Histogram(
            "lorafleet_ttft_estimate_error_seconds",
            "Admitted requests' time to first token minus the wait admission estimated for them (negative: "
            "the first token came sooner than estimated).", buckets=_ERROR_BUCKETS, registry=r)
        self.prefill_budget = Gauge("lorafleet_step_prefill_budget_tokens",
                                    "Prefill tokens the last step could carry beside its decodes (the step budget).",
                                    registry=r)
        self.grammar_compile = Histogram("lorafleet_grammar_compile_seconds",
                                         "Time to compile a structured-output constraint (cache misses only).",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.constrained_requests = Counter("lorafleet_constrained_requests",
                                            "Requests with structured output, by kind.", ["kind"], registry=r)
        self.precision = Gauge("lorafleet_precision_info",
                               "1 for the precision the pod computes in (its --dtype, auto resolved): float32, "
                               "bfloat16, float16 or bfloat16-matmul, with +fp8 for an FP8 base (--quantization) and "
                               "+kv-fp8 for an FP8 KV cache (--kv-cache-dtype).",
                               ["precision"], registry=r)

    def set_precision(self, precision: str) -> None:
        """Exports ``precision`` as the pod's one precision (1), once the model is loaded."""
        self.precision.clear()
        self.precision.labels(precision).set(1)

    def watch(self, snapshot: Callable[[], EngineState]) -> None:
        """Exports the gauges and the load, eviction and preemption counts of ``snapshot()`` at scrape time."""
        self.registry.register(_StateCollector(snapshot))


class _StateCollector:
    def __init__(self, snapshot: Callable[[], EngineState]) -> None:
        self._snapshot = snapshot

    def collect(self):
        s = self._snapshot()
        gauges = {
            "lorafleet_gpu_lora_slots_total": ("Adapter slots on the compute device.", s.slots.capacity),
            "lorafleet_gpu_lora_slots_used": ("Slots holding an adapter.", s.slots.used),
            "lorafleet_gpu_lora_slots_pinned": ("Slots holding a pinned adapter.", s.slots.pinned),
            "lorafleet_cpu_lora_cache_capacity": ("Adapters the CPU cache can hold.", s.cpu.capacity),
            "lorafleet_cpu_lora_cache_used": ("Adapters in the CPU cache.", s.cpu.used),
            "lorafleet_cpu_lora_cache_pinned": ("Pinned adapters in the CPU cache.", s.cpu.pinned),
            "lorafleet_requests_running": ("Requests holding KV blocks.", s.running),
            "lorafleet_requests_waiting": ("Requests queued for admission.", s.waiting),
            "lorafleet_kv_cache_usage_ratio": ("Fraction of KV-cache blocks in use.", s.kv_usage),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        loads = CounterMetricFamily("lorafleet_adapter_loads", "Adapter loads into a tier.", labels=["tier", "outcome"])
        for tier in Tier:  # every series exists from the start, so rates work from the first scrape
            for outcome in ("ok", "error"):
                loads.add_metric([tier.value, outcome], s.loads.get((tier, outcome), 0))
        yield loads
        evictions = CounterMetricFamily("lorafleet_adapter_evictions", "LRU evictions by tier.", labels=["tier"])
        for tier in Tier:
            evictions.add_metric([tier.value], s.evictions.get(tier, 0))
        yield evictions
        preemptions = CounterMetricFamily("lorafleet_preemptions", "Sequences preempted for lack of KV blocks.")
        preemptions.add_metric([], s.preemptions)
        yield preemptions
        eager = CounterMetricFamily("lorafleet_engine_eager_steps",
                                    "Steps a pod replaying CUDA graphs ran eagerly: no captured shape (batch-size or "
                                    "token-count bucket) fits them. 0 on pods that run every step eagerly by design "
                                    "(CPU, --enforce-eager).")
        eager.add_metric([], s.eager_steps)
        yield eager
        if s.prefix is not None:
            p = s.prefix
            yield GaugeMetricFamily("lorafleet_prefix_cache_blocks", "Full KV blocks the prefix cache can find.",
                                    value=p.cached_blocks)
            for name, doc, value in (
                ("lorafleet_prefix_cache_queried_tokens", "Prompt tokens of admitted requests looked up in the "
                 "prefix cache.", p.queried_tokens),
                ("lorafleet_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (not computed); "
                 "its rate over the queried tokens' is the hit rate.", p.hit_tokens),
                ("lorafleet_prefix_cache_evictions", "Cached KV blocks given to another use.", p.evictions),
            ):
                counter = CounterMetricFamily(name, doc)
                counter.add_metric([], value)
                yield counter
        if s.disk is not None:
            yield from _disk_metrics(s.disk)
        # One series per resident adapter: bounded by --max-cpu-loras.
        resident = GaugeMetricFamily("lorafleet_adapter_resident", "Resident adapters (2 = device slot, 1 = CPU).",
                                     labels=["adapter", "pinned"])
        for r in s.adapters:
            resident.add_metric([r.name, str(r.pinned).lower()], 2 if r.slot >= 0 else 1)
        yield resident


def _disk_metrics(d: DiskUsage):
    """The disk tier's gauges and counters; downloads by scheme (http, https, s3, hf) and outcome."""
    for name, doc, value in (
        ("lorafleet_adapter_disk_cache_capacity_bytes", "Bytes the disk tier may hold (--adapter-disk-cache-bytes).",
         d.capacity_bytes),
        ("lorafleet_adapter_disk_cache_bytes", "Bytes of downloaded adapters on disk.", d.used_bytes),
        ("lorafleet_adapter_disk_cache_entries", "Downloaded adapters on disk (one per sha256).", d.entries),
    ):
        yield GaugeMetricFamily(name, doc, value=value)
    for name, doc, value in (
        ("lorafleet_adapter_disk_cache_hits", "Remote adapters loaded from the disk tier without a download.",
         d.hits),
        ("lorafleet_adapter_disk_cache_evictions", "Downloaded adapters dropped from disk to fit its bound.",
         d.evictions),
    ):
        counter = CounterMetricFamily(name, doc)
        counter.add_metric([], value)
        yield counter
    downloads = CounterMetricFamily("lorafleet_adapter_downloads", "Adapter downloads by scheme and outcome.",
                                    labels=["scheme", "outcome"])
    seconds = CounterMetricFamily("lorafleet_adapter_download_seconds",
                                  "Seconds spent in successful adapter downloads (over downloads: the mean).",
                                  labels=["scheme"])
    for scheme in ("http", "https", "s3", "hf"):
        for outcome in ("ok", "error"):
            downloads.add_metric([scheme, outcome], d.downloads.get((scheme, outcome), 0))
        seconds.add_metric([scheme], d.download_seconds.get(scheme, 0.0))
    yield downloads
    yield seconds
