"""Light simulated data-plane pods: many in one asyncio process, each a real gRPC server and a real
heartbeating member of the fleet, with no model behind it.

Each pod serves the real ``DataPlaneAdmin`` service (LoadAdapter, PinAdapter, UnpinAdapter,
UnloadAdapter, GetState) over its own loopback port, behind the same bearer-token and error-status
interceptors and the same fencing guard as a real pod, on an in-memory two-tier cache (device slots
and CPU entries, LRU, pins never evicted). Each heartbeats the control plane through the pod's own
``data_plane.membership.MembershipClient``, and times every heartbeat at the client.

Run as a process (``python benchmarks/light_pods.py --control-plane H:P --pods 100 ...``) it serves
until SIGTERM, then writes a JSON report (every heartbeat's start time, latency and outcome; commands
served) to ``--report``. Tests may run ``LightFleet`` in their own event loop instead.

With ``--traffic-names``, SIGUSR1 starts simulated request traffic: Poisson arrivals at
``--traffic-rate`` per second over the whole fleet, each for an adapter drawn from the file's names
with Zipf(``--traffic-alpha``) popularity and sent to a pod drawn at random. A pod serving a request
loads the adapter (LRU, as a real pod does on a request) and counts it in the per-adapter rates its
heartbeats report. Random pods are the worst case for the control plane: every pod's CPU entries fill
with a different tail of the registry.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from lorafleet.v1 import data_plane_admin_pb2 as pb
from lorafleet.v1 import data_plane_admin_pb2_grpc

from cli.up.child_process import spawn, stop_process, tail
from conventions.auth import BearerAuthInterceptor, read_token
from conventions.status import ErrorStatusInterceptor
from data_plane.demand import DemandMeter
from data_plane.errors import AdapterNotFound, CapacityExceeded
from data_plane.membership import FencingGuard, MembershipClient

RANK = 8  # what every light pod reports as each adapter's rank
DEMAND_WINDOW_S = 30.0  # a real pod's default --demand-window


@dataclass
class _Entry:
    sha256: str
    pinned: bool = False
    on_device: bool = False


class LightCache:
    """The adapter caches of one light pod: ``cpu_entries`` resident adapters at most, ``slots`` of them
    on the device, least recently used evicted first, pinned ones (always on the device) never."""

    def __init__(self, slots: int, cpu_entries: int) -> None:
        self.slots, self.cpu_entries = slots, cpu_entries
        self.entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first

    def load(self, name: str, sha256: str) -> _Entry:
        if name in self.entries:
            self.entries.move_to_end(name)
            self.entries[name].sha256 = sha256
            return self.entries[name]
        if len(self.entries) >= self.cpu_entries:
            del self.entries[self._victim(lambda e: True, "CPU entries")]
        entry = self.entries[name] = _Entry(sha256)
        self._to_device(name, entry)
        return entry

    def pin(self, name: str) -> _Entry:
        entry = self._get(name)
        if not entry.on_device:
            self._to_device(name, entry, required=True)
        entry.pinned = True
        return entry

    def unpin(self, name: str) -> _Entry:
        entry = self._get(name)
        entry.pinned = False
        return entry

    def unload(self, name: str) -> bool:
        return self.entries.pop(name, None) is not None

    def _get(self, name: str) -> _Entry:
        if name not in self.entries:
            raise AdapterNotFound(f"adapter {name!r} is not loaded on this pod; load it first")
        self.entries.move_to_end(name)
        return self.entries[name]

    def _to_device(self, name: str, entry: _Entry, required: bool = False) -> None:
        if sum(e.on_device for e in self.entries.values()) >= self.slots:
            try:
                self.entries[self._victim(lambda e: e.on_device, "device slots", exclude=name)].on_device = False
            except CapacityExceeded:
                if required:
                    raise
                return  # stays in the CPU tier only
        entry.on_device = True

    def _victim(self, eligible, tier: str, exclude: str = "") -> str:
        for name, e in self.entries.items():
            if name != exclude and not e.pinned and eligible(e):
                return name
        raise CapacityExceeded(f"every one of the pod's {tier} holds a pinned adapter; unpin one first")

    def state(self) -> tuple[pb.TierUsage, pb.TierUsage, list[pb.AdapterResidency]]:
        pinned = sum(e.pinned for e in self.entries.values())
        device = sum(e.on_device for e in self.entries.values())
        return (pb.TierUsage(capacity=self.slots, used=device, pinned=pinned),
                pb.TierUsage(capacity=self.cpu_entries, used=len(self.entries), pinned=pinned),
                [residency_pb(n, e) for n, e in self.entries.items()])


def residency_pb(name: str, e: _Entry) -> pb.AdapterResidency:
    return pb.AdapterResidency(name=name, tier=pb.GPU if e.on_device else pb.CPU, pinned=e.pinned, rank=RANK,
                               sha256=e.sha256, slot=-1)


class LightAdmin(data_plane_admin_pb2_grpc.DataPlaneAdminServicer):
    """DataPlaneAdmin on a LightCache, fenced like a real pod's."""

    def __init__(self, pod: LightPod) -> None:
        self._pod = pod

    async def LoadAdapter(self, request, context):
        self._pod.command("load", request.fencing_token)
        return residency_pb(request.name, self._pod.cache.load(request.name, request.sha256))

    async def UnloadAdapter(self, request, context):
        self._pod.command("unload", request.fencing_token)
        return pb.UnloadAdapterResponse(was_resident=self._pod.cache.unload(request.name))

    async def PinAdapter(self, request, context):
        self._pod.command("pin", request.fencing_token)
        return residency_pb(request.name, self._pod.cache.pin(request.name))

    async def UnpinAdapter(self, request, context):
        self._pod.command("unpin", request.fencing_token)
        return residency_pb(request.name, self._pod.cache.unpin(request.name))

    async def GetState(self, request, context):
        return self._pod.state()


