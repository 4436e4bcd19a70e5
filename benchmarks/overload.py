"""Overload: open-loop Poisson arrivals on one pod, before and after admission by deadline and fair shares.

A real pod process on loopback (the demo model, its adapters). The same arrivals are sent to two pod
configurations, one after the other:

- ``before``: ``--scheduling-policy fcfs --max-queue-delay 0``: arrival order, every request admitted
  while the queue has room (what the pod did before fair shares and admission by deadline);
- ``after``: the defaults (fair shares) with ``--max-queue-delay`` set to ``--queue-delay`` seconds.

First the pod's capacity is measured closed-loop (``--capacity-requests`` requests at once; completed
requests per second). Then, per configuration, each for ``--seconds`` of arrivals:

- ``load``: Poisson arrivals at 0.5×, 1× and 2× capacity over the base model and the demo adapters in
  turn. Reported: goodput (requests whose first token came within ``--ttft-slo`` seconds, per second
  from the first arrival to the last request's end), refused share, TTFT p50/p99 of the admitted
  requests, and time to refusal p50/p99, all timed on the client;
- ``trickle``: one adapter alone at ``--trickle-rate`` requests/s: its unloaded TTFT;
- ``flood``: the same trickle beside another adapter flooding at 2× capacity: the trickle's TTFT
  p50/p99 against its unloaded value, and the flood's goodput.

Every request asks for ``--max-tokens`` tokens (EOS ignored, greedy) and carries no gRPC deadline, so
only the pod's own --max-queue-delay refuses. Targets (issue 17): at 2× capacity, admitted requests'
TTFT p99 within 3× of the 0.5× run and refusals answered in < 50 ms; with one adapter flooding at 2×,
the other adapter's TTFT p99 within 2× of its unloaded value.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import grpc
from lorafleet.v1 import generation_pb2 as g
from lorafleet.v1 import generation_pb2_grpc
from processes import PodProcess, cpu_model, load_average, wait_until  # benchmarks/processes.py
from stream_load import PROMPTS, percentile_ms  # benchmarks/stream_load.py

from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir

QUICK = {"seconds": 4.0, "capacity_requests": 8, "max_tokens": 8, "max_num_seqs": 4, "trickle_rate": 0.5}
LOADS = (0.5, 1.0, 2.0)


@dataclass
class Phase:
    """One phase's requests, timed on the client (seconds)."""

    name: str
    wall_s: float = 0.0  # from the first arrival to the last request's end
    ttft: dict[str, list[float]] = field(default_factory=dict)  # by tenant ("base" or the adapter)
    completed: dict[str, int] = field(default_factory=dict)
    refusals: list[float] = field(default_factory=list)  # time from sending to RESOURCE_EXHAUSTED
    errors: dict[str, int] = field(default_factory=dict)  # other codes

    def sent(self) -> int:
        return sum(self.completed.values()) + len(self.refusals) + sum(self.errors.values())

    def all_ttft(self) -> list[float]:
        return [t for values in self.ttft.values() for t in values]


