"""Load/unload cycles over more adapters than the caches hold: slot and cache counts, live adapter
objects and resident memory return to their baseline (memory kept after unload is a leak)."""

from __future__ import annotations

import gc
import os

from lorafleet.v1 import data_plane_admin_pb2 as dpa

from data_plane.demo_adapters import DEMO_ADAPTERS
from data_plane.lora.peft_adapter import LoraAdapter
from data_plane.lora.runtime import LoraRuntime
from data_plane.model import load_model
from tests.grpc_helpers import collect, request
from tests.lora.conftest import ADAPTERS as TINY_ADAPTERS
from tests.lora.conftest import tiny_adapters, tiny_base  # noqa: F401  (fixtures)
from tests.reliability.conftest import COPIES, POD_MAX_CPU_LORAS, POD_MAX_LORAS, rss_bytes

CACHE_NAMES = 7  # distinct adapter names cycled through a cache of 2 slots and 3 CPU entries
MAX_CACHE_RSS_GROWTH = 16 << 20  # the tiny adapters are ~100 KiB each: a leak per cycle exceeds this in 200 cycles
MAX_POD_RSS_GROWTH = 64 << 20  # a demo adapter is 9.8 MB: keeping one in seven after unload exceeds this


def live_adapters() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is LoraAdapter)


def test_cache_cycles_return_slots_objects_and_memory_to_baseline(tiny_base, tiny_adapters, sizes,  # noqa: F811
                                                                 results):
    model = load_model(tiny_base[0], "float32")
    runtime = LoraRuntime(model, max_loras=2, max_cpu_loras=3, max_rank=64, max_tokens=64,
                          adapter_roots=(tiny_adapters,))
    cache, sources = runtime.cache, list(TINY_ADAPTERS)

    def cycle(i: int) -> None:
        name = f"a{i % CACHE_NAMES}"
        runtime.load(name, sources[i % len(sources)])
        cache.acquire(name)
        if i % 5 == 0:
            cache.pin(name)
            cache.unpin(name)
        cache.release(name)
        if i % 2 == 0:
            cache.unload(name)  # the rest leave by eviction

    def drain() -> None:
        for r in cache.list():
            cache.unload(r.name)

    for i in range(2 * CACHE_NAMES):  # warm: every name and source once
        cycle(i)
    drain()
    baseline = (cache.slot_usage(), cache.cpu_usage(), live_adapters(), rss_bytes(os.getpid()))
    evictions_before = sum(cache.stats.evictions.values())
    for i in range(sizes.cache_cycles):
        cycle(i)
    evictions = sum(cache.stats.evictions.values()) - evictions_before
    drain()
    after = (cache.slot_usage(), cache.cpu_usage(), live_adapters(), rss_bytes(os.getpid()))
    assert evictions > 0, "the cycles must overflow the caches"
    assert after[:3] == baseline[:3], f"cache counts or live adapters did not return: {baseline[:3]} -> {after[:3]}"
    assert cache.list() == []
    growth = after[3] - baseline[3]
    assert growth < MAX_CACHE_RSS_GROWTH, f"RSS grew {growth / 2**20:.1f} MiB over {sizes.cache_cycles} cycles"
    results.record(
        "Leaks", "adapter cache, in process",
        f"{sizes.cache_cycles} load/acquire/release/unload cycles of {CACHE_NAMES} adapter names (ranks 1-64) "
        "through a cache of 2 slots and 3 CPU entries; every fifth cycle pins and unpins, every other one "
        "leaves by eviction",
        "slot and CPU counts, live adapter objects and RSS back to baseline",
        cycles=sizes.cache_cycles, evictions=evictions, slots_used_before=baseline[0].used,
        slots_used_after=after[0].used, live_adapters_before=baseline[2], live_adapters_after=after[2],
        rss_before_mib=round(baseline[3] / 2**20, 1), rss_after_mib=round(after[3] / 2**20, 1))


def test_pod_load_unload_cycles_return_state_and_memory_to_baseline(pod, sizes, results):
    admin, auth = pod.admin(), pod.auth()
    names = [f"{name}-{i}" for name in DEMO_ADAPTERS for i in range(1, COPIES + 1)] + list(DEMO_ADAPTERS)
    assert len(names) > POD_MAX_CPU_LORAS > POD_MAX_LORAS

    def cycle(i: int) -> None:
        name = names[i % len(names)]
        admin.LoadAdapter(dpa.LoadAdapterRequest(name=name, source=name), metadata=auth, timeout=30)
        if i % 10 == 0:  # into a slot, through a request
            assert collect(pod, request("Hi", name, max_tokens=1))[2].usage.completion_tokens == 1
        if i % 3 == 0:
            admin.UnloadAdapter(dpa.UnloadAdapterRequest(name=name), metadata=auth, timeout=30)

    def drain() -> None:
        for a in pod.state().adapters:
            admin.UnloadAdapter(dpa.UnloadAdapterRequest(name=a.name), metadata=auth, timeout=30)

    for i in range(2 * len(names)):  # warm
        cycle(i)
    drain()
    baseline = pod.state()
    baseline_rss = rss_bytes(pod.proc.pid)
    for i in range(sizes.pod_cycles):
        cycle(i)
    drain()
    after = pod.state()
    after_rss = rss_bytes(pod.proc.pid)
    assert (after.slots, after.cpu_cache, list(after.adapters)) == (baseline.slots, baseline.cpu_cache, [])
    growth = after_rss - baseline_rss
    assert growth < MAX_POD_RSS_GROWTH, f"pod RSS grew {growth / 2**20:.1f} MiB over {sizes.pod_cycles} cycles"
    evictions = sum(float(line.split()[-1]) for line in pod.metrics().splitlines()
                    if line.startswith("lorafleet_adapter_evictions_total{"))
    assert evictions > 0
    results.record(
        "Leaks", "pod over gRPC",
        f"{sizes.pod_cycles} LoadAdapter cycles of {len(names)} demo-adapter copies (9.8 MB each) on a pod of "
        f"{POD_MAX_LORAS} slots and {POD_MAX_CPU_LORAS} CPU entries; every tenth also generates with it, every "
        "third unloads it, the rest leave by eviction",
        "GetState's slot and CPU counts back to baseline, nothing resident; pod RSS back to baseline",
        cycles=sizes.pod_cycles, evictions_so_far=int(evictions), slots_used_before=baseline.slots.used,
        slots_used_after=after.slots.used, cpu_used_before=baseline.cpu_cache.used,
        cpu_used_after=after.cpu_cache.used, rss_before_mib=round(baseline_rss / 2**20, 1),
        rss_after_mib=round(after_rss / 2**20, 1))
