"""Control-plane latency and throughput with a real Redis, a real control plane and two real CPU pods.

1. Register + Pin(replicas=0) -> READY on every pod: for each of ``--adapters`` adapters in turn
   (copies of a demo adapter under distinct names), the time from the RegisterAdapter call to the
   moment GetAdapter shows a READY placement on both pods; the adapter is then unpinned and
   unregistered so the pods' slots never run out. Reports p50/p99.
2. Admin RPC throughput: ``--clients`` concurrent clients issuing GetAdapter, ListAdapters(page of
   50) and Register+Unregister pairs for ``--seconds`` each; calls per second.

Prints markdown rows for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path

from lorafleet.v1 import adapter_admin_pb2 as pb
from processes import FLEET_BASE_MODEL as BASE_MODEL  # benchmarks/processes.py
from processes import Fleet

from data_plane.demo_adapters import demo_adapter_dir


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def register_to_ready(fleet: Fleet, n: int, sha: str) -> list[float]:
    admin, auth, pods = fleet.admin(), fleet.auth, set(fleet.pods)
    latencies = []
    for i in range(n):
        name = f"bench-{i:03d}"
        start = time.perf_counter()
        fleet.register(name, fleet.adapter_root / name, sha)
        fleet.pin(name, 0)
        deadline = start + 60
        while fleet.placements(name) != pods:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{name} not READY on every pod within 60 s: {fleet.adapter(name)}")
            time.sleep(0.005)
        latencies.append(time.perf_counter() - start)
        admin.UnpinAdapter(pb.UnpinAdapterRequest(name=name), metadata=auth(), timeout=5)
        admin.UnregisterAdapter(pb.UnregisterAdapterRequest(name=name), metadata=auth(), timeout=5)
    return latencies


def throughput(fleet: Fleet, clients: int, seconds: float, sha: str) -> dict[str, float]:
    admin, auth = fleet.admin(), fleet.auth
    for i in range(50):
        admin.RegisterAdapter(pb.RegisterAdapterRequest(name=f"list-{i:02d}", source="file:///x", sha256=sha,
                                                        base_model=BASE_MODEL), metadata=auth(), timeout=5)

    def get(_: int) -> None:
        admin.GetAdapter(pb.GetAdapterRequest(name="list-07"), metadata=auth(), timeout=5)

    def list_page(_: int) -> None:
        admin.ListAdapters(pb.ListAdaptersRequest(page_size=50), metadata=auth(), timeout=5)

    def register_pair(k: int) -> None:
        name = f"tp-{threading.get_ident()}-{k}"
        admin.RegisterAdapter(pb.RegisterAdapterRequest(name=name, source="file:///x", sha256=sha,
                                                        base_model=BASE_MODEL), metadata=auth(), timeout=5)
        admin.UnregisterAdapter(pb.UnregisterAdapterRequest(name=name), metadata=auth(), timeout=5)

    rates = {}
    for label, call, per_call in (("GetAdapter", get, 1), ("ListAdapters (50 per page)", list_page, 1),
                                  ("RegisterAdapter + UnregisterAdapter", register_pair, 2)):
        counts = [0] * clients
        stop = time.perf_counter() + seconds

        def worker(slot: int, call=call, counts=counts, stop=stop) -> None:
            while time.perf_counter() < stop:
                call(counts[slot])
                counts[slot] += 1

        threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rates[label] = sum(counts) * per_call / (time.perf_counter() - start)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=100)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    source = demo_adapter_dir("pirate")
    sha = hashlib.sha256((source / "adapter_model.safetensors").read_bytes()).hexdigest()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "adapters"
        for i in range(args.adapters):
            shutil.copytree(source, root / f"bench-{i:03d}")
        workdir = Path(tmp) / "fleet"
        workdir.mkdir()
        fleet = Fleet(workdir, root)
        try:
            fleet.start()
            latencies = register_to_ready(fleet, args.adapters, sha)
            rates = throughput(fleet, args.clients, args.seconds, sha)
        finally:
            fleet.stop()
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.machine()} CPU ({platform.python_version()}), real redis-server, "
          f"one control plane, two CPU pods on the demo model (heartbeat 0.3 s)\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| Register + Pin(all pods) -> READY on 2 pods, p50 over {args.adapters} adapters | "
          f"{_pct(latencies, 0.5) * 1000:.0f} ms |")
    print(f"| same, p99 | {_pct(latencies, 0.99) * 1000:.0f} ms |")
    for label, rate in rates.items():
        print(f"| {label}, {args.clients} clients | {rate:.0f} calls/s |")


if __name__ == "__main__":
    main()