@dataclass
class LightPod:
    """One light pod: its cache, its gRPC server (started by ``start``) and its heartbeat loop."""

    pod_id: str
    base_model: str
    cache: LightCache
    guard: FencingGuard = field(default_factory=FencingGuard)
    commands: Counter = field(default_factory=Counter)
    # (wall-clock start, seconds, gRPC status name) of every heartbeat sent
    heartbeats: list[tuple[float, float, str]] = field(default_factory=list)
    port: int = 0
    server: grpc.aio.Server | None = None
    # Per-adapter request rates its heartbeats report, as a real pod's: its heartbeat client reads this
    # meter, so replace it (if at all) before ``beat`` starts.
    demand: DemandMeter = field(default_factory=lambda: DemandMeter(window_s=DEMAND_WINDOW_S))
    refused: int = 0  # simulated requests refused: every CPU entry held a pinned adapter

    def serve(self, name: str, sha256: str) -> None:
        """One simulated request for ``name``: its rate counted, and the adapter loaded (or touched) unless
        every CPU entry holds a pinned adapter, which a real pod refuses the same way."""
        self.demand.record(name)
        try:
            self.cache.load(name, sha256)
        except CapacityExceeded:
            self.refused += 1

    def command(self, kind: str, fencing_token: int) -> None:
        self.guard.check(fencing_token)
        self.commands[kind] += 1

    def state(self) -> pb.PodState:
        slots, cpu, adapters = self.cache.state()
        return pb.PodState(slots=slots, cpu_cache=cpu, adapters=adapters, pod_id=self.pod_id,
                           base_model=self.base_model)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, token: str) -> None:
        self.server = grpc.aio.server(interceptors=[
            BearerAuthInterceptor(token, protected=("/lorafleet.v1.DataPlaneAdmin/",)), ErrorStatusInterceptor()])
        data_plane_admin_pb2_grpc.add_DataPlaneAdminServicer_to_server(LightAdmin(self), self.server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    async def beat(self, control_plane: str, token: str, interval_s: float, stop: asyncio.Event) -> None:
        """Heartbeats every ``interval_s`` (the first after a random part of it, so that a fleet
        started at once spreads its beats) until ``stop``, then says goodbye (ready=false)."""
        client = MembershipClient(control_plane, token, self.pod_id, self.endpoint, self.base_model, self.state,
                                  interval_s, guard=self.guard, demand=self.demand)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), random.uniform(0, interval_s))
        while not stop.is_set():
            started, wall = time.perf_counter(), time.time()
            try:
                await client.heartbeat()
                code = "OK"
            except grpc.aio.AioRpcError as e:
                code = e.code().name
            self.heartbeats.append((wall, time.perf_counter() - started, code))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await asyncio.wait_for(client.heartbeat(ready=False), timeout=1.0)
        await client.close()


