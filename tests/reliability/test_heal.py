"""Healing at the shipped timing defaults (no shortened leases, default heartbeats and probes): any pod
that is lost has its pins READY on another pod within 10 s, whether it crashed (SIGKILL) or stopped
answering with its port still open (SIGSTOP, as a partition or a lost node looks), while a pod that is
only slow (long steps on a starved CPU) keeps its place and its pins.

The leader health-checks a pod silent for --pod-probe-after (3 s): a refused connection means the
process is gone (removed at once); no answer once the pod has been silent for --pod-lost-after (4 s)
means it does not run or cannot be reached (removed too). A slow pod is never silent: its heartbeats
and health service run on its event loop, which the engine's steps never block (they run on the model
thread), so it beats every second and answers at once however long its steps take."""

from __future__ import annotations

import random
import signal
import threading
import time

import grpc
import pytest

from benchmarks.processes import Fleet, PodProcess, copy_demo_adapters, sample_value, wait_until
from data_plane.demo_adapters import DEMO_ADAPTERS
from tests.grpc_helpers import request

pytestmark = pytest.mark.slow
WITHIN_S = 60  # bounds the set-up waits only
HEALED_WITHIN_S = 10  # the promise: a lost pod's pins READY elsewhere within this, at the defaults
SLOW_FOR_S = 10  # how long the slow pod is kept busy and starved: past the promise's bound
PROMPT_WORDS = 1800  # one token each: a prompt is one prefill step of 1801 tokens
PROBES = "lorafleet_control_plane_pod_probes_total"
REMOVED = "lorafleet_control_plane_pods_removed_total"
REASONS = ("lease", "refused", "silent")
WORDS = ("anchor", "barrel", "compass", "deck", "harbour", "island", "lantern", "mast", "rope", "sail", "tide")


@pytest.fixture(scope="module")
def fleet(demo_model_dir, tmp_path_factory):
    adapter_root = copy_demo_adapters(tmp_path_factory.mktemp("heal-adapters"))
    # steps of up to 2048 tokens, and KV blocks for one such prompt at a time
    fleet = Fleet(tmp_path_factory.mktemp("heal-fleet"), adapter_root, "--max-num-batched-tokens", "2048",
                  "--num-kv-blocks", "128", shipped_timing=True)
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


def removed(fleet: Fleet) -> dict[str, float]:
    return {reason: fleet.cp.metric(REMOVED, reason=reason) for reason in REASONS}


def long_steps(pod: PodProcess, adapter: str, seed: int, stop: threading.Event) -> None:
    """Sends ``pod`` prompts of PROMPT_WORDS tokens, each new (no cached prefix), one after another until
    ``stop``: every one is a prefill step of that many tokens. A refusal for load is waited out."""
    rng = random.Random(seed)
    while not stop.is_set():
        prompt = " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))
        try:
            for _ in pod.generation().Generate(request(prompt, adapter, max_tokens=1, chat=False), timeout=60):
                pass
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED and not stop.is_set():
                raise
            time.sleep(0.2)


def starve(pod: PodProcess, stop: threading.Event, running_s: float = 0.05, period_s: float = 0.1) -> None:
    """Lets ``pod`` run ``running_s`` of every ``period_s`` until ``stop``, as a CPU quota throttles a
    container (the kernel stops every thread of a cgroup that used its quota until the period ends)."""
    try:
        while not stop.is_set():
            pod.signal(signal.SIGSTOP)
            time.sleep(period_s - running_s)
            pod.signal(signal.SIGCONT)
            time.sleep(running_s)
    finally:
        pod.signal(signal.SIGCONT)


def steps_longer_than(pod: PodProcess, seconds: str) -> float:
    """How many of the pod's engine steps took longer than ``seconds`` (a bucket bound of its histogram)."""
    text = pod.metrics()
    return sample_value(text, "lorafleet_engine_step_seconds_count") \
        - sample_value(text, "lorafleet_engine_step_seconds_bucket", le=seconds)


