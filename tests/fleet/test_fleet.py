"""The whole fleet as real processes on loopback: a redis-server, a control plane, and two CPU pods
on the demo model that register themselves, load what the control plane places, and heal."""

from __future__ import annotations

import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from lorafleet.v1 import adapter_admin_pb2 as pb

from benchmarks.processes import Fleet, copy_demo_adapters, wait_until
from tests.control_plane.conftest import auth
from tests.grpc_helpers import collect, request

pytestmark = pytest.mark.slow
READY_WITHIN_S = 60


@pytest.fixture(scope="module")
def fleet(demo_model_dir, tmp_path_factory):
    adapter_root = copy_demo_adapters(tmp_path_factory.mktemp("fleet-adapters"))
    fleet = Fleet(tmp_path_factory.mktemp("fleet"), adapter_root)
    try:
        yield fleet.start()
    finally:
        fleet.stop()


def test_register_and_pin_is_ready_on_the_targeted_pods_and_serves(fleet):
    fleet.register("pirate")
    fleet.pin("pirate", 1)
    ready = wait_until(lambda: fleet.placements("pirate"), READY_WITHIN_S, "pirate READY on one pod")
    assert len(ready) == 1
    assert wait_until(lambda: fleet.pinned_on("pirate"), 10, "pod reports the pin") == ready
    pod = fleet.pods[ready.pop()]
    text, _, last = collect(pod, request("What is the tallest mountain?", "pirate", max_tokens=24))
    assert last.usage.completion_tokens > 0 and text
    fleet.pin("pirate", 0)  # every pod
    wait_until(lambda: fleet.pinned_on("pirate") == set(fleet.pods), READY_WITHIN_S, "pirate pinned on every pod")

    def routed_ready_and_pinned():
        # The pods report their placements to the control plane on their own beat, so Route
        # catches up with what the pods already say a moment later.
        route = fleet.admin().Route(pb.RouteRequest(adapter="pirate"), metadata=auth(), timeout=5)
        return {p.pod for p in route.placements if p.state == pb.READY and p.pinned}

    assert wait_until(lambda: routed_ready_and_pinned() == set(fleet.pods), 10,
                      "Route: pirate READY and pinned on every pod")


def test_a_pod_loads_a_registered_adapter_on_demand_and_refuses_an_unregistered_one(fleet):
    fleet.register("shouty")
    pod = fleet.pods["pod-b"]
    text, _, last = collect(pod, request("How do I boil an egg?", "shouty", max_tokens=16))
    assert last.usage.completion_tokens > 0
    assert any(a.name == "shouty" for a in pod.state().adapters)
    with pytest.raises(grpc.RpcError) as e:
        collect(pod, request("Hi", "never-registered", max_tokens=4))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "never-registered" in e.value.details()


def test_bad_adapters_fail_with_the_pods_reason_and_leave_the_others_ready(fleet):
    root = fleet.adapter_root
    shutil.copytree(root / "signoff", root / "corrupt")
    weights = root / "corrupt" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cases = {
        "corrupt": (root / "corrupt", None, "safetensors"),
        "badsha": (root / "signoff", "0" * 64, "sha256"),
        "escape": (root / ".." / ".." / "etc", "1" * 64, "outside the adapter roots"),
    }
    for name, (directory, sha, _) in cases.items():
        fleet.register(name, directory, sha)
        fleet.pin(name, 1)
    for name, (_, _, words) in cases.items():
        try:
            failed = wait_until(lambda n=name: [p for p in fleet.adapter(n).placements if p.state == pb.FAILED],
                                READY_WITHIN_S, f"{name} FAILED")
        except AssertionError as e:
            raise AssertionError(f"{e}: {fleet.adapter(name)}") from None
        assert words in failed[0].error, failed[0].error
        assert not fleet.pinned_on(name)
    assert fleet.pinned_on("pirate") == set(fleet.pods)  # untouched by the failures
    for name in cases:
        fleet.admin().UnregisterAdapter(pb.UnregisterAdapterRequest(name=name), metadata=auth(), timeout=5)


def test_a_control_plane_restart_loses_nothing_and_repeats_no_work(fleet):
    def loads() -> dict[str, str]:
        return {pod_id: [line for line in pod.metrics().splitlines()
                         if line.startswith('lorafleet_adapter_loads_total{outcome="ok",tier="cpu"}')][0]
                for pod_id, pod in fleet.pods.items()}

    before_adapters = {a.name: (a.version, a.pinned) for a in fleet.admin().ListAdapters(
        pb.ListAdaptersRequest(page_size=100), metadata=auth(), timeout=5).adapters}
    before_loads = loads()
    port = fleet.cp.port
    assert fleet.cp.stop(signal.SIGKILL) != 0
    fleet.start_control_plane(port)
    wait_until(lambda: len(fleet.pod_ids()) == 2, timeout_s=20, what="pods heartbeating to the new control plane")
    time.sleep(2.0)  # several reconcile rounds
    after_adapters = {a.name: (a.version, a.pinned) for a in fleet.admin().ListAdapters(
        pb.ListAdaptersRequest(page_size=100), metadata=auth(), timeout=5).adapters}
    assert after_adapters == before_adapters
    assert loads() == before_loads
    assert fleet.pinned_on("pirate") == set(fleet.pods)


def test_pins_of_a_killed_pod_become_ready_elsewhere(fleet):
    fleet.register("signoff")
    fleet.pin("signoff", 1)
    holder = wait_until(lambda: fleet.pinned_on("signoff"), READY_WITHIN_S, "signoff pinned")
    (victim,) = holder
    survivor = next(p for p in fleet.pods if p != victim)
    killed_at = time.monotonic()
    fleet.pods[victim].signal(signal.SIGKILL)
    fleet.pods[victim].proc.wait(timeout=10)
    wait_until(lambda: fleet.pinned_on("signoff") == {survivor}, READY_WITHIN_S, "signoff pinned on the survivor")
    wait_until(lambda: fleet.placements("signoff") == {survivor}, 10, "registry shows it READY on the survivor")
    assert time.monotonic() - killed_at < READY_WITHIN_S
    wait_until(lambda: fleet.pod_ids() == [survivor], 10, "the killed pod removed after its lease and grace")
    with ThreadPoolExecutor(2) as pool:  # the survivor serves both adapters it now pins
        outs = list(pool.map(lambda a: collect(fleet.pods[survivor], request("Hello!", a, max_tokens=8)),
                             ["signoff", "pirate"]))
    assert all(last.usage.completion_tokens > 0 for _, _, last in outs)
