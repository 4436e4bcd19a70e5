"""Faults injected into real processes: a pod killed mid-stream, the control plane killed during a
burst of writes, Redis killed during writes, and a pod cut off from the control plane while it runs."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from lorafleet.v1 import adapter_admin_pb2 as pb
from lorafleet.v1 import adapter_admin_pb2_grpc as pb_grpc
from lorafleet.v1 import data_plane_admin_pb2 as dpa

from benchmarks.processes import (
    FLEET_BASE_MODEL,
    TOKEN,
    ControlPlaneProcess,
    Fleet,
    RedisServer,
    copy_demo_adapters,
    wait_until,
)
from data_plane.demo_adapters import DEMO_ADAPTERS
from tests.control_plane.conftest import auth
from tests.grpc_helpers import collect, request
from tests.reliability.proxy import TcpProxy

pytestmark = pytest.mark.slow
SHA = "0123456789abcdef" * 4
WRITERS = 8
MOVE_WITHIN_S = 60


class WriteBurst:
    """WRITERS threads registering adapters (each name once) and pinning every other one, until
    stopped; records which calls returned OK and how many were in flight at any moment."""

    def __init__(self, target: str, prefix: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.admin = pb_grpc.AdapterAdminStub(self.channel)
        self.prefix = prefix
        self.registered: list[str] = []  # acknowledged
        self.pinned: list[str] = []  # acknowledged
        self.failed: dict[str, int] = {}
        self.in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._write, args=(i,), daemon=True) for i in range(WRITERS)]

    def __enter__(self) -> WriteBurst:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        self.channel.close()
        assert not any(t.is_alive() for t in self._threads), "a write hung"

    def acknowledged(self) -> int:
        with self._lock:
            return len(self.registered) + len(self.pinned)

    def _call(self, method, req) -> bool:
        with self._lock:
            self.in_flight += 1
        try:
            method(req, metadata=auth(), timeout=5)
            return True
        except grpc.RpcError as e:
            with self._lock:
                self.failed[e.code().name] = self.failed.get(e.code().name, 0) + 1
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            time.sleep(0.05)
            return False
        finally:
            with self._lock:
                self.in_flight -= 1

    def _write(self, writer: int) -> None:
        n = 0
        while not self._stop.is_set():
            name = f"{self.prefix}-{writer}-{n}"
            n += 1
            req = pb.RegisterAdapterRequest(name=name, source=f"file:///adapters/{name}", sha256=SHA,
                                            base_model=FLEET_BASE_MODEL)
            if not self._call(self.admin.RegisterAdapter, req):
                continue
            with self._lock:
                self.registered.append(name)
            if n % 2 and self._call(self.admin.PinAdapter, pb.PinAdapterRequest(name=name, replicas=1)):
                with self._lock:
                    self.pinned.append(name)


def registry(target: str) -> list[pb.Adapter]:
    """Every adapter the control plane lists, all pages."""
    with grpc.insecure_channel(target) as channel:
        admin, adapters, token = pb_grpc.AdapterAdminStub(channel), [], ""
        while True:
            page = admin.ListAdapters(pb.ListAdaptersRequest(page_size=500, page_token=token), metadata=auth(),
                                      timeout=10)
            adapters += page.adapters
            if not (token := page.next_page_token):
                return adapters


def check_nothing_acknowledged_lost(burst: WriteBurst, target: str) -> tuple[int, int]:
    """(acknowledged writes, those found afterwards), asserting they are equal and no name is listed twice."""
    adapters = registry(target)
    names = [a.name for a in adapters]
    assert len(names) == len(set(names)), "an adapter is listed twice"
    by_name = {a.name: a for a in adapters}
    lost = [n for n in burst.registered if n not in by_name]
    unpinned = [n for n in burst.pinned if n not in by_name or not by_name[n].pinned]
    assert not lost and not unpinned, f"acknowledged but lost: {lost[:5]} registrations, {unpinned[:5]} pins"
    assert all(by_name[n].version == 2 for n in burst.pinned), "a pin applied twice or not at all"
    found = sum(n in by_name for n in burst.registered) + sum(by_name[n].pinned for n in burst.pinned)
    return burst.acknowledged(), found


@pytest.fixture
def control_plane_on_redis(tmp_path):
    redis = RedisServer(tmp_path)
    redis.start()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    started: list[ControlPlaneProcess] = []

    def start(port: int | None = None) -> ControlPlaneProcess:
        started.append(ControlPlaneProcess(redis.url, token_file, tmp_path, f"cp{len(started)}", port,
                                           base_model=FLEET_BASE_MODEL).start())
        return started[-1]

    yield redis, start
    for cp in started:
        cp.stop(signal.SIGKILL)
    redis.kill()


def _burst_through(fault, target: str, prefix: str) -> tuple[WriteBurst, int, int]:
    """Runs a write burst, injects ``fault`` once writes are acknowledged, and goes on writing until
    writes are acknowledged again; returns (burst, writes acknowledged before the fault, in flight then)."""
    with WriteBurst(target, prefix) as burst:
        wait_until(lambda: burst.acknowledged() >= 20, 30, "writes acknowledged before the fault")
        before, in_flight = burst.acknowledged(), burst.in_flight
        fault()
        wait_until(lambda: burst.acknowledged() >= before + 20, 60, "writes acknowledged after the fault")
    return burst, before, in_flight


def test_control_plane_killed_during_a_write_burst_keeps_every_acknowledged_write_once(control_plane_on_redis,
                                                                                      results):
    _, start = control_plane_on_redis
    cp = start()

    def kill_and_restart():
        assert cp.stop(signal.SIGKILL) != 0
        start(cp.port)

    burst, before, in_flight = _burst_through(kill_and_restart, cp.target, "cp-kill")
    acknowledged, found = check_nothing_acknowledged_lost(burst, cp.target)
    assert burst.failed.get("UNAVAILABLE", 0) > 0, "the kill must interrupt some writes"
    results.record(
        "Faults", "control plane kill -9 during writes",
        f"{WRITERS} clients registering adapters and pinning every other one; the control plane killed with "
        "SIGKILL and restarted on the same port mid-burst",
        "every write that returned OK is in the registry afterwards, no adapter twice, each acknowledged pin "
        "applied once (version 2); interrupted calls UNAVAILABLE, none hung",
        faults_injected=1, requests_in_flight=in_flight, acknowledged_before_fault=before,
        acknowledged_writes=acknowledged, found_after=found,
        failed_during_fault=sum(burst.failed.values()))


def test_redis_killed_during_writes_loses_no_acknowledged_write(control_plane_on_redis, results):
    redis, start = control_plane_on_redis
    cp = start()
    burst, before, in_flight = _burst_through(redis.restart, cp.target, "redis-kill")
    acknowledged, found = check_nothing_acknowledged_lost(burst, cp.target)
    assert sum(burst.failed.values()) > 0, "the restart must interrupt some writes"
    results.record(
        "Faults", "Redis kill -9 during writes",
        f"{WRITERS} clients writing through the control plane; redis-server (AOF, appendfsync always) killed "
        "with SIGKILL and started again on its files mid-burst",
        "every acknowledged write present after the restart, no adapter twice; writes during the outage "
        "UNAVAILABLE, none hung",
        faults_injected=1, requests_in_flight=in_flight, acknowledged_before_fault=before,
        acknowledged_writes=acknowledged, found_after=found, failed_during_fault=sum(burst.failed.values()))


class PartitionableFleet(Fleet):
    """The Fleet, each pod heartbeating through a TcpProxy that a test can cut."""

    def start_control_plane(self, port: int | None = None, replica: str = "cp") -> None:
        super().start_control_plane(port, replica)
        self.proxies: dict[str, TcpProxy] = getattr(self, "proxies", {})

    def control_plane_for(self, pod_name: str) -> str:
        self.proxies[pod_name] = TcpProxy(self.cp.port).restore()
        return self.proxies[pod_name].address

    def stop(self) -> None:
        for proxy in self.proxies.values():
            proxy.cut()
        super().stop()


@pytest.fixture(scope="module")
def fleet(demo_model_dir, tmp_path_factory):
    adapter_root = copy_demo_adapters(tmp_path_factory.mktemp("faults-adapters"))
    fleet = PartitionableFleet(tmp_path_factory.mktemp("faults-fleet"), adapter_root)
    try:
        yield fleet.start()
    finally:
        fleet.stop()


def test_a_pod_cut_off_from_the_control_plane_is_fenced_and_refuses_stale_commands(fleet, results):
    name = DEMO_ADAPTERS[0]
    fleet.register(name)
    fleet.pin(name, 1)
    (cut_id,) = wait_until(lambda: fleet.pinned_on(name), MOVE_WITHIN_S, f"{name} pinned on one pod")
    other = next(p for p in fleet.pods if p != cut_id)
    cut = fleet.pods[cut_id]
    old_token = int(fleet.cp.metric("lorafleet_control_plane_fencing_token"))
    assert old_token > 0
    fleet.proxies[cut_id].cut()
    cut_at = time.monotonic()
    # still running and serving its clients, but out of the fleet: its pins move, routing avoids it
    assert collect(cut, request("Hello", name, max_tokens=3))[2].usage.completion_tokens == 3
    wait_until(lambda: fleet.pod_ids() == [other], MOVE_WITHIN_S, "the silent pod removed")
    wait_until(lambda: other in fleet.pinned_on(name), MOVE_WITHIN_S, f"{name} pinned on {other}")
    route = fleet.admin().Route(pb.RouteRequest(adapter=name), metadata=auth(), timeout=5)
    assert cut_id not in {p.pod for p in route.placements}
    moved_after = time.monotonic() - cut_at
    # a new leader while it is cut off: kill -9 the control plane and start another
    port = fleet.cp.port
    fleet.cp.stop(signal.SIGKILL)
    fleet.start_control_plane(port, replica="cp-2")
    new_token = wait_until(lambda: int(fleet.cp.metric("lorafleet_control_plane_fencing_token") or 0), 20,
                           "a new leader")
    assert new_token > old_token
    fleet.proxies[cut_id].restore()
    wait_until(lambda: sorted(fleet.pod_ids()) == sorted(fleet.pods), 30, "the pod back in the fleet")
    before = cut.state()
    with pytest.raises(grpc.RpcError) as e:  # a command from the deposed leader arrives late
        cut.admin().UnloadAdapter(dpa.UnloadAdapterRequest(name=name, fencing_token=old_token), metadata=cut.auth(),
                                  timeout=10)
    assert e.value.code() == grpc.StatusCode.ABORTED
    assert f"fencing token {old_token}" in e.value.details()
    assert [(a.name, a.pinned) for a in cut.state().adapters] == [(a.name, a.pinned) for a in before.adapters]
    # the fleet converges on the pin's one replica: the returning pod and the other do not both keep it
    wait_until(lambda: len(fleet.pinned_on(name)) == 1, MOVE_WITHIN_S, f"{name} pinned on one pod only")
    results.record(
        "Faults", "pod stops heartbeating but keeps running",
        "the TCP path from one pod to the control plane cut while the pod runs (it still serves its clients); "
        "the control plane killed and restarted meanwhile (a new leader); the path restored; then a command "
        "carrying the deposed leader's fencing token sent to the pod",
        "the pod removed from the fleet and from routing, its pin moved to the other pod; on return the stale "
        "command ABORTED with nothing changed, and the pin left on one pod only",
        faults_injected=2, pin_moved_after_s=round(moved_after, 1), old_fencing_token=old_token,
        new_fencing_token=new_token, stale_commands_refused=1)


def test_a_pod_killed_mid_stream_fails_its_streams_unavailable_and_its_pins_move(fleet, results):
    name = DEMO_ADAPTERS[1]
    fleet.register(name)
    fleet.pin(name, 1)
    (victim_id,) = wait_until(lambda: fleet.pinned_on(name), MOVE_WITHIN_S, f"{name} pinned on one pod")
    survivor = next(p for p in fleet.pods if p != victim_id)
    victim = fleet.pods[victim_id]
    streams = [victim.generation().Generate(request("Tell me a long story.", name, max_tokens=400,
                                                    ignore_eos=True), timeout=120) for _ in range(3)]
    for call in streams:
        next(call)  # every stream has started
    victim.signal(signal.SIGKILL)
    killed_at = time.monotonic()

    def drain(call) -> tuple[grpc.StatusCode, float]:
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            return e.code(), time.monotonic() - killed_at
        return grpc.StatusCode.OK, time.monotonic() - killed_at

    with ThreadPoolExecutor(len(streams)) as pool:
        ends = list(pool.map(drain, streams))
    assert [code for code, _ in ends] == [grpc.StatusCode.UNAVAILABLE] * len(streams)
    assert max(t for _, t in ends) < 10, f"streams ended {ends} after the kill"
    victim.proc.wait(timeout=10)
    wait_until(lambda: fleet.pinned_on(name) == {survivor}, MOVE_WITHIN_S, f"{name} pinned on {survivor}")
    moved_after = time.monotonic() - killed_at
    wait_until(lambda: fleet.placements(name) == {survivor}, 10, "registry shows it READY on the survivor")
    assert collect(fleet.pods[survivor], request("Hello", name, max_tokens=3))[2].usage.completion_tokens == 3
    results.record(
        "Faults", "pod kill -9 mid-stream",
        f"{len(streams)} Generate streams (400 tokens each) running on the pod that pins an adapter; the pod "
        "killed with SIGKILL",
        "every stream ended UNAVAILABLE within seconds, none hung; the pin READY on the other pod, which serves it",
        faults_injected=1, requests_in_flight=len(streams),
        streams_unavailable=sum(c == grpc.StatusCode.UNAVAILABLE for c, _ in ends),
        slowest_stream_end_s=round(max(t for _, t in ends), 2), pin_moved_after_s=round(moved_after, 1))
