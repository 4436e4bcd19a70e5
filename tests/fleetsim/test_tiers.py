"""The simulated fleet as measured: the step time fitted to the H100 run, rank-aware LoRA cost, a disk tier below
host memory that downloads remote adapters, the router reading the pods' disk copies and load times, the control
plane's prefetch by popularity, and AIBrix's router as its published code behaves."""

from __future__ import annotations

import heapq
import json
from collections import deque
from pathlib import Path

import pytest

from control_plane.placement import Pin
from fleetsim.config import H100_STEPS_MS, FleetConfig, StepModel, adapter_bytes, fit_step_model
from fleetsim.policies import AIBrix, Ours
from fleetsim.simulator import Simulation
from fleetsim.trace import Arrivals, TraceConfig, make_trace

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
TRACE = TraceConfig(adapters=300, rate=40.0, duration_s=20.0, alpha=1.0, arrivals=Arrivals.BURSTY,
                    drift_period_s=5.0, drift_step=20, min_tokens=16, max_tokens=96, seed=7)


def test_the_step_model_is_the_fit_of_the_h100_run_and_misses_it_by_under_a_tenth_of_a_ms():
    run1 = json.loads((RESULTS / "gpu-8b-cuda-2026-11-27-run1.json").read_text())
    serving = json.loads((RESULTS / "gpu-8b-cuda-2026-11-27-run2-serving.json").read_text())["serving"]
    b1 = next(r["value"] for r in run1["table"] if r["section"] == "decode b1" and "eager=False" in r["what"])
    measured = [b1] + [serving[k]["itl_p50_ms"] for k in ("base only", "8 adapters", "64 adapters")]
    assert [ms for *_, ms in H100_STEPS_MS] == pytest.approx(measured, abs=5e-4)
    fitted, residuals = fit_step_model()
    assert max(map(abs, residuals)) < 0.1
    shipped = StepModel()
    for field in ("base_s", "per_seq_s", "per_log2_adapters"):
        assert getattr(shipped, field) == pytest.approx(getattr(fitted, field), rel=1e-3)
    # a term linear in the distinct adapters cannot pass near both adapter points
    base64 = fitted.step_s(64, 0) * 1000
    points = [(d, ms / base64 - 1) for b, d, ms in H100_STEPS_MS if d]
    slope = sum(d * y for d, y in points) / sum(d * d for d, _ in points)
    assert max(abs(base64 * (1 + slope * d) - base64 * (1 + y)) for d, y in points) > 2.5


def test_the_lora_part_of_a_step_grows_in_proportion_to_the_ranks_in_the_batch():
    model = StepModel()
    base = model.step_s(32, 0)
    lora16 = model.step_s(32, 4, 4 * 16) - base
    assert model.step_s(32, 4) - base == pytest.approx(lora16)  # the measured rank when ranks are not given
    assert model.step_s(32, 4, 4 * 64) - base == pytest.approx(4 * lora16)
    assert model.step_s(32, 4, 8 + 8 + 16 + 32) - base == pytest.approx(lora16)  # the mean rank is 16


def drain(sim: Simulation) -> None:
    """Runs the pods' own events (downloads, loads) until none is left; no request arrives."""
    while sim._heap:
        sim.now, _, kind, pod, payload = heapq.heappop(sim._heap)
        sim.pods[pod].handle(kind, payload, sim.now)


def two_pods(policy=None, disk_bytes: int = 10 << 30) -> Simulation:
    fleet = FleetConfig(pods=2, slots=2, cpu_entries=4, max_num_seqs=8, disk_bytes=disk_bytes)
    return Simulation(fleet, make_trace(TRACE), policy or Ours(), (), audit=True)


def test_a_remote_adapter_is_downloaded_once_and_read_from_the_disk_tier_after_its_eviction_from_memory():
    sim = two_pods()
    pod = sim.pods[0]
    names = [f"a{i:05d}" for i in range(6)]
    for name in names:  # six adapters through a host tier of four: the first two leave memory
        pod.load(name, sim.now)
        drain(sim)
    assert pod.counters.downloads == 6 and set(pod.disk.copies) == set(names) and all(pod.disk.copies.values())
    assert "a00000" not in pod.cpu
    pod.load("a00000", sim.now)
    drain(sim)
    assert pod.counters.downloads == 6 and pod.cpu["a00000"]  # from its disk copy, no download
    times = pod.load_times.now()
    assert 0 < times.disk_to_host_s < times.remote_to_disk_s  # measured as a real pod measures
    pod.check()


def test_a_full_disk_tier_drops_its_least_recently_used_copy_and_a_prefetch_never_evicts():
    sim = two_pods(disk_bytes=2 * adapter_bytes(16))
    pod = sim.pods[0]
    assert pod.prefetch("a00001", 0.0) and pod.prefetch("a00002", 0.0)
    assert not pod.prefetch("a00003", 0.0)  # no room: skipped, nothing evicted
    drain(sim)
    assert list(pod.disk.copies) == ["a00001", "a00002"] and pod.counters.prefetches == 2
    pod.load("a00003", sim.now)  # a load that must download makes room
    drain(sim)
    assert list(pod.disk.copies) == ["a00002", "a00003"] and pod.disk.used == 2 * adapter_bytes(16)
    pod.check()
    pod.disk.used += 1
    with pytest.raises(AssertionError, match="disagree with its copies"):
        pod.check()


def test_the_real_router_sends_a_cold_request_to_the_pod_holding_the_adapter_on_its_disk():
    sim = two_pods()
    holder = sim.pods[1]
    holder.prefetch("a00042", 0.0)
    other = sim.pods[0]
    other.load("a00007", 0.0)  # both pods have measured a download and a read
    holder.load("a00008", 0.0)
    drain(sim)
    sim._view = sim._read_view()
    views = {v.id: v for v in sim._view.pods}
    assert sim._view.remote["a00042"] in views[holder.id].disk
    assert sim._view.remote["a00042"] not in views[other.id].disk
    assert views[other.id].load_times.download_factor() > 1
    assert sim.policy.route("a00042") == holder.index
    for name in ("a00007", "a00008"):  # in host memory on one pod each: each goes where it is
        assert sim.policy.route(name) == (other if name == "a00007" else holder).index


def test_our_control_plane_prefetches_rising_adapters_and_the_peers_do_not():
    fleet = FleetConfig(pods=8, slots=4, cpu_entries=12, max_num_seqs=8)
    pins = [Pin("a00003", 2)]
    ours = Simulation(fleet, make_trace(TRACE), Ours(), pins, seed=1, audit=True).run()
    assert ours.prefetches > 0 and ours.completed == ours.requests
    peer = Simulation(fleet, make_trace(TRACE), AIBrix(), pins, seed=1).run()
    assert peer.prefetches == 0 and peer.downloads_per_1k > 0


def test_aibrix_as_published_sends_an_adapter_nobody_runs_to_a_random_pod_not_to_one_with_room():
    sim = two_pods(AIBrix())
    busy, idle = sim.pods
    busy.wanted.update({f"b{i}": 1 for i in range(busy.config.slots)})  # queued adapters fill its slots
    busy.waiting = deque(range(busy.config.slots))
    chosen = {sim.policy.route("a00001") for _ in range(64)}
    assert chosen == {busy.index, idle.index}
    room = two_pods(AIBrix(room_check=True))
    busy, idle = room.pods
    busy.wanted.update({f"b{i}": 1 for i in range(busy.config.slots)})
    busy.waiting = deque(range(busy.config.slots))
    assert {room.policy.route("a00001") for _ in range(64)} == {idle.index}
