"""Replicas that follow popularity, with real processes: a redis-server, a control plane, three CPU pods
on the demo model and a router in front. One adapter made hot through the router gets a second pod
READY, pre-loaded by the leader, the router then spreads its traffic over them, and once the traffic
stops the extra replicas are unloaded again."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from lorafleet.v1 import adapter_admin_pb2 as pb

from benchmarks.processes import Fleet, RouterProcess, copy_demo_adapters, wait_until
from tests.grpc_helpers import collect, request

pytestmark = pytest.mark.slow
# The stated bound: from the first request of the burst to a second READY placement. It takes the pod's
# rate (5 s window) to pass 1 request/s, a heartbeat (0.3 s), a reconcile pass (0.3 s) and one load.
SECOND_REPLICA_WITHIN_S = 60
BURST_MAX_REQUESTS = 200  # the burst stops at the second READY placement, or here
CONCURRENCY = 2  # requests the burst keeps in flight: one pod's worth, so the router alone would not spread
SPREAD_REQUESTS = 16
# Once the traffic stops, the rates fall under 0.2/s per replica within ~10 s (5 s window), then the 3 s hold.
RELEASED_WITHIN_S = 40


@pytest.fixture(scope="module")
def stack(demo_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("replicas-fleet")
    fleet = Fleet(workdir, copy_demo_adapters(tmp_path_factory.mktemp("replicas-adapters")), "--demand-window", "5",
                  pods=3, control_plane_args=("--replica-high-rate", "1.0", "--replica-low-rate", "0.2",
                                              "--replica-hold", "3"))
    router = None
    try:
        fleet.start()
        fleet.register("pirate")  # unpinned: the router's first request loads it on one pod
        router = RouterProcess(workdir, fleet.cp.target, fleet.token_file, "--refresh-interval", "0.3").start()
        yield fleet, router
    finally:
        if router is not None:
            router.stop()
        fleet.stop()


def served(fleet: Fleet) -> dict[str, float]:
    """Generate requests each pod has finished (at a stop or at max_tokens), by its own metrics."""
    return {name: sum(pod.metric("lorafleet_requests_total", outcome=finish) for finish in ("stop", "length"))
            for name, pod in fleet.pods.items()}


def test_a_hot_adapter_gets_a_second_replica_ready_the_router_spreads_its_traffic_and_it_goes_when_cold(stack):
    fleet, router = stack
    assert fleet.placements("pirate") == set()

    started = time.monotonic()
    sent = 0

    def one(_):
        collect(router, request("Say something short.", "pirate", max_tokens=4), timeout=60)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        while len(fleet.placements("pirate")) < 2:
            assert sent < BURST_MAX_REQUESTS and time.monotonic() - started < SECOND_REPLICA_WITHIN_S, \
                f"no second READY placement after {sent} requests: {fleet.adapter('pirate')}"
            list(pool.map(one, range(CONCURRENCY)))
            sent += CONCURRENCY
    ready_after = time.monotonic() - started
    print(f"\nsecond READY placement of pirate after {ready_after:.1f} s and {sent} requests")

    route = fleet.admin().Route(pb.RouteRequest(adapter="pirate"), metadata=fleet.auth(), timeout=5)
    holders = {p.pod for p in route.placements if p.state == pb.READY}
    assert len(holders) >= 2
    assert not any(p.pinned for p in route.placements)  # pre-loaded, not pinned
    assert fleet.cp.metric("lorafleet_control_plane_replica_changes_total", change="added") >= 1

    time.sleep(1.0)  # a few router refreshes: its view shows the new replica resident
    before = served(fleet)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(one, range(SPREAD_REQUESTS)))
    delta = {name: n - before[name] for name, n in served(fleet).items()}
    assert sum(delta.values()) == SPREAD_REQUESTS
    assert sum(1 for n in delta.values() if n > 0) >= 2, f"the router kept the traffic on one pod: {delta}"
    # only pods holding it served it (no cold load on the request path), and the replicas stay while it is hot
    assert {name for name, n in delta.items() if n > 0} <= fleet.placements("pirate"), delta

    quiet = time.monotonic()
    wait_until(lambda: len(fleet.placements("pirate")) == 1, RELEASED_WITHIN_S, "extra replicas released once cold")
    print(f"back to one replica {time.monotonic() - quiet:.1f} s after the traffic stopped")
    assert fleet.cp.metric("lorafleet_control_plane_replica_changes_total", change="released") >= 1
    (kept,) = fleet.placements("pirate")
    assert [name for name, pod in fleet.pods.items() if any(a.name == "pirate" for a in pod.state().adapters)] \
        == [kept]  # unloaded from the pods themselves, not only from the registry's view