class LightFleet:
    """``pods`` light pods named ``{prefix}-000``, ... heartbeating ``control_plane`` every ``interval_s``."""

    def __init__(self, control_plane: str, token: str, pods: int, base_model: str, slots: int = 8,
                 cpu_entries: int = 64, interval_s: float = 3.0, prefix: str = "light") -> None:
        self.control_plane, self.token, self.interval_s = control_plane, token, interval_s
        self.pods = [LightPod(f"{prefix}-{i:03d}", base_model, LightCache(slots, cpu_entries)) for i in range(pods)]
        self._stop = asyncio.Event()
        self._beats: list[asyncio.Task] = []
        self.requests = 0  # simulated requests served (``traffic``)

    async def start(self) -> LightFleet:
        for pod in self.pods:
            await pod.start(self.token)
        self._beats = [asyncio.create_task(p.beat(self.control_plane, self.token, self.interval_s, self._stop))
                       for p in self.pods]
        return self

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._beats, return_exceptions=True)
        await asyncio.gather(*(p.server.stop(0) for p in self.pods if p.server))

    async def traffic(self, adapters: list[tuple[str, str]], rate: float, alpha: float, seed: int = 0) -> None:
        """Serves simulated requests until ``stop``: Poisson arrivals at ``rate`` per second, each for one of
        ``adapters`` ((name, sha256), Zipf(``alpha``) popularity in list order) on a pod drawn at random."""
        if not adapters or rate <= 0:
            raise ValueError(f"traffic needs adapters and a rate above 0, got {len(adapters)} and {rate}")
        rng = random.Random(seed)
        weights = list(itertools.accumulate(1.0 / (i + 1) ** alpha for i in range(len(adapters))))
        due = time.monotonic()
        while not self._stop.is_set():
            due += rng.expovariate(rate)
            # Behind schedule it still yields, so that a burst of arrivals never holds up the heartbeats.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), max(0.0, due - time.monotonic()))
            if self._stop.is_set():
                break
            name, sha256 = rng.choices(adapters, cum_weights=weights)[0]
            rng.choice(self.pods).serve(name, sha256)
            self.requests += 1

    def report(self) -> dict:
        return {"heartbeats": [b for p in self.pods for b in p.heartbeats], "requests": self.requests,
                "refused": sum(p.refused for p in self.pods),
                "held": sum(len(p.cache.entries) for p in self.pods),
                "distinct_held": len({n for p in self.pods for n in p.cache.entries}),
                "commands": dict(sum((p.commands for p in self.pods), Counter())),
                "pinned": {p.pod_id: sorted(n for n, e in p.cache.entries.items() if e.pinned) for p in self.pods}}


class LightPodsProcess:
    """``python benchmarks/light_pods.py`` as a child process; ``stop`` ends it and returns its report."""

    def __init__(self, workdir: Path, control_plane: str, token_file: Path, pods: int, base_model: str,
                 *extra_args: str) -> None:
        self.report_path = workdir / "light-pods.json"
        self.log_path = workdir / "light-pods.log"
        self.args = [sys.executable, str(Path(__file__).resolve()), "--control-plane", control_plane,
                     "--token-file", str(token_file), "--pods", str(pods), "--base-model", base_model,
                     "--report", str(self.report_path), *extra_args]
        self.proc: subprocess.Popen | None = None

    def start(self) -> LightPodsProcess:
        self.proc = spawn(self.args, self.log_path, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        return self

    def stop(self) -> dict:
        """SIGTERM, then the report it writes on the way out."""
        code = stop_process(self.proc, timeout_s=60)
        if code != 0 or not self.report_path.exists():
            raise RuntimeError(f"light pods exited with {code} and no report:\n{tail(self.log_path)}")
        return json.loads(self.report_path.read_text())


async def _serve(args: argparse.Namespace) -> None:
    fleet = LightFleet(args.control_plane, read_token(args.token_file), args.pods, args.base_model, args.slots,
                       args.cpu_entries, args.heartbeat_interval)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await fleet.start()
    traffic: list[asyncio.Task] = []
    if args.traffic_names:
        adapters = [tuple(line.split()) for line in args.traffic_names.read_text().splitlines() if line.strip()]

        def start_traffic() -> None:  # once, on the first SIGUSR1
            if not traffic:
                traffic.append(asyncio.create_task(fleet.traffic(adapters, args.traffic_rate, args.traffic_alpha)))

        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, start_traffic)
    print(f"serving {len(fleet.pods)} light pods", flush=True)
    await stop.wait()
    await fleet.stop()
    report = fleet.report()
    for outcome in await asyncio.gather(*traffic, return_exceptions=True):
        if isinstance(outcome, BaseException):
            report["traffic_error"] = repr(outcome)
            print(f"traffic failed: {outcome!r}", flush=True)
    args.report.write_text(json.dumps(report))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--control-plane", required=True, help="host:port of the control plane to heartbeat")
    p.add_argument("--token-file", type=Path, required=True, help="bearer token the control plane and pods share")
    p.add_argument("--pods", type=int, default=100)
    p.add_argument("--base-model", required=True)
    p.add_argument("--slots", type=int, default=8, help="device slots per pod")
    p.add_argument("--cpu-entries", type=int, default=64, help="CPU cache entries per pod")
    p.add_argument("--heartbeat-interval", type=float, default=3.0, help="seconds (a real pod's default: 3)")
    p.add_argument("--report", type=Path, required=True, help="where to write the JSON report on SIGTERM")
    p.add_argument("--traffic-names", type=Path,
                   help="file of 'name sha256' lines, most popular first: SIGUSR1 starts traffic over them")
    p.add_argument("--traffic-rate", type=float, default=200.0, help="simulated requests per second, whole fleet")
    p.add_argument("--traffic-alpha", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    asyncio.run(_serve(p.parse_args()))


if __name__ == "__main__":
    main()
