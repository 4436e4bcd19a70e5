"""Overload at the shipped defaults: open-loop Poisson arrivals on one pod, this checkout's pod against another's.

A real pod process on loopback (the demo model, its adapters), started with no tuning flags: only what
it needs to find the demo adapters. ``after`` is this checkout's pod; ``before`` (with ``--before-tree``,
a checkout of an earlier version, e.g. made with ``git worktree add``) is that version's pod at its
own defaults. The same arrivals go to both, one after the other.

First the pod's capacity is measured closed-loop (``--capacity-requests`` requests at once; completed
requests per second) on a pod of the first configuration's code with admission off
(``--max-queue-delay 0``: every request of the closed loop is queued), and used for both. Then, per
configuration, each for ``--seconds`` of arrivals, every request ``--max-tokens`` tokens (EOS ignored,
greedy) with a prompt of 8-128 words and no gRPC deadline, so only the pod's own admission refuses:

- ``load``: Poisson arrivals at 0.5×, 1× and 2× capacity over the base model and the demo adapters in
  turn. Reported: goodput (requests whose first token came within the pod's promised queue delay, its
  default ``--max-queue-delay``, per second from the first arrival to the last request's end), refused
  share, TTFT p50/p99 of the admitted requests, time to refusal p50/p99, all timed on the client;
- ``mixed`` (with ``--mixed``): the same rates, each request's adapter (or the base model) at random, a
  prompt of 10-140 words and 16-48 new tokens at random: the mixed-adapter, mixed-length load the promise
  must hold on too (issue 42). Reported: admitted TTFT p99 per rate against the promise;
- ``trickle``: one adapter alone at ``--trickle-rate`` requests/s: its unloaded TTFT; then the same
  trickle beside another adapter flooding at 2× capacity: its TTFT against its unloaded value;
- ``burst``: ``--streams`` requests streaming long completions; their inter-token gaps in the seconds
  before a burst of ``--burst`` long prompts (128 words) and while the burst's prompts are prefilled
  (until the last one's first token).

The estimate's calibration (``after``): the pod's ``lorafleet_ttft_estimate_error_seconds`` histogram
over each phase's admitted requests: how often the first token came no later than admission estimated,
and no more than 0.5 s later.

Targets (issue 25): at 2× capacity, admitted requests' TTFT p99 within the promised queue delay and
within 3× of the 0.5× run's, refusals answered in < 50 ms, goodput at 2× at least 90% of goodput at 1×;
the trickle's TTFT p99 beside the flood within 2× of its value alone; the streams' inter-token p99
during the burst within 1.5× of their p99 without it.
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
from stream_load import percentile_ms  # benchmarks/stream_load.py

from data_plane.config import DataPlaneConfig
from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir

# The mixed load (--mixed): prompt words and new tokens of each request, drawn at random within these.
MIXED_WORDS, MIXED_TOKENS = (10, 140), (16, 48)
QUICK = {"seconds": 4.0, "capacity_requests": 8, "max_tokens": 8, "trickle_rate": 0.5, "streams": 2, "burst": 2}
LOADS = (0.5, 1.0, 2.0)
PROMISE_S = DataPlaneConfig.max_queue_delay  # what the pod promises at its defaults (the field's default)
_WORDS = ("the river carried old maps past quiet towns where bakers sang about winter roads and distant "
          "lighthouses while children counted boats under a copper sky full of slow birds").split()
ERROR = "lorafleet_ttft_estimate_error_seconds"


def prompt(rng: random.Random, words: int | None = None) -> str:
    """A prompt of ``words`` words (default: 8 to 128 at random)."""
    n = words or rng.randint(8, 128)
    return "Continue this story: " + " ".join(rng.choice(_WORDS) for _ in range(n))


@dataclass
class Phase:
    """One phase's requests, timed on the client (seconds)."""

    name: str
    wall_s: float = 0.0  # from the first arrival to the last request's end
    ttft: dict[str, list[float]] = field(default_factory=dict)  # by tenant ("base" or the adapter)
    completed: dict[str, int] = field(default_factory=dict)
    refusals: list[float] = field(default_factory=list)  # time from sending to RESOURCE_EXHAUSTED
    refused: dict[str, int] = field(default_factory=dict)  # refusals by tenant
    errors: dict[str, int] = field(default_factory=dict)  # other codes
    calibration: tuple[int, int, int] | None = None  # (admitted, first token ≤ estimate, ≤ estimate + 0.5 s)

    def sent(self) -> int:
        return sum(self.completed.values()) + len(self.refusals) + sum(self.errors.values())

    def all_ttft(self) -> list[float]:
        return [t for values in self.ttft.values() for t in values]

    def goodput(self) -> float:
        return sum(t <= PROMISE_S for t in self.all_ttft()) / self.wall_s if self.wall_s else 0.0


