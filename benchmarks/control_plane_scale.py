"""The control plane at size, with real processes: one redis-server, one control plane (shipped timing:
2 s reconcile interval, 10 s pod lease) and ``--pods`` light simulated pods in one separate process
(benchmarks/light_pods.py: real DataPlaneAdmin servers and real heartbeats, in-memory caches).

Phases, in order, on one fleet:
0. ``baseline``: ``--baseline-seconds`` of heartbeats to an empty registry: what this machine gives
   a heartbeat when the control plane has nothing to do (the floor for every latency below).
1. ``register``: ``--adapters`` adapters registered through AdapterAdmin.RegisterAdapter,
   ``--concurrency`` calls in flight; Redis ``used_memory`` before and after, per adapter.
2. ``pin``: ``--pins`` of them pinned with ``--pin-replicas`` replicas each; the time until the
   control plane has had every placement loaded and pinned (its pod-command counter) and no pin is
   unsatisfied.
3. ``admin``: GetAdapter, RegisterAdapter (new names) and PinAdapter (one replica, unpinned adapters)
   in turn, ``--admin-calls`` of each, one call at a time: latency p50/p99/max under the heartbeat load.
4. ``list``: ListAdapters paging over every adapter, at page sizes 100 and 1000: time per page and for
   the whole listing; every adapter is checked to come back exactly once.
5. ``idle``: ``--idle-seconds`` with no admin traffic: reconcile passes over the settled fleet.
6. ``traffic``: ``--traffic-seconds`` of simulated requests in the light pods (``--traffic-rate`` per
   second, Zipf(``--traffic-alpha``) over the registered adapters, each on a random pod): the pods'
   CPU entries fill with unpinned adapters and their heartbeats report per-adapter rates, so passes
   read what the pods hold and the leader replicates the hottest; GetAdapter is timed one call at a
   time throughout.

Reconcile passes are read from the control plane's own Prometheus histogram
(``lorafleet_control_plane_reconcile_duration_seconds``), scraped every 0.1 s: between two scrapes that
saw one more pass, the sum grew by exactly that pass's duration. Heartbeat latency is timed at each
light pod's client; the control plane's RPC histogram gives, per phase, the bucket holding the p99 of
its own handling time of each RPC; /proc gives each process's CPU share. Prints markdown tables for
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import grpc
import redis
from light_pods import LightPodsProcess  # benchmarks/light_pods.py
from lorafleet.v1 import adapter_admin_pb2 as pb
from lorafleet.v1 import adapter_admin_pb2_grpc as pb_grpc
from processes import (
    TOKEN,
    ControlPlaneProcess,
    RedisServer,
    cpu_model,
    cpu_seconds,
    load_average,
    sample_value,
    scrape,
    wait_until,
)

from conventions.auth import bearer_metadata

BASE_MODEL = "smollm2-135m"
SHA = "ab" * 32
AUTH = bearer_metadata(TOKEN)
PASSES = "lorafleet_control_plane_reconcile_duration_seconds"
RPC_SECONDS = "lorafleet_control_plane_rpc_duration_seconds"
HANDLED = ("Heartbeat", "GetAdapter", "RegisterAdapter", "PinAdapter", "ListAdapters")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def ms(values: list[float]) -> str:
    return f"{pct(values, 0.5) * 1000:.1f} / {pct(values, 0.99) * 1000:.1f} / {max(values) * 1000:.1f} ms"


def handling_buckets(text: str) -> dict[str, dict[float, float]]:
    """RPC method -> the control plane's handling-time histogram (upper bound -> cumulative count)."""
    out: dict[str, dict[float, float]] = {}
    for line in text.splitlines():
        if line.startswith(RPC_SECONDS + "_bucket{"):
            labels, value = line[len(RPC_SECONDS + "_bucket{"):].rsplit("} ", 1)
            fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            out.setdefault(fields["method"].rsplit("/", 1)[1], {})[float(fields["le"])] = float(value)
    return out


@dataclass
class Sample:
    t: float
    passes: float  # reconcile passes so far
    pass_seconds: float  # their total duration
    cpu: dict[str, float]  # process -> CPU seconds so far
    handling: dict[str, dict[float, float]]  # see handling_buckets