async def one_request(stub, adapter: str | None, prompt: str, max_tokens: int, phase: Phase,
                      billed_to: str = "") -> None:
    """One request, timed into ``phase`` under its adapter's name; ``billed_to``: its GenerateRequest.tenant."""
    tenant = adapter or "base"
    req = g.GenerateRequest(adapter=adapter or "", prompt=prompt, tenant=billed_to,
                            sampling=g.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    start = time.perf_counter()
    first = None
    try:
        async for _ in stub.Generate(req, timeout=600):
            if first is None:
                first = time.perf_counter() - start
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            phase.refusals.append(time.perf_counter() - start)
        else:
            phase.errors[e.code().name] = phase.errors.get(e.code().name, 0) + 1
        return
    phase.ttft.setdefault(tenant, []).append(first)
    phase.completed[tenant] = phase.completed.get(tenant, 0) + 1


async def poisson(stub, streams: list[tuple[float, list[str | None]]], seconds: float, max_tokens: int,
                  phase: Phase, seed: int, billed_to: tuple[str, ...] = ()) -> None:
    """Open loop: each (rate, adapters) stream sends Poisson arrivals at ``rate`` per second for
    ``seconds``, cycling over ``adapters``, billed to the stream's tenant in ``billed_to`` (none if absent);
    waits for every request to end."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task] = []
    start = time.perf_counter()

    async def arrivals(rate: float, adapters: list[str | None], tenant: str) -> None:
        at, i = time.perf_counter(), 0
        end = at + seconds
        while True:
            at += rng.expovariate(rate)
            if at >= end:
                return
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(stub, adapters[i % len(adapters)], PROMPTS[i % len(PROMPTS)],
                                                         max_tokens, phase, tenant)))
            i += 1

    tenants = [*billed_to, *[""] * (len(streams) - len(billed_to))]
    await asyncio.gather(*(arrivals(rate, adapters, tenant)
                           for (rate, adapters), tenant in zip(streams, tenants, strict=True) if rate > 0))
    await asyncio.gather(*tasks)
    phase.wall_s = time.perf_counter() - start


async def capacity(stub, n: int, max_tokens: int, adapters: list[str | None]) -> float:
    """Completed requests per second with ``n`` requests sent at once."""
    phase = Phase("capacity")
    start = time.perf_counter()
    await asyncio.gather(*(one_request(stub, adapters[i % len(adapters)], PROMPTS[i % len(PROMPTS)], max_tokens,
                                       phase) for i in range(n)))
    took = time.perf_counter() - start
    if phase.refusals or phase.errors:
        raise RuntimeError(f"the capacity run was refused: {len(phase.refusals)} refusals, {phase.errors}")
    return n / took


def start_pod(workdir: Path, args: argparse.Namespace, *flags: str) -> PodProcess:
    pod = PodProcess(workdir, "--max-loras", "4", "--max-cpu-loras", "8", "--max-lora-rank", "16",
                     "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", "1024",
                     "--adapter-root", str(demo_adapter_dir(DEMO_ADAPTERS[0]).parent), *flags,
                     name=f"pod-{len(list(workdir.iterdir()))}")
    return pod.start()


async def run_config(pod: PodProcess, args: argparse.Namespace, rate: float, seed: int) -> list[Phase]:
    adapters: list[str | None] = [None, *DEMO_ADAPTERS]
    flood, trickle = DEMO_ADAPTERS[0], DEMO_ADAPTERS[1]
    phases = []
    async with grpc.aio.insecure_channel(pod.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await capacity(stub, args.max_num_seqs, args.max_tokens, adapters)  # warm: every adapter in a slot
        for factor in LOADS:
            phase = Phase(f"load {factor:g}×")
            await poisson(stub, [(factor * rate, adapters)], args.seconds, args.max_tokens, phase, seed)
            phases.append(phase)
            wait_until(lambda: pod.state().waiting_requests == 0 and pod.state().running_requests == 0, 600, "idle")
        phase = Phase("trickle alone")
        await poisson(stub, [(args.trickle_rate, [trickle])], args.seconds, args.max_tokens, phase, seed)
        phases.append(phase)
        phase = Phase("trickle beside a 2× flood")
        await poisson(stub, [(args.trickle_rate, [trickle]), (2 * rate, [flood])], args.seconds, args.max_tokens,
                      phase, seed)
        phases.append(phase)
        wait_until(lambda: pod.state().waiting_requests == 0 and pod.state().running_requests == 0, 600, "idle")
    return phases


def report(results: dict[str, list[Phase]], rate: float, args: argparse.Namespace) -> None:
    trickle, flood = DEMO_ADAPTERS[1], DEMO_ADAPTERS[0]
    print(f"\n{time.strftime('%Y-%m-%d')}, {cpu_model()}, torch {version('torch')}, load average {load_average()}; "
          f"`{shlex.join(['python', *sys.argv])}`")
    print(f"capacity {rate:.2f} requests/s ({args.capacity_requests} requests at once, {args.max_tokens} tokens "
          f"each, --max-num-seqs {args.max_num_seqs}); arrivals for {args.seconds:g} s per phase; "
          f"after = fair shares with --max-queue-delay {args.queue_delay:g}; goodput counts TTFT within "
          f"{args.ttft_slo:g} s\n")
    print("| config | phase | sent | goodput req/s | refused | TTFT p50 ms | TTFT p99 ms | refusal p50 ms "
          "| refusal p99 ms | trickle TTFT p50 ms | trickle TTFT p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for config, phases in results.items():
        for p in phases:
            good = sum(t <= args.ttft_slo for t in p.all_ttft())
            refused = f"{len(p.refusals) / p.sent():.0%}" if p.sent() else "–"
            mine = p.ttft.get(trickle, []) if "trickle" in p.name else []
            print(f"| {config} | {p.name} | {p.sent()} | {good / p.wall_s:.2f} | {refused} "
                  f"| {percentile_ms(p.all_ttft(), 0.5)} | {percentile_ms(p.all_ttft(), 0.99)} "
                  f"| {percentile_ms(p.refusals, 0.5)} | {percentile_ms(p.refusals, 0.99)} "
                  f"| {percentile_ms(mine, 0.5)} | {percentile_ms(mine, 0.99)} |")
            if p.errors:
                print(f"|  | errors: {p.errors} |")
    print()
    for config, phases in results.items():
        by_name = {p.name: p for p in phases}
        low, high = by_name["load 0.5×"].all_ttft(), by_name["load 2×"].all_ttft()
        alone = by_name["trickle alone"].ttft.get(trickle, [])
        beside = by_name["trickle beside a 2× flood"].ttft.get(trickle, [])
        print(f"{config}: admitted TTFT p99 at 2× / at 0.5× = {_ratio(high, low)} (target ≤ 3); "
              f"refusal p99 {percentile_ms(by_name['load 2×'].refusals, 0.99)} ms (target < 50); "
              f"{trickle} TTFT p99 beside the {flood} flood / alone = {_ratio(beside, alone)} (target ≤ 2)")


def _ratio(values: list[float], reference: list[float]) -> str:
    if not values or not reference:
        return "–"
    return f"{float(percentile_ms(values, 0.99)) / max(1.0, float(percentile_ms(reference, 0.99))):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="arrivals per phase")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the pod's sequences per step")
    parser.add_argument("--capacity-requests", type=int, default=32, help="requests of the closed-loop capacity run")
    parser.add_argument("--trickle-rate", type=float, default=0.5, help="the trickle adapter's requests per second")
    parser.add_argument("--queue-delay", type=float, default=0.5, help="the after pod's --max-queue-delay")
    parser.add_argument("--ttft-slo", type=float, default=1.0, help="a first token within this many seconds "
                                                                    "counts towards goodput")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke check: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    configs = {"before": ("--scheduling-policy", "fcfs", "--max-queue-delay", "0"),
               "after": ("--max-queue-delay", str(args.queue_delay))}
    results: dict[str, list[Phase]] = {}
    rate = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for config, flags in configs.items():
            pod = start_pod(Path(tmp), args, *flags)
            try:
                if not rate:  # one capacity for both: measured on the first pod, after a warm-up
                    async def measure(address=pod.address) -> float:
                        async with grpc.aio.insecure_channel(address) as channel:
                            stub = generation_pb2_grpc.GenerationStub(channel)
                            adapters = [None, *DEMO_ADAPTERS]
                            await capacity(stub, args.max_num_seqs, args.max_tokens, adapters)
                            return await capacity(stub, args.capacity_requests, args.max_tokens, adapters)
                    rate = asyncio.run(measure())
                    print(f"capacity: {rate:.2f} requests/s", flush=True)
                results[config] = asyncio.run(run_config(pod, args, rate, args.seed))
                print(f"{config}: done", flush=True)
            finally:
                pod.stop()
    report(results, rate, args)


if __name__ == "__main__":
    main()
