"""Tenant fairness: one tenant floods ten adapters, another trickles on one; the trickle's TTFT against alone.

A real pod process on loopback (the demo model), with eleven adapters under its --adapter-root (copies of a
demo adapter under the names flood-0 … flood-9 and trickle) and slots for all of them, so that only the
scheduler's order differs between the phases. The pod admits by its own promise (its default
--max-queue-delay: a request it cannot start in time is refused with a hint, and a promise at risk
speeds prefill up); ``--max-queue-delay 0`` queues every request instead, so the order alone decides who
waits and nothing is promised. The pod's capacity is measured closed-loop first (completed
requests per second); then, each for ``--seconds`` of Poisson arrivals:

- ``trickle alone``: the trickle adapter at ``--trickle-rate`` requests/s, billed to tenant ``small``;
- ``beside the flood, tenants``: the same trickle, and tenant ``big`` flooding its ten adapters at
  ``--flood-factor`` × capacity (GenerateRequest.tenant set, as a router with tenants sets it);
- ``beside the flood, per adapter``: the same arrivals with no tenant named: each adapter is its own fair
  share, as before tenants (the baseline in the same run).

Reported: the trickle's TTFT p50/p99 (client-timed) per phase, and p99 beside the flood / p99 alone
(target ≤ 2 with tenants). Every request asks for ``--max-tokens`` tokens (EOS ignored, greedy).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import grpc
from lorafleet.v1 import generation_pb2_grpc
from overload import Phase, capacity, poisson, warm  # benchmarks/overload.py
from processes import PodProcess, cpu_model, load_average, wait_until  # benchmarks/processes.py
from stream_load import percentile_ms  # benchmarks/stream_load.py

from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir

FLOOD = [f"flood-{i}" for i in range(10)]
TRICKLE = "trickle"


def adapters_root(root: Path) -> Path:
    """Eleven adapters: the first demo adapter under each flood name, the second under the trickle's."""
    for name in FLOOD:
        shutil.copytree(demo_adapter_dir(DEMO_ADAPTERS[0]), root / name)
    shutil.copytree(demo_adapter_dir(DEMO_ADAPTERS[1]), root / TRICKLE)
    return root


async def measure_capacity(pod: PodProcess, args: argparse.Namespace) -> float:
    """Completed requests per second, closed loop over the flood adapters (a pod that queues every request)."""
    async with grpc.aio.insecure_channel(pod.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await warm(stub, [*FLOOD, TRICKLE], args.max_tokens)
        return await capacity(stub, args.capacity_requests, args.max_tokens, FLOOD)


async def run(pod: PodProcess, args: argparse.Namespace, rate: float) -> list[Phase]:
    phases = []
    idle = lambda: pod.state().waiting_requests == 0 and pod.state().running_requests == 0  # noqa: E731
    async with grpc.aio.insecure_channel(pod.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await warm(stub, [*FLOOD, TRICKLE], args.max_tokens)  # each adapter in a slot before anything is timed
        flood = args.flood_factor * rate
        for name, streams, billed in (
                ("trickle alone", [(args.trickle_rate, [TRICKLE])], ("small",)),
                ("beside the flood, tenants", [(args.trickle_rate, [TRICKLE]), (flood, FLOOD)], ("small", "big")),
                ("beside the flood, per adapter", [(args.trickle_rate, [TRICKLE]), (flood, FLOOD)], ())):
            phase = Phase(name)
            await poisson(stub, streams, args.seconds, args.max_tokens, phase, args.seed, billed)
            phases.append(phase)
            wait_until(idle, 600, "the pod idle")
            print(f"{name}: done", flush=True)
    return phases


def report(rate: float, phases: list[Phase], args: argparse.Namespace) -> None:
    print(f"\n{time.strftime('%Y-%m-%d')}, {cpu_model()}, torch {version('torch')}, load average {load_average()}; "
          f"`{shlex.join(['python', *sys.argv])}`")
    print(f"capacity {rate:.2f} requests/s ({args.capacity_requests} requests at once over the flood adapters, "
          f"{args.max_tokens} tokens each, --max-num-seqs {args.max_num_seqs}); trickle {args.trickle_rate:g}/s, "
          f"flood {args.flood_factor:g}× capacity over 10 adapters; {args.seconds:g} s of arrivals per phase; "
          f"the pod's --max-queue-delay "
          f"{'its default' if args.max_queue_delay is None else f'{args.max_queue_delay:g} s'}\n")
    print("| phase | trickle completed | trickle refused | trickle TTFT p50 ms | trickle TTFT p99 ms | p99 / alone "
          "| flood completed | flood refused |")
    print("|---|---|---|---|---|---|---|---|")
    alone = phases[0].ttft.get(TRICKLE, [])
    for p in phases:
        mine = p.ttft.get(TRICKLE, [])
        ratio = "–" if not mine or not alone else (
            f"{float(percentile_ms(mine, 0.99)) / max(1.0, float(percentile_ms(alone, 0.99))):.2f}")
        flooded = sum(n for name, n in p.completed.items() if name in FLOOD)
        flood_refused = sum(n for name, n in p.refused.items() if name in FLOOD)
        print(f"| {p.name} | {len(mine)} | {p.refused.get(TRICKLE, 0)} | {percentile_ms(mine, 0.5)} "
              f"| {percentile_ms(mine, 0.99)} | {ratio} | {flooded} | {flood_refused} |")
        if p.errors:
            print(f"|  | errors: {p.errors} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="arrivals per phase")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the pod's sequences per step")
    parser.add_argument("--capacity-requests", type=int, default=32, help="requests of the closed-loop capacity run")
    parser.add_argument("--trickle-rate", type=float, default=0.5, help="the trickle's requests per second")
    parser.add_argument("--flood-factor", type=float, default=2.0, help="the flood's rate, × the capacity")
    parser.add_argument("--max-queue-delay", type=float, default=None,
                        help="the pod's --max-queue-delay (default: the pod's own; 0 queues every request)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = adapters_root(Path(tmp) / "adapters")

        def start(name: str, *flags: str) -> PodProcess:
            (Path(tmp) / name).mkdir()
            return PodProcess(Path(tmp) / name, "--max-loras", "12", "--max-cpu-loras", "12", "--max-lora-rank", "16",
                              "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", "1024",
                              "--adapter-root", str(root), *flags, name=name).start()

        pod = start("capacity", "--max-queue-delay", "0")  # a closed batch at once: nothing refused
        try:
            rate = asyncio.run(measure_capacity(pod, args))
        finally:
            pod.stop()
        print(f"capacity: {rate:.2f} requests/s", flush=True)
        pod = start("pod", *([] if args.max_queue_delay is None else ["--max-queue-delay", str(args.max_queue_delay)]))
        try:
            phases = asyncio.run(run(pod, args, rate))
        finally:
            pod.stop()
    report(rate, phases, args)


if __name__ == "__main__":
    main()
