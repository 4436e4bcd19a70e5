"""Router overhead: the same streaming load sent direct to the pods and through ``lorafleet router``, in one run.

Real processes on loopback: a redis-server, a control plane, ``--pods`` CPU pods on the demo model (the
demo adapters registered) and one router reading the fleet from the control plane. Clients are
``lorafleet.v1`` Generation stubs in this process's threads (benchmarks/stream_load.py). Each round runs
two loads, each once direct and once through the router; the order of the two paths alternates from
round to round (direct first in odd rounds) so that a shared machine's drifting load hits both alike:

- ``load``: ``--requests`` requests, ``--concurrency`` streams open at once, ``--max-tokens`` tokens
  each (EOS ignored, greedy), round-robin over the base model and the demo adapters. Direct, requests
  go to the pods in turn; through the router, to the pod it picks (with one pod, the same one).
  Reported: TTFT p50/p99 and output tokens/s of each path, and per round what the router adds to TTFT
  and takes from throughput (targets: at most 5 ms on TTFT p50, at most 5% of throughput).
- ``flood``: many short streams (``--flood-requests`` requests of ``--flood-max-tokens`` tokens,
  ``--flood-streams`` open at once): response messages per second counted at the client.

Every run also reports the CPU time (utime + stime from /proc/<pid>/stat; this process's from
os.times) that the router, the pods and the client spent, as a share of one core, and the router's CPU
time per forwarded message above its idle rate (its CPU per second during the same round's direct run
of the same load, when it forwards nothing but still refreshes its view of the fleet). The router is
one asyncio process: when it is well under 100% of a core, the message rate is bound by the pods (or
the client), not by the router.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from processes import (  # benchmarks/processes.py
    Fleet,
    RouterProcess,
    copy_demo_adapters,
    cpu_model,
    cpu_seconds,
    load_average,
)
from stream_load import PROMPTS, Run, drive, percentile_ms  # benchmarks/stream_load.py

from data_plane.demo_adapters import DEMO_ADAPTERS

QUICK = {"requests": 8, "concurrency": 4, "max_tokens": 8, "rounds": 1,
         "flood_requests": 16, "flood_streams": 16, "flood_max_tokens": 4}


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class RoundRobin:
    """Generate on each pod in turn: the direct path's spread over several pods."""

    def __init__(self, stubs: list) -> None:
        self._next = itertools.cycle(stubs).__next__

    def Generate(self, request, timeout=None):  # noqa: N802 - the stub's method name
        return self._next().Generate(request, timeout=timeout)


@dataclass
class Measured:
    load: str  # "load" or "flood"
    path: str  # "direct" or "router"
    run: Run
    router_cpu_s: float
    pods_cpu_s: float
    client_cpu_s: float

    def share(self, cpu_s: float) -> str:
        return f"{100 * cpu_s / self.run.wall_s:.0f}"

    def router_s_per_message(self, idle: Measured) -> float:
        """The router's CPU seconds per forwarded message above its rate during ``idle`` (a direct run)."""
        idle_rate = idle.router_cpu_s / idle.run.wall_s
        return (self.router_cpu_s - idle_rate * self.run.wall_s) / self.run.messages


def measure(load: str, path: str, stub, adapters: list[str | None], prompts: list[str], max_tokens: int,
            concurrency: int, router: RouterProcess, fleet: Fleet) -> Measured:
    pids = [pod.proc.pid for pod in fleet.pods.values()]
    before = (cpu_seconds(router.proc.pid), sum(map(cpu_seconds, pids)), own_cpu_seconds())
    run = drive(stub, f"{load}, {path}", adapters, prompts, max_tokens, concurrency)
    after = (cpu_seconds(router.proc.pid), sum(map(cpu_seconds, pids)), own_cpu_seconds())
    return Measured(load, path, run, *(b - a for a, b in zip(before, after, strict=True)))


