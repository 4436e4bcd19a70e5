"""Prefix-aware routing in the fleet simulator (fleetsim/prefix_fleet.py): the router's score with the prefix
term at several weights against today's scoring (weight 0, blind to prefixes), on the same requests.

Each scenario is one seeded chat workload: ``adapters x system prompts`` distinct system prompts of 1,024
tokens, a unique user turn of 64-256 tokens and an answer of 32-256 tokens, Poisson arrivals, on 8 pods
of 4,096 KV blocks x 16 tokens (64k tokens: about 64 system prompts besides the running requests).
Per weight: share of prompt tokens found cached, prompt tokens computed per request, time to first token
p50/p99, end-to-end p50, load imbalance (max / mean requests per pod), and the share of requests sent to a
pod that reported holding part of their prefix. Prints a markdown table.

    python benchmarks/prefix_routing.py --jobs 2
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # fleetsim/ is not part of the installed package

from processes import cpu_model, load_average  # noqa: E402  (benchmarks/processes.py)

from conventions.pod_cost import Weights  # noqa: E402
from fleetsim.prefix_fleet import PrefixFleet, PrefixResult, PrefixSimulation, PrefixWorkload  # noqa: E402

# name -> (system prompts per adapter, Zipf alpha over the prompts, requests per second)
# 64 prompts fill about one pod's cache; 128 two pods'; with 16 at zipf 1.5 one prompt takes 47% of requests,
# nearly four pods' worth.
SCENARIOS = {
    "64 uniform": (16, 0.0, 60.0),
    "128 uniform": (32, 0.0, 60.0),
    "128 zipf 1.0": (32, 1.0, 60.0),
    "128 uniform 1.25x rate": (32, 0.0, 75.0),
    "16 zipf 1.5": (4, 1.5, 60.0),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="0,1,3,6,10,20",
                   help=f"prefix weights to compare; 0 is today's scoring and {Weights.prefix:g} the router's default "
                        "(default 0,1,3,6,10,20)")
    p.add_argument("--duration", type=float, default=120.0, help="simulated seconds of arrivals (default 120)")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of arrivals not counted (default 30)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS))
    p.add_argument("--jobs", type=int, default=1, help="simulations run at once (processes) (default 1)")
    args = p.parse_args()
    weights = [float(w) for w in args.weights.split(",")]
    scenarios = [s.strip() for s in args.scenarios.split(",")]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario: {', '.join(unknown)}")
    print(header(args))
    jobs = [(args, s, w) for s in scenarios for w in weights]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run_one, jobs))
    print("| scenario | prefix weight | cached | prefill tokens/request | TTFT p50 ms | TTFT p99 ms | e2e p50 ms "
          "| imbalance | to a holder |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (_, scenario, _), r in zip(jobs, results, strict=True):
        print(f"| {scenario} | {r.prefix_weight:g} | {r.hit_rate:.1%} | {r.prefill_tokens_per_request:.0f} | "
              f"{r.ttft_p50_ms:.0f} | {r.ttft_p99_ms:.0f} | {r.e2e_p50_ms:.0f} | {r.imbalance:.2f} | "
              f"{r.routed_to_holder:.0%} |")


def header(args: argparse.Namespace) -> str:
    return (f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu_model()}, {os.cpu_count()} cores, "
            f"load average {load_average()}, Python {platform.python_version()}, numpy {np.__version__}\n"
            f"{PrefixFleet()}\n{args.duration:g} s of arrivals ({args.warmup:g} s warm-up), seed {args.seed}\n")


def run_one(job: tuple[argparse.Namespace, str, float]) -> PrefixResult:
    args, scenario, weight = job
    prompts, alpha, rate = SCENARIOS[scenario]
    workload = PrefixWorkload(system_prompts=prompts, alpha=alpha, rate=rate, duration_s=args.duration,
                              warmup_s=args.warmup, seed=args.seed)
    return PrefixSimulation(PrefixFleet(), workload, weight).run()


if __name__ == "__main__":
    main()
