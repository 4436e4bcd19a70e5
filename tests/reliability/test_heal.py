"""Healing at the shipped timing defaults (no shortened leases, default heartbeats): a pod killed with
SIGKILL has its pins READY on another pod long before its lease would lapse, while a pod paused with
SIGSTOP for longer than --pod-probe-after keeps its place and its pins.

The two are told apart by a health check the leader sends a pod silent for --pod-probe-after (3 s):
a process that has exited leaves its port closed and the connection is refused (removed at once); a
stopped process's kernel still accepts the connection but nothing answers, so the pod keeps its
lease (10 s) and grace (20 s) like a pod cut off from the control plane."""

from __future__ import annotations

import signal
import time

import pytest

from benchmarks.processes import Fleet, copy_demo_adapters, wait_until
from data_plane.demo_adapters import DEMO_ADAPTERS

pytestmark = pytest.mark.slow
WITHIN_S = 60  # bounds the waits only; what the pins took is recorded, not asserted
PROBES = "lorafleet_control_plane_pod_probes_total"
REMOVED = "lorafleet_control_plane_pods_removed_total"


@pytest.fixture(scope="module")
def fleet(demo_model_dir, tmp_path_factory):
    adapter_root = copy_demo_adapters(tmp_path_factory.mktemp("heal-adapters"))
    fleet = Fleet(tmp_path_factory.mktemp("heal-fleet"), adapter_root, shipped_timing=True)
    try:
        yield fleet.start()
    finally:
        for pod in fleet.pods.values():
            if pod.proc is not None and pod.proc.poll() is None:
                pod.signal(signal.SIGCONT)
        fleet.stop()


def pinned_once(fleet: Fleet, name: str) -> tuple[str, str]:
    """Registers and pins ``name`` on one pod; returns (that pod, the other)."""
    fleet.register(name)
    fleet.pin(name, 1)
    (holder,) = wait_until(lambda: fleet.placements(name), WITHIN_S, f"{name} READY on one pod")
    return holder, next(p for p in fleet.pods if p != holder)


def test_a_paused_pod_is_probed_and_keeps_its_place_and_pins(fleet, results):
    name = DEMO_ADAPTERS[0]
    holder, _ = pinned_once(fleet, name)
    silent_before = fleet.cp.metric(PROBES, outcome="silent")
    fleet.pods[holder].signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    try:
        wait_until(lambda: fleet.cp.metric(PROBES, outcome="silent") > silent_before, WITHIN_S,
                   "the paused pod probed and found silent")
        probed_after = time.monotonic() - paused_at
    finally:
        fleet.pods[holder].signal(signal.SIGCONT)
    paused_s = time.monotonic() - paused_at
    wait_until(lambda: fleet.pods[holder].state().adapters, 30, "the pod answering again")
    assert sorted(fleet.pod_ids()) == sorted(fleet.pods)
    assert fleet.placements(name) == {holder}
    assert fleet.cp.metric(REMOVED, reason="refused") == 0 and fleet.cp.metric(REMOVED, reason="lease") == 0
    results.record(
        "Faults", "pod paused (SIGSTOP), shipped defaults",
        "the pod that pins an adapter stopped with SIGSTOP until the control plane has probed it, then "
        "continued; control plane and pods on their default leases and heartbeats",
        "the pod probed and found silent, not declared dead: still in the fleet, the pin still READY on it, "
        "nothing moved", faults_injected=1, probed_after_s=round(probed_after, 1), paused_s=round(paused_s, 1),
        pods_removed=0)


def test_a_killed_pods_pins_are_ready_elsewhere_without_waiting_for_its_lease(fleet, results):
    name = DEMO_ADAPTERS[1]
    victim, survivor = pinned_once(fleet, name)
    fleet.pods[victim].signal(signal.SIGKILL)
    killed_at = time.monotonic()
    fleet.pods[victim].proc.wait(timeout=10)
    wait_until(lambda: fleet.placements(name) == {survivor}, WITHIN_S, f"{name} READY on {survivor}")
    healed_after = time.monotonic() - killed_at
    assert survivor in fleet.pinned_on(name)
    assert fleet.pod_ids() == [survivor]
    # removed because its port refused the probe, not because its lease and grace ran out
    assert fleet.cp.metric(REMOVED, reason="refused") == 1 and fleet.cp.metric(REMOVED, reason="lease") == 0
    results.record(
        "Faults", "pod kill -9, shipped defaults",
        "the pod that pins an adapter killed with SIGKILL; control plane and pods on their default leases "
        "(10 s lease, 20 s grace), heartbeats (1 s) and probes (after 3 s of silence)",
        "the dead pod removed on a refused probe, not after its lease; the pin READY on the other pod",
        faults_injected=1, pin_ready_elsewhere_after_s=round(healed_after, 1), pod_lease_s=10)