def print_report(rounds: list[list[Measured]], args: argparse.Namespace, started_load: str) -> None:
    print(f"\n{time.strftime('%Y-%m-%d')}, {cpu_model()} ({os.cpu_count()} cores), torch {version('torch')}, "
          f"grpcio {version('grpcio')}, Python {sys.version.split()[0]}; load average {started_load} at the "
          f"start, {load_average()} at the end; command: "
          f"python benchmarks/router.py {shlex.join(sys.argv[1:])}".rstrip())
    print(f"load: {args.requests} requests, {args.concurrency} streams open, {args.max_tokens} tokens each; "
          f"flood: {args.flood_requests} requests, {args.flood_streams} streams open, {args.flood_max_tokens} "
          f"tokens each; {args.pods} pod(s) on the demo model\n")
    def pair(runs: list[Measured], load: str, path: str) -> Measured:
        return next(m for m in runs if (m.load, m.path) == (load, path))

    def pick(runs: list[Measured], load: str, path: str) -> Run:
        return pair(runs, load, path).run

    print("| round | load | path | output tok/s | messages/s | TTFT p50 ms | TTFT p99 ms | router CPU % "
          "| router CPU µs/message above idle | pods CPU % | client CPU % | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, runs in enumerate(rounds, 1):
        for m in sorted(runs, key=lambda m: (m.load != "load", m.path)):
            r = m.run
            per_message = (f"{1e6 * m.router_s_per_message(pair(runs, m.load, 'direct')):.0f}"
                           if m.path == "router" else "–")
            print(f"| {i} | {m.load} | {m.path} | {r.throughput:.1f} | {r.message_rate:.0f} "
                  f"| {percentile_ms(r.ttft, 0.5)} | {percentile_ms(r.ttft, 0.99)} | {m.share(m.router_cpu_s)} "
                  f"| {per_message} | {m.share(m.pods_cpu_s)} | {m.share(m.client_cpu_s)} | {r.wall_s:.1f} |")

    def pct(values: list[float], q: float) -> float:
        return float(percentile_ms(values, q))

    def line(what: str, values: list[float], unit: str) -> None:
        print(f"{what} per round: {', '.join(f'{v:+.1f}' for v in values)} {unit}; "
              f"median {statistics.median(values):+.1f} {unit}")

    print()
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        line(f"TTFT {name} added by the router (router - direct)",
             [pct(pick(r, "load", "router").ttft, q) - pct(pick(r, "load", "direct").ttft, q) for r in rounds], "ms")
    line("Throughput lost through the router (1 - router/direct)",
         [100 * (1 - pick(r, "load", "router").throughput / pick(r, "load", "direct").throughput) for r in rounds],
         "%")
    floods = [pair(r, "flood", "router") for r in rounds]
    rate = statistics.median(m.run.message_rate for m in floods)
    direct = statistics.median(pick(r, "flood", "direct").message_rate for r in rounds)
    busy = statistics.median(m.router_cpu_s / m.run.wall_s for m in floods)
    per_message = statistics.median(pair(r, "flood", "router").router_s_per_message(pair(r, "flood", "direct"))
                                    for r in rounds)
    print(f"Flood: {rate:.0f} messages/s through the router, {direct:.0f} direct (medians); the router used "
          f"{100 * busy:.0f}% of one core, {1e6 * per_message:.0f} µs of CPU per message above idle "
          f"({1 / per_message:.0f} messages per router CPU-second); "
          f"{'router-bound' if busy >= 0.9 else 'not router-bound: the pods or the client set the rate'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32, help="requests per load run")
    parser.add_argument("--concurrency", type=int, default=8, help="streams open at once in a load run")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each load request generates")
    parser.add_argument("--flood-requests", type=int, default=64, help="requests per flood run")
    parser.add_argument("--flood-streams", type=int, default=64, help="streams open at once in a flood run")
    parser.add_argument("--flood-max-tokens", type=int, default=16, help="tokens each flood request generates")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of (direct, router) for both loads, the paths' order alternating")
    parser.add_argument("--pods", type=int, default=1, choices=[1, 2], help="CPU pods behind the router")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke check: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    started_load = load_average()
    cycle = [None, *DEMO_ADAPTERS]
    adapters = [cycle[i % len(cycle)] for i in range(args.requests)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    flood_adapters = [cycle[i % len(cycle)] for i in range(args.flood_requests)]
    flood_prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.flood_requests)]
    rounds: list[list[Measured]] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        fleet = Fleet(workdir, copy_demo_adapters(workdir / "adapters"),
                      "--max-num-seqs", str(max(args.concurrency, args.flood_streams)), "--num-kv-blocks", "0",
                      pods=args.pods)
        router = None
        try:
            fleet.start()
            for name in DEMO_ADAPTERS:
                fleet.register(name)
            router = RouterProcess(workdir, fleet.cp.target, fleet.token_file).start()
            paths = {"direct": RoundRobin([pod.generation() for pod in fleet.pods.values()]),
                     "router": router.generation()}
            for stub in paths.values():  # loads every adapter where each path sends it
                drive(stub, "warm-up", cycle * args.pods, [PROMPTS[0]] * len(cycle) * args.pods, 2)
            for i in range(args.rounds):
                order = ["direct", "router"] if i % 2 == 0 else ["router", "direct"]
                runs = [measure("load", path, paths[path], adapters, prompts, args.max_tokens, args.concurrency,
                                router, fleet) for path in order]
                runs += [measure("flood", path, paths[path], flood_adapters, flood_prompts, args.flood_max_tokens,
                                 args.flood_streams, router, fleet) for path in order]
                rounds.append(runs)
                print(f"round {i + 1}: " + ", ".join(f"{m.load} {m.path} {m.run.throughput:.1f} tok/s "
                                                      f"{m.run.message_rate:.0f} msg/s" for m in runs), flush=True)
        finally:
            if router is not None:
                router.stop()
            fleet.stop()
    print_report(rounds, args, started_load)


if __name__ == "__main__":
    main()