def test_a_pod_in_long_steps_on_a_starved_cpu_keeps_its_place_and_pins(fleet, results):
    name = DEMO_ADAPTERS[0]
    holder, _ = pinned_once(fleet, name)
    pod = fleet.pods[holder]
    before, probes_before = removed(fleet), fleet.cp.metric(PROBES, outcome="silent")
    stop = threading.Event()
    workers = [threading.Thread(target=long_steps, args=(pod, name, seed, stop), daemon=True) for seed in range(2)]
    workers.append(threading.Thread(target=starve, args=(pod, stop), daemon=True))
    for worker in workers:
        worker.start()
    try:
        time.sleep(SLOW_FOR_S)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=90)
        pod.signal(signal.SIGCONT)
    # it was slow indeed: steps of more than twice the heartbeat interval
    long_ones = steps_longer_than(pod, "2.5")
    assert long_ones >= 1
    assert removed(fleet) == before
    assert sorted(fleet.pod_ids()) == sorted(fleet.pods)
    assert fleet.placements(name) == {holder} and fleet.pinned_on(name) == {holder}
    results.record(
        "Faults", "pod slow (long steps, starved CPU), shipped defaults",
        f"the pod that pins an adapter kept busy for {SLOW_FOR_S} s with {PROMPT_WORDS + 1}-token prompts, one "
        "prefill step each, while stopped for 50 ms of every 100 ms (as a CPU quota throttles a container) on a "
        "machine loaded by other work; control plane and pods on their default leases, heartbeats and probes",
        "the pod kept beating and answering: still in the fleet, the pin still READY on it, nothing moved",
        faults_injected=1, slow_s=SLOW_FOR_S, steps_over_2_5_s=int(long_ones),
        steps_over_5_s=int(steps_longer_than(pod, "5.0")),
        silent_probes=int(fleet.cp.metric(PROBES, outcome="silent") - probes_before), pods_removed=0)


def test_a_paused_pods_pins_are_ready_elsewhere_within_ten_seconds(fleet, results):
    name = DEMO_ADAPTERS[1]
    holder, survivor = pinned_once(fleet, name)
    before = removed(fleet)
    fleet.pods[holder].signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    try:
        wait_until(lambda: fleet.placements(name) == {survivor}, HEALED_WITHIN_S, f"{name} READY on {survivor}")
        healed_after = time.monotonic() - paused_at
        assert any(a.name == name and a.pinned for a in fleet.pods[survivor].state().adapters)
        assert fleet.pod_ids() == [survivor]
    finally:
        fleet.pods[holder].signal(signal.SIGCONT)
    # lost because it did not answer a probe, neither refused nor past its lease
    assert removed(fleet) == {**before, "silent": before["silent"] + 1}
    # once it runs again it joins again, and the pin stays on one pod
    wait_until(lambda: holder in fleet.pod_ids(), WITHIN_S, f"{holder} back in the fleet")
    wait_until(lambda: len(fleet.pinned_on(name)) == 1, WITHIN_S, f"{name} pinned on one pod only")
    results.record(
        "Faults", "pod paused (SIGSTOP), shipped defaults",
        "the pod that pins an adapter stopped with SIGSTOP (its port open, nothing answering, as a partitioned "
        "pod or a lost node looks); control plane and pods on their default leases (10 s lease, 20 s grace), "
        "heartbeats (1 s) and probes (after 3 s of silence, lost after 4 s without an answer); then continued",
        "the pod removed once silent for 4 s and silent to a probe, not after its lease; the pin READY on the "
        "other pod within 10 s; the continued pod joined again and the pin stayed on one pod",
        faults_injected=1, pin_ready_elsewhere_after_s=round(healed_after, 1), pod_lease_s=10)


def test_a_killed_pods_pins_are_ready_elsewhere_without_waiting_for_its_lease(fleet, results):
    name = DEMO_ADAPTERS[2]
    victim, survivor = pinned_once(fleet, name)
    before = removed(fleet)
    fleet.pods[victim].signal(signal.SIGKILL)
    killed_at = time.monotonic()
    fleet.pods[victim].proc.wait(timeout=10)
    wait_until(lambda: fleet.placements(name) == {survivor}, HEALED_WITHIN_S, f"{name} READY on {survivor}")
    healed_after = time.monotonic() - killed_at
    assert survivor in fleet.pinned_on(name)
    assert fleet.pod_ids() == [survivor]
    # removed because its port refused the probe, not because its lease and grace ran out
    assert removed(fleet) == {**before, "refused": before["refused"] + 1}
    results.record(
        "Faults", "pod kill -9, shipped defaults",
        "the pod that pins an adapter killed with SIGKILL; control plane and pods on their default leases "
        "(10 s lease, 20 s grace), heartbeats (1 s) and probes (after 3 s of silence)",
        "the dead pod removed on a refused probe, not after its lease; the pin READY on the other pod within 10 s",
        faults_injected=1, pin_ready_elsewhere_after_s=round(healed_after, 1), pod_lease_s=10)