async def one_request(stub, adapter: str | None, text: str, max_tokens: int, phase: Phase,
                      gaps: list[tuple[float, float]] | None = None, billed_to: str = "") -> None:
    """One streamed request, timed into ``phase`` under its adapter's name, and (when ``gaps`` is given)
    every inter-token gap as (time of the later token, gap); ``billed_to``: its GenerateRequest.tenant."""
    tenant = adapter or "base"
    req = g.GenerateRequest(adapter=adapter or "", prompt=text, tenant=billed_to,
                            sampling=g.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    start = time.perf_counter()
    first = last = None
    try:
        async for _ in stub.Generate(req, timeout=600):
            now = time.perf_counter()
            if first is None:
                first = now - start
            elif gaps is not None:
                gaps.append((now, now - last))
            last = now
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            phase.refusals.append(time.perf_counter() - start)
            phase.refused[tenant] = phase.refused.get(tenant, 0) + 1
        else:
            phase.errors[e.code().name] = phase.errors.get(e.code().name, 0) + 1
        return
    phase.ttft.setdefault(tenant, []).append(first)
    phase.completed[tenant] = phase.completed.get(tenant, 0) + 1


async def poisson(stub, streams: list[tuple[float, list[str | None]]], seconds: float, max_tokens: int,
                  phase: Phase, seed: int, billed_to: tuple[str, ...] = (), mixed: bool = False) -> None:
    """Open loop: each (rate, adapters) stream sends Poisson arrivals at ``rate`` per second for
    ``seconds``, cycling over ``adapters``, billed to the stream's tenant in ``billed_to`` (none if absent);
    waits for every request to end. ``mixed``: each request's adapter drawn from ``adapters`` at random, its
    prompt of MIXED_WORDS words and its completion of MIXED_TOKENS tokens at random, instead."""
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
            if mixed:
                adapter, text, tokens = rng.choice(adapters), prompt(rng, rng.randint(*MIXED_WORDS)), \
                    rng.randint(*MIXED_TOKENS)
            else:
                adapter, text, tokens = adapters[i % len(adapters)], prompt(rng), max_tokens
            tasks.append(asyncio.create_task(one_request(stub, adapter, text, tokens, phase, billed_to=tenant)))
            i += 1

    tenants = [*billed_to, *[""] * (len(streams) - len(billed_to))]
    await asyncio.gather(*(arrivals(rate, adapters, tenant)
                           for (rate, adapters), tenant in zip(streams, tenants, strict=True) if rate > 0))
    await asyncio.gather(*tasks)
    phase.wall_s = time.perf_counter() - start


async def capacity(stub, n: int, max_tokens: int, adapters: list[str | None], seed: int = 0) -> float:
    """Completed requests per second with ``n`` requests sent at once."""
    phase = Phase("capacity")
    rng = random.Random(seed)
    start = time.perf_counter()
    await asyncio.gather(*(one_request(stub, adapters[i % len(adapters)], prompt(rng), max_tokens, phase)
                           for i in range(n)))
    took = time.perf_counter() - start
    if phase.refusals or phase.errors:
        raise RuntimeError(f"the capacity run was refused: {len(phase.refusals)} refusals, {phase.errors}")
    return n / took


async def warm(stub, adapters: list[str | None], max_tokens: int) -> None:
    """One request per adapter, one after another: every adapter in a slot before the phases. One at a time, so
    a pod's admission has nothing queued to refuse them for (a cold pod's first estimate may refuse a batch)."""
    phase = Phase("warm-up")
    rng = random.Random(0)
    for adapter in adapters:
        await one_request(stub, adapter, prompt(rng), max_tokens, phase)
    if phase.refusals or phase.errors:
        raise RuntimeError(f"the warm-up was refused: {len(phase.refusals)} refusals, {phase.errors}")


async def burst(stub, args: argparse.Namespace, seed: int) -> tuple[list[float], list[float]]:
    """The streams' inter-token gaps before the burst and while its prompts are prefilled."""
    rng = random.Random(seed)
    gaps: list[tuple[float, float]] = []
    quiet, loud = Phase("streams"), Phase("burst")
    streams = [asyncio.create_task(one_request(stub, None, prompt(rng, 16), 100_000, quiet, gaps))
               for _ in range(args.streams)]
    await asyncio.sleep(2.0)  # every stream past its prompt
    calm_from = time.perf_counter()
    await asyncio.sleep(args.burst_after)
    burst_at = time.perf_counter()
    await asyncio.gather(*(one_request(stub, DEMO_ADAPTERS[i % len(DEMO_ADAPTERS)], prompt(rng, 128), 1, loud)
                           for i in range(args.burst)))
    burst_end = time.perf_counter()
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    if loud.refusals or loud.errors:
        print(f"burst: {len(loud.refusals)} refused, errors {loud.errors}", flush=True)
    return ([gap for at, gap in gaps if calm_from <= at < burst_at],
            [gap for at, gap in gaps if burst_at <= at <= burst_end])


def error_histogram(pod: PodProcess) -> dict[str, float]:
    """The pod's estimate-error histogram: cumulative bucket counts by upper bound, and _count (a histogram
    with negative buckets exports no _sum)."""
    out = {}
    for line in pod.metrics().splitlines():
        if line.startswith(ERROR + "_bucket{"):
            out[line.split('le="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(ERROR + "_count"):
            out[line.split(" ")[0].removeprefix(ERROR)] = float(line.rsplit(" ", 1)[1])
    return out


def calibration(before: dict[str, float], after: dict[str, float]) -> tuple[int, int, int] | None:
    """(admitted, first token no later than estimated, no more than 0.5 s later) between two scrapes."""
    if "_count" not in after:
        return None  # a pod without the estimate's metric

    def between(key: str) -> int:
        return int(after.get(key, 0) - before.get(key, 0))

    return between("_count"), between("0.0"), between("0.5")


async def measured(pod: PodProcess, coroutine) -> tuple[int, int, int] | None:
    start = error_histogram(pod)
    await coroutine
    return calibration(start, error_histogram(pod))


def idle(pod: PodProcess) -> bool:
    s = pod.state()
    return s.waiting_requests == 0 and s.running_requests == 0


async def run_config(pod: PodProcess, args: argparse.Namespace, rate: float) -> tuple[list[Phase], tuple]:
    adapters: list[str | None] = [None, *DEMO_ADAPTERS]
    flood, trickle = DEMO_ADAPTERS[0], DEMO_ADAPTERS[1]
    phases = []
    async with grpc.aio.insecure_channel(pod.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await warm(stub, adapters, args.max_tokens)
        plan = [(f"load {factor:g}×", [(factor * rate, adapters)]) for factor in LOADS]
        if args.mixed:
            plan += [(f"mixed {factor:g}×", [(factor * rate, adapters)]) for factor in LOADS]
        plan += [("trickle alone", [(args.trickle_rate, [trickle])]),
                 ("trickle beside a 2× flood", [(args.trickle_rate, [trickle]), (2 * rate, [flood])])]
        for name, streams in plan:
            phase = Phase(name)
            phase.calibration = await measured(pod, poisson(stub, streams, args.seconds, args.max_tokens, phase,
                                                            args.seed, mixed=name.startswith("mixed")))
            phases.append(phase)
            wait_until(lambda: idle(pod), 600, "idle")
        calm, loud = await burst(stub, args, args.seed)
        wait_until(lambda: idle(pod), 600, "idle")
    return phases, (calm, loud)


def report(results: dict[str, tuple[list[Phase], tuple]], rate: float, args: argparse.Namespace) -> None:
    trickle, flood = DEMO_ADAPTERS[1], DEMO_ADAPTERS[0]
    print(f"\n{time.strftime('%Y-%m-%d')}, {cpu_model()}, torch {version('torch')}, load average {load_average()}; "
          f"`{shlex.join(['python', *sys.argv])}`")
    print(f"capacity {rate:.2f} requests/s ({args.capacity_requests} requests at once, {args.max_tokens} tokens "
          f"each); arrivals for {args.seconds:g} s per phase; pods at their defaults; goodput counts TTFT within "
          f"the promised {PROMISE_S:g} s\n")
    print("| config | phase | sent | goodput req/s | refused | TTFT p50 ms | TTFT p99 ms | refusal p50 ms "
          "| refusal p99 ms | trickle TTFT p50 ms | trickle TTFT p99 ms | first token ≤ estimate "
          "| ≤ estimate + 0.5 s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for config, (phases, _) in results.items():
        for p in phases:
            refused = f"{len(p.refusals) / p.sent():.0%}" if p.sent() else "–"
            mine = p.ttft.get(trickle, []) if "trickle" in p.name else []
            cal = "–", "–"
            if p.calibration and p.calibration[0]:
                n, on_time, close = p.calibration
                cal = f"{on_time}/{n}", f"{close}/{n}"
            print(f"| {config} | {p.name} | {p.sent()} | {p.goodput():.2f} | {refused} "
                  f"| {percentile_ms(p.all_ttft(), 0.5)} | {percentile_ms(p.all_ttft(), 0.99)} "
                  f"| {percentile_ms(p.refusals, 0.5)} | {percentile_ms(p.refusals, 0.99)} "
                  f"| {percentile_ms(mine, 0.5)} | {percentile_ms(mine, 0.99)} | {cal[0]} | {cal[1]} |")
            if p.errors:
                print(f"|  | errors: {p.errors} |")
    print()
    for config, (phases, (calm, loud)) in results.items():
        by_name = {p.name: p for p in phases}
        low, high = by_name["load 0.5×"].all_ttft(), by_name["load 2×"].all_ttft()
        alone = by_name["trickle alone"].ttft.get(trickle, [])
        beside = by_name["trickle beside a 2× flood"].ttft.get(trickle, [])
        one, two = by_name["load 1×"].goodput(), by_name["load 2×"].goodput()
        if "mixed 2×" in by_name:
            mixed = [percentile_ms(by_name[f"mixed {factor:g}×"].all_ttft(), 0.99) for factor in LOADS]
            print(f"{config}: mixed load, admitted TTFT p99 at {', '.join(f'{f:g}×' for f in LOADS)}: "
                  f"{' / '.join(mixed)} ms (promise {PROMISE_S * 1e3:.0f} ms plus a prompt's own prefill)")
        print(f"{config}: admitted TTFT p99 at 2× {percentile_ms(high, 0.99)} ms (promise {PROMISE_S * 1e3:.0f}), "
              f"/ at 0.5× = {_ratio(high, low)} (target ≤ 3); refusal p99 "
              f"{percentile_ms(by_name['load 2×'].refusals, 0.99)} ms (target < 50); goodput 2× / 1× = "
              f"{two / one if one else float('nan'):.2f} (target ≥ 0.9); {trickle} TTFT p99 beside the {flood} flood "
              f"/ alone = {_ratio(beside, alone)} (target ≤ 2); streams' ITL p99 {percentile_ms(calm, 0.99)} ms "
              f"without the burst, {percentile_ms(loud, 0.99)} ms during it = {_ratio(loud, calm)} (target ≤ 1.5; "
              f"{len(calm)} and {len(loud)} gaps)")


def _ratio(values: list[float], reference: list[float]) -> str:
    if not values or not reference:
        return "–"
    return f"{float(percentile_ms(values, 0.99)) / max(1.0, float(percentile_ms(reference, 0.99))):.2f}"


def start_pod(workdir: Path, repo: Path | None, *extra: str) -> PodProcess:
    flags = ["--adapter-root", str(demo_adapter_dir(DEMO_ADAPTERS[0]).parent), *extra]
    pod = PodProcess(workdir, *flags, name=f"pod-{len(list(workdir.iterdir()))}",
                     **({"repo": repo} if repo else {}))
    return pod.start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="arrivals per phase")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--capacity-requests", type=int, default=64, help="requests of the closed-loop capacity run")
    parser.add_argument("--trickle-rate", type=float, default=0.5, help="the trickle adapter's requests per second")
    parser.add_argument("--streams", type=int, default=8, help="streams running through the burst")
    parser.add_argument("--burst", type=int, default=16, help="long prompts in the burst")
    parser.add_argument("--burst-after", type=float, default=4.0, help="seconds of streams alone before the burst")
    parser.add_argument("--before-tree", type=Path, help="a checkout of the earlier version to compare with")
    parser.add_argument("--mixed", action="store_true",
                        help=f"also the mixed load: adapters at random, prompts of {MIXED_WORDS[0]}-{MIXED_WORDS[1]} "
                             f"words, {MIXED_TOKENS[0]}-{MIXED_TOKENS[1]} new tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke check: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    configs = {"before": args.before_tree, "after": None} if args.before_tree else {"after": None}
    results: dict[str, tuple[list[Phase], tuple]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # one capacity for both: the first configuration's code with admission off, after a warm-up
        pod = start_pod(Path(tmp), next(iter(configs.values())), "--max-queue-delay", "0")
        try:
            async def measure(address=pod.address) -> float:
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = generation_pb2_grpc.GenerationStub(channel)
                    adapters = [None, *DEMO_ADAPTERS]
                    await capacity(stub, len(adapters), args.max_tokens, adapters, args.seed)
                    return await capacity(stub, args.capacity_requests, args.max_tokens, adapters, args.seed)
            rate = asyncio.run(measure())
            print(f"capacity: {rate:.2f} requests/s", flush=True)
        finally:
            pod.stop()
        for config, repo in configs.items():
            pod = start_pod(Path(tmp), repo)
            try:
                results[config] = asyncio.run(run_config(pod, args, rate))
                print(f"{config}: done", flush=True)
            finally:
                pod.stop()
    report(results, rate, args)


if __name__ == "__main__":
    main()