class Sampler(threading.Thread):
    """Every ``period_s``: scrapes the control plane's reconcile and RPC-handling histograms and reads
    the CPU time the processes ``pids`` have used."""

    def __init__(self, metrics_port: int, pids: dict[str, int], period_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.port, self.pids, self.period_s = metrics_port, pids, period_s
        self.samples: list[Sample] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                text = scrape(self.port)
                cpu = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
                self.samples.append(Sample(time.time(), sample_value(text, PASSES + "_count"),
                                           sample_value(text, PASSES + "_sum"), cpu, handling_buckets(text)))
            except OSError:
                pass
            self.halt.wait(self.period_s)

    def passes(self, t0: float, t1: float) -> list[float]:
        """The duration of each pass that ended between t0 and t1 (the mean, where one scrape saw several)."""
        out = []
        for a, b in zip(self.samples, self.samples[1:], strict=False):
            if t0 <= b.t <= t1 and b.passes > a.passes:
                out += [(b.pass_seconds - a.pass_seconds) / (b.passes - a.passes)] * int(b.passes - a.passes)
        return out

    def _span(self, t0: float, t1: float) -> tuple[Sample, Sample] | None:
        within = [x for x in self.samples if t0 <= x.t <= t1]
        return (within[0], within[-1]) if len(within) >= 2 else None

    def cpu_share(self, t0: float, t1: float) -> dict[str, float]:
        """Each process's CPU seconds per second between t0 and t1."""
        if not (span := self._span(t0, t1)):
            return {}
        a, b = span
        return {name: (b.cpu[name] - a.cpu[name]) / (b.t - a.t) for name in self.pids}

    def handling_p99(self, method: str, t0: float, t1: float) -> str:
        """The histogram bucket that holds the 99th percentile of ``method``'s handling time between t0 and t1."""
        if not (span := self._span(t0, t1)):
            return "-"
        a, b = (x.handling.get(method, {}) for x in span)
        counts = {le: n - a.get(le, 0.0) for le, n in sorted(b.items())}
        total = counts.get(float("inf"), 0.0)
        if not total:
            return "-"
        bound = next(le for le, n in counts.items() if n >= 0.99 * total)
        return f"<= {bound * 1000:g} ms" if bound != float("inf") else "> 10 s"


class Admin:
    """An asyncio AdapterAdmin client that times every call."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.AdapterAdminStub(self.channel)

    async def timed(self, method: str, request) -> tuple[float, object]:
        started = time.perf_counter()
        reply = await getattr(self.stub, method)(request, metadata=AUTH, timeout=60)
        return time.perf_counter() - started, reply

    async def register(self, name: str) -> float:
        return (await self.timed("RegisterAdapter", pb.RegisterAdapterRequest(
            name=name, source=f"file:///adapters/{name}", sha256=SHA, base_model=BASE_MODEL)))[0]

    async def pin(self, name: str, replicas: int) -> float:
        return (await self.timed("PinAdapter", pb.PinAdapterRequest(name=name, replicas=replicas)))[0]

    async def many(self, calls, concurrency: int) -> list[float]:
        gate = asyncio.Semaphore(concurrency)

        async def one(call):
            async with gate:
                return await call

        return list(await asyncio.gather(*(one(c) for c in calls)))

    async def all_placed(self, names: list[str], replicas: int) -> bool:
        """Whether GetAdapter shows each of ``names`` READY and pinned on exactly ``replicas`` pods."""
        replies = await self.many([self.timed("GetAdapter", pb.GetAdapterRequest(name=n)) for n in names], 8)
        return all(sum(p.state == pb.READY and p.pinned for p in a.placements) == replicas for _, a in replies)

    async def list_all(self, page_size: int) -> tuple[list[float], list[str]]:
        pages, names, token = [], [], ""
        while True:
            seconds, reply = await self.timed("ListAdapters", pb.ListAdaptersRequest(page_size=page_size,
                                                                                    page_token=token))
            pages.append(seconds)
            names += [a.name for a in reply.adapters]
            token = reply.next_page_token
            if not token:
                return pages, names


def progress(what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def adapter_name(i: int) -> str:
    return f"scale-{i:05d}"


async def run(args: argparse.Namespace, cp: ControlPlaneProcess, r: redis.Redis, marks: dict, out: dict,
              start_traffic) -> None:
    admin = Admin(cp.target)
    names = [adapter_name(i) for i in range(args.adapters)]

    progress(f"baseline: {args.baseline_seconds} s of heartbeats to an empty registry")
    marks["baseline"] = time.time()
    await asyncio.sleep(args.baseline_seconds)
    progress(f"registering {args.adapters} adapters")
    marks["register"] = time.time()
    before = r.info("memory")
    started = time.perf_counter()
    out["register"] = await admin.many([admin.register(n) for n in names], args.concurrency)
    out["register_s"] = time.perf_counter() - started
    after = r.info("memory")
    out["memory_per_adapter"] = (after["used_memory"] - before["used_memory"]) / args.adapters
    out["dataset_per_adapter"] = (after["used_memory_dataset"] - before["used_memory_dataset"]) / args.adapters

    progress(f"pinning {args.pins} adapters")
    marks["pin"] = time.time()
    pinned = random.Random(7).sample(names, args.pins)
    started = time.perf_counter()
    out["pin"] = await admin.many([admin.pin(n, args.pin_replicas) for n in pinned], args.concurrency)
    want = args.pins * args.pin_replicas
    deadline = time.monotonic() + args.converge_timeout
    while not await admin.all_placed(pinned, args.pin_replicas):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{want} placements not READY and pinned within {args.converge_timeout} s")
        await asyncio.sleep(1.0)
    out["converge_s"] = time.perf_counter() - started
    progress("admin calls")

    marks["admin"] = time.time()
    rest = [n for n in names if n not in set(pinned)]
    gets, registers, pins = [], [], []
    for i in range(args.admin_calls):
        gets.append((await admin.timed("GetAdapter", pb.GetAdapterRequest(name=random.choice(names))))[0])
        registers.append(await admin.register(f"extra-{i:05d}"))
        pins.append(await admin.pin(rest[i], 1))
    out["admin"] = {"GetAdapter": gets, "RegisterAdapter": registers, "PinAdapter (1 replica)": pins}

    progress("listing")
    marks["list"] = time.time()
    expected = sorted(names + [f"extra-{i:05d}" for i in range(args.admin_calls)])
    out["list"] = {}
    for size in (100, 1000):
        started = time.perf_counter()
        pages, listed = await admin.list_all(size)
        if listed != expected:
            raise AssertionError(f"ListAdapters at page size {size} returned {len(listed)} names, "
                                 f"{len(set(listed))} distinct, not each of the {len(expected)} once")
        out["list"][size] = (pages, time.perf_counter() - started)

    progress("idle")
    marks["idle"] = time.time()
    await asyncio.sleep(args.idle_seconds)

    progress(f"traffic: {args.traffic_rate:.0f} requests/s for {args.traffic_seconds} s")
    marks["traffic"] = time.time()
    start_traffic()
    gets = []
    while time.time() - marks["traffic"] < args.traffic_seconds:
        gets.append((await admin.timed("GetAdapter", pb.GetAdapterRequest(name=random.choice(names))))[0])
        await asyncio.sleep(0.2)
    out["traffic"] = gets
    marks["end"] = time.time()
    await admin.channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--pins", type=int, default=300)
    parser.add_argument("--pin-replicas", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8, help="device slots per light pod (one stays unpinned)")
    parser.add_argument("--concurrency", type=int, default=32, help="admin calls in flight while registering")
    parser.add_argument("--admin-calls", type=int, default=100, help="calls of each kind in the admin phase")
    parser.add_argument("--heartbeat-interval", type=float, default=3.0)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--traffic-seconds", type=float, default=40.0)
    parser.add_argument("--traffic-rate", type=float, default=300.0, help="simulated requests per second, whole fleet")
    parser.add_argument("--traffic-alpha", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    parser.add_argument("--baseline-seconds", type=float, default=15.0,
                        help="heartbeats to an empty registry first: this machine's floor for the latencies")
    parser.add_argument("--converge-timeout", type=float, default=600.0, help="seconds to wait for the pins")
    parser.add_argument("--keep", type=Path, help="copy the processes' logs here at the end")
    args = parser.parse_args()
    if (args.pins * args.pin_replicas + args.admin_calls) > args.pods * (args.slots - 1):
        parser.error("more pinned replicas than the pods' pinned capacity (pods x (slots - 1))")
    if args.pins + args.admin_calls > args.adapters:
        parser.error("--pins plus --admin-calls must not exceed --adapters")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the finally below stops every child
    marks: dict[str, float] = {}
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        token_file = workdir / "token"
        token_file.write_text(TOKEN + "\n")
        server = RedisServer(workdir, durable=False)
        server.start()
        cp = pods = sampler = None
        try:
            cp = ControlPlaneProcess(server.url, token_file, workdir, "cp", base_model=BASE_MODEL, lease_s=None).start()
            traffic_names = workdir / "traffic-names"
            popularity = [adapter_name(i) for i in range(args.adapters)]
            random.Random(11).shuffle(popularity)  # popularity unrelated to which adapters are pinned
            traffic_names.write_text("".join(f"{n} {SHA}\n" for n in popularity))
            pods = LightPodsProcess(workdir, cp.target, token_file, args.pods, BASE_MODEL, "--slots", str(args.slots),
                                    "--heartbeat-interval", str(args.heartbeat_interval),
                                    "--traffic-names", str(traffic_names), "--traffic-rate", str(args.traffic_rate),
                                    "--traffic-alpha", str(args.traffic_alpha)).start()
            sampler = Sampler(cp.metrics_port, {"control plane": cp.proc.pid, "light pods": pods.proc.pid,
                                                    "redis-server": server.proc.pid})
            sampler.start()
            progress(f"waiting for {args.pods} light pods")
            wait_until(lambda: cp.metric("lorafleet_control_plane_pods", ready="true") == args.pods, 120,
                       f"{args.pods} light pods ready")
            client = redis.Redis(port=server.port)
            asyncio.run(run(args, cp, client, marks, out, lambda: pods.proc.send_signal(signal.SIGUSR1)))
            report = pods.stop()
            pods = None
            if "traffic_error" in report:
                raise RuntimeError(f"the light pods' traffic failed: {report['traffic_error']}")
        finally:
            if sampler:
                sampler.halt.set()
            if pods:
                pods.stop()
            if cp:
                cp.stop()
            server.kill()
            if args.keep:
                shutil.copytree(workdir, args.keep, dirs_exist_ok=True)
    print_report(args, marks, out, report, sampler)


def print_report(args: argparse.Namespace, marks: dict, out: dict, report: dict, sampler: Sampler) -> None:
    phases = ["baseline", "register", "pin", "admin", "list", "idle", "traffic"]
    bounds = {p: (marks[p], marks[phases[i + 1]] if i + 1 < len(phases) else marks["end"])
              for i, p in enumerate(phases)}
    beats = report["heartbeats"]
    failed = [b for b in beats if b[2] != "OK"]
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu_model()} ({platform.machine()}), "
          f"Python {platform.python_version()}, grpcio {version('grpcio')}, redis-py {version('redis')}, "
          f"load average {load_average()}")
    print(f"{args.pods} light pods (heartbeat every {args.heartbeat_interval} s, {args.slots} slots), "
          f"{args.adapters} adapters, {args.pins} pinned x {args.pin_replicas} replicas; traffic "
          f"{args.traffic_rate:g} requests/s, Zipf {args.traffic_alpha:g}, random pods\n")
    names = list(sampler.pids)
    print("| phase | seconds | reconcile passes: n, p50 / p99 / max | heartbeats: n, p50 / p99 / max | CPU share of "
          f"one core: {', '.join(names)} |")
    print("|---|---|---|---|---|")
    for p in [*phases, "all"]:
        t0, t1 = bounds[p] if p != "all" else (marks["register"], marks["end"])
        passes = sampler.passes(t0, t1)
        lat = [b[1] for b in beats if t0 <= b[0] < t1 and b[2] == "OK"]
        cpu = sampler.cpu_share(t0, t1)
        print(f"| {p if p != 'all' else 'register to end'} | {t1 - t0:.0f} | {len(passes)}, "
              f"{ms(passes) if passes else '-'} | {len(lat)}, {ms(lat) if lat else '-'} | "
              f"{', '.join(f'{cpu[n]:.2f}' for n in names) if cpu else '-'} |")
    print("\nHandling time p99 inside the control plane, from its own histogram (the bucket that holds it):\n")
    print(f"| phase | {' | '.join(HANDLED)} |")
    print(f"|---|{'---|' * len(HANDLED)}")
    for p in [*phases, "all"]:
        t0, t1 = bounds[p] if p != "all" else (marks["register"], marks["end"])
        print(f"| {p if p != 'all' else 'register to end'} | "
              f"{' | '.join(sampler.handling_p99(m, t0, t1) for m in HANDLED)} |")
    print(f"\nheartbeats that failed: {len(failed)} ({sorted({b[2] for b in failed})})")
    print(f"pod commands served: {report['commands']}\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| register {args.adapters} adapters, {args.concurrency} in flight | {out['register_s']:.1f} s "
          f"({args.adapters / out['register_s']:.0f}/s); per call p50 / p99 / max {ms(out['register'])} |")
    print(f"| Redis used_memory per registered adapter (used_memory_dataset) | {out['memory_per_adapter']:.0f} B "
          f"({out['dataset_per_adapter']:.0f} B) |")
    print(f"| pin {args.pins} x {args.pin_replicas} replicas, {args.concurrency} in flight | per call {ms(out['pin'])};"
          f" all loaded and pinned after {out['converge_s']:.1f} s |")
    for method, lat in out["admin"].items():
        print(f"| {method} under heartbeats, {len(lat)} calls one at a time, p50 / p99 / max | {ms(lat)} |")
    if out["traffic"]:
        print(f"| GetAdapter during traffic, {len(out['traffic'])} calls one at a time, p50 / p99 / max | "
              f"{ms(out['traffic'])} |")
    print(f"| traffic: requests served (refused); adapters held at the end (distinct) | {report['requests']} "
          f"({report['refused']}); {report['held']} ({report['distinct_held']}) |")
    for size, (pages, total) in out["list"].items():
        print(f"| ListAdapters over all {args.adapters + args.admin_calls}, page size {size}: {len(pages)} pages, "
              f"per page p50 / p99 / max | {ms(pages)}; whole listing {total:.2f} s |")


if __name__ == "__main__":
    main()
