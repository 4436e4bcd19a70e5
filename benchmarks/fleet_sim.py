"""Fleet simulation: our placement, plan, replica decision, prefetch and router picker against the peers'
policies on the same traces, 100 pods x 8 slots x 64 CPU entries x a 10 GiB disk tier and 10,000 remote
adapters by default (``fleetsim/``).

Each scenario is one seeded trace (``--duration`` seconds, the first ``--warmup`` not counted, so caches that
start empty do not weigh on the results) that every policy serves in turn. The ``--pins`` hottest adapters of
the trace's start are pinned with ``--pin-replicas`` replicas, placed by our control plane for every policy
but AIBrix (which places them on the pods with the fewest adapters). Per policy: device-slot hits and CPU-tier
hits on arrival, cold loads (loads into memory a request started) per 1,000 requests, downloads into a disk
tier per 1,000 requests, prefetches and loads the control plane started (pins, extra replicas), queueing delay
(arrival to first step, downloads and loads included) p50/p99, and load imbalance (max / mean of tokens decoded
per pod). Ours runs as shipped, the router's bounds on load included (``--load-bound`` and ``--share-bound`` to
try others, 0 for none). Prints a markdown table and the issue's targets per scenario; ``--plots DIR`` writes PNGs;
``--explain aibrix`` prints where the worst-queued requests of a policy waited.

    python benchmarks/fleet_sim.py --jobs 2 --plots benchmarks/plots
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # fleetsim/ is not part of the installed package

from processes import cpu_model, load_average  # noqa: E402  (benchmarks/processes.py)

from control_plane.errors import ConfigError  # noqa: E402
from control_plane.placement import Pin  # noqa: E402
from control_plane.replication import Policy as ReplicaPolicy  # noqa: E402
from conventions.pod_cost import Weights  # noqa: E402
from fleetsim.config import FleetConfig, shipped  # noqa: E402
from fleetsim.pod import Arrival  # noqa: E402
from fleetsim.policies import POLICIES, Ours, shipped_replication  # noqa: E402
from fleetsim.simulator import SimResult, Simulation  # noqa: E402
from fleetsim.trace import Arrivals, Trace, TraceConfig, make_trace  # noqa: E402
from router.config import RouterConfig  # noqa: E402

TARGET = "zipf 1.0 drift"
RANK_MIX = (8, 16, 32, 64, 128)
# name -> (alpha, drift, arrivals, rate factor, ranks)
SCENARIOS = {
    TARGET: (1.0, True, Arrivals.POISSON, 1.0, (16,)),
    "zipf 0.8 drift": (0.8, True, Arrivals.POISSON, 1.0, (16,)),
    "zipf 1.2 drift": (1.2, True, Arrivals.POISSON, 1.0, (16,)),
    "zipf 1.0 no drift": (1.0, False, Arrivals.POISSON, 1.0, (16,)),
    "zipf 1.0 drift bursty": (1.0, True, Arrivals.BURSTY, 1.0, (16,)),
    "zipf 1.0 drift 1.5x rate": (1.0, True, Arrivals.POISSON, 1.5, (16,)),
    "zipf 1.0 drift rank mix": (1.0, True, Arrivals.POISSON, 1.0, RANK_MIX),
}
BASELINES = ("round-robin", "least-loaded", "aibrix", "gateway-lora-affinity")
DEFAULT_POLICIES = ("ours", *BASELINES)
LORA_PEERS = ("aibrix", "gateway-lora-affinity")  # the cold-load target is against these


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pods", type=int, default=100)
    p.add_argument("--cpu-entries", type=int, default=64)
    p.add_argument("--adapters", type=int, default=10_000)
    p.add_argument("--rate", type=float, default=200.0, help="mean requests/s of the fleet (default 200)")
    p.add_argument("--duration", type=float, default=240.0, help="simulated seconds of arrivals (default 240)")
    p.add_argument("--warmup", type=float, default=120.0, help="seconds of arrivals not counted (default 120)")
    p.add_argument("--drift-period", type=float, default=30.0)
    p.add_argument("--drift-step", type=int, default=250)
    p.add_argument("--pins", type=int, default=10)
    p.add_argument("--pin-replicas", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS))
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma-separated, of: " + ", ".join(POLICIES))
    p.add_argument("--weights", default="", help="our routing weights other than the shipped ones, e.g. "
                   "free_slot=4,evict=6 (conventions/pod_cost.py)")
    p.add_argument("--load-bound", type=float, help="our router's bound on outstanding requests (--load-bound, "
                   "router/scoring.py) other than the shipped one; 0: none")
    p.add_argument("--share-bound", type=float, help="our router's bound on the share of requests (--share-bound, "
                   "router/scoring.py) other than the shipped one; 0: none")
    p.add_argument("--replica-high-rate", type=float, help="our replica thresholds, requests/s per replica, "
                   "other than the shipped ones (control_plane/config.py); with --replica-low-rate")
    p.add_argument("--replica-low-rate", type=float)
    p.add_argument("--jobs", type=int, default=1, help="simulations run at once (processes)")
    p.add_argument("--plots", type=Path, help="directory for PNG plots (needs matplotlib)")
    p.add_argument("--explain", default="", help="a policy whose worst-queued requests to trace in the first "
                   "scenario, instead of the table")
    args = p.parse_args()
    scenarios = [s.strip() for s in args.scenarios.split(",")]
    policies = [s.strip() for s in args.policies.split(",")]
    unknown = [s for s in scenarios if s not in SCENARIOS] + [s for s in policies if s not in POLICIES]
    if unknown:
        p.error(f"unknown scenario or policy: {', '.join(unknown)}")
    try:
        weights(args.weights)
    except (TypeError, ValueError) as e:
        p.error(f"--weights {args.weights!r}: {e}")
    try:
        replication(args)
    except ConfigError as e:
        p.error(str(e))

    print(header(args))
    if args.explain:
        print(explain(args, scenarios[0], args.explain))
        return
    jobs = [(args, s, pol) for s in scenarios for pol in policies]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run_one, jobs))
    table = {(s, r.policy): r for (_, s, _), r in zip(jobs, results, strict=True)}
    print(markdown(table, scenarios, policies))
    print(verdict(table, scenarios, policies,
                  {s: first_requests_per_1k(scenario_trace(args, s), args.warmup) for s in scenarios}))
    if args.plots:
        plot(table, scenarios, policies, args.plots)


def header(args: argparse.Namespace) -> str:
    return (f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu_model()}, {os.cpu_count()} cores, "
            f"load average {load_average()}, Python {platform.python_version()}, "
            f"numpy {np.__version__}\nfleet {args.pods} pods x {FleetConfig().slots} slots x {args.cpu_entries} "
            f"CPU entries, {args.adapters} adapters, {args.rate:g} requests/s, {args.duration:g} s "
            f"({args.warmup:g} s warm-up), drift every {args.drift_period:g} s by {args.drift_step}, "
            f"{args.pins} pins x {args.pin_replicas}, seed {args.seed}\nour weights {weights(args.weights)}, "
            f"load bound {bound(args, 'load_bound')}, share bound {bound(args, 'share_bound')}\n"
            f"our replicas {replication(args)}\n")


def weights(spec: str) -> Weights:
    """``name=value,...`` over the shipped Weights."""
    return Weights(**{k.strip(): float(v) for k, v in (kv.split("=", 1) for kv in spec.split(",") if kv.strip())})


def bound(args: argparse.Namespace, name: str) -> float:
    """Our router's bound ``name`` (a RouterConfig field) as the run uses it."""
    given = getattr(args, name)
    return shipped(RouterConfig, name) if given is None else given


def replication(args: argparse.Namespace) -> ReplicaPolicy:
    shipped = shipped_replication()
    high = shipped.high_rate if args.replica_high_rate is None else args.replica_high_rate
    low = shipped.low_rate if args.replica_low_rate is None else args.replica_low_rate
    return dataclasses.replace(shipped, high_rate=high, low_rate=low)


def scenario_trace(args: argparse.Namespace, scenario: str) -> Trace:
    alpha, drift, arrivals, factor, ranks = SCENARIOS[scenario]
    return make_trace(TraceConfig(adapters=args.adapters, rate=args.rate * factor, duration_s=args.duration,
                                  alpha=alpha, arrivals=arrivals, drift_period_s=args.drift_period if drift else 0,
                                  drift_step=args.drift_step, ranks=ranks, seed=args.seed))


def first_requests_per_1k(trace: Trace, warmup_s: float) -> float:
    """Counted requests (from ``warmup_s`` on) whose adapter no earlier request of the trace named, per 1,000
    counted requests: a cold load under any routing, with no copy in memory anywhere (the floor of cold loads
    for a fleet that loads an adapter only once something asked for it)."""
    _, first = np.unique(trace.adapters, return_index=True)
    counted = trace.times >= warmup_s
    return 1000 * np.count_nonzero(trace.times[first] >= warmup_s) / max(1, np.count_nonzero(counted))


def simulation(args: argparse.Namespace, scenario: str, policy: str) -> Simulation:
    trace = scenario_trace(args, scenario)
    first = trace.adapters[trace.times < args.warmup]
    hottest = np.argsort(-np.bincount(first, minlength=args.adapters), kind="stable")[: args.pins]
    pins = [Pin(trace.names[i], args.pin_replicas) for i in hottest]
    fleet = FleetConfig(pods=args.pods, cpu_entries=args.cpu_entries)
    chosen = POLICIES[policy]()
    if isinstance(chosen, Ours):
        chosen.weights = weights(args.weights)
        chosen.load_bound, chosen.share_bound = bound(args, "load_bound"), bound(args, "share_bound")
        if chosen.replication is not None:
            chosen.replication = replication(args)
    return Simulation(fleet, trace, chosen, pins, seed=args.seed, warmup_s=args.warmup)


def run_one(job: tuple[argparse.Namespace, str, str]) -> SimResult:
    return simulation(*job).run()


def markdown(table: dict[tuple[str, str], SimResult], scenarios: list[str], policies: list[str]) -> str:
    rows = ["| scenario | policy | slot hits | CPU hits | cold loads / 1k req | downloads / 1k req | prefetches | "
            "control-plane loads | queue p50 ms | queue p99 ms | imbalance | requests | wall s |", "|" + "---|" * 13]
    for s in scenarios:
        for pol in policies:
            r = table[(s, pol)]
            rows.append(f"| {s} | {pol} | {r.device_hit_rate:.1%} | {r.cpu_hit_rate:.1%} | {r.cold_per_1k:.1f} | "
                        f"{r.downloads_per_1k:.1f} | {r.prefetches} | {r.preloads} | {r.queue_p50_ms:.0f} | "
                        f"{r.queue_p99_ms:.0f} | {r.imbalance:.2f} | {r.completed}/{r.requests} | {r.wall_s:.1f} |")
    return "\n".join(rows)


def verdict(table: dict[tuple[str, str], SimResult], scenarios: list[str], policies: list[str],
            floors: dict[str, float]) -> str:
    """The issue's targets per scenario: cold loads at least 5x fewer than each LoRA-aware peer's, queue p99 no
    worse than the best peer's, imbalance at most 1.2; beside the cold-load floor (``first_requests_per_1k``)."""
    lines = []
    peers = [b for b in BASELINES if b in policies]
    if "ours" not in policies or not peers:
        return ""
    for s in scenarios:
        ours = table[(s, "ours")]
        parts = [f"first requests of an adapter {floors[s]:.1f} / 1k"]
        for peer in (b for b in LORA_PEERS if b in policies):
            ratio = table[(s, peer)].cold_per_1k / max(ours.cold_per_1k, 1e-9)
            parts.append(f"{ratio:.1f}x fewer cold loads than {peer} ({'met' if ratio >= 5 else 'missed'})")
        best = min((table[(s, b)] for b in peers), key=lambda r: r.queue_p99_ms)
        parts.append(f"queue p99 {ours.queue_p99_ms:.0f} ms vs best peer {best.policy} {best.queue_p99_ms:.0f} ms "
                     f"({'met' if ours.queue_p99_ms <= best.queue_p99_ms else 'missed'})")
        parts.append(f"imbalance {ours.imbalance:.2f} ({'met' if ours.imbalance <= 1.2 else 'missed'})")
        lines.append(f"{s}: " + "; ".join(parts))
    return "\n".join(lines)


def explain(args: argparse.Namespace, scenario: str, policy: str) -> str:
    """Where the requests of ``policy`` that waited longest (queue at or past its p99) waited: their adapters,
    each adapter's rate (mean, and in its busiest 10 s), how many pods served it and which most, and how long
    its requests queued; beside what one pod serves."""
    sim = simulation(args, scenario, policy)
    r = sim.run()
    trace, counted = sim.trace, sim.trace.times >= args.warmup
    p99 = np.nanpercentile(sim.queue_s[counted], 99)
    worst = np.flatnonzero(counted & (sim.queue_s >= p99))
    window = trace.times[-1] - args.warmup
    mean_step = sim.config.step.step_s(sim.config.max_num_seqs, sim.config.max_num_seqs)
    per_pod = sim.config.max_num_seqs / (trace.tokens.mean() * mean_step)
    lines = [f"{policy}, {scenario}: queue p99 {r.queue_p99_ms:.0f} ms; {len(worst)} requests at or past it; "
             f"one pod serves about {per_pod:.1f} requests/s (a full batch of {sim.config.max_num_seqs}, "
             f"{trace.tokens.mean():.0f} tokens each, {mean_step * 1000:.1f} ms a step with as many adapters)"]
    found = np.bincount(sim.arrived_as[worst], minlength=len(Arrival))
    running, waiting = np.median(sim.busy_at_arrival[worst], axis=0)
    lines.append("  where their adapter was on arrival: " + ", ".join(
        f"{kind.name.lower()} {found[kind]}" for kind in Arrival) + f"; their pod then ran a median {running:.0f} "
        f"and queued {waiting:.0f} (every counted request's pod: "
        f"{np.median(sim.busy_at_arrival[counted], axis=0)[0]:.0f} / "
        f"{np.median(sim.busy_at_arrival[counted], axis=0)[1]:.0f})")
    by_adapter = np.bincount(trace.adapters[worst], minlength=len(trace.names))
    for a in np.argsort(-by_adapter)[:5]:
        if not by_adapter[a]:
            break
        mine = np.flatnonzero(counted & (trace.adapters == a))
        pods = np.bincount(sim.routed[mine], minlength=len(sim.pods))
        top = int(np.argmax(pods))
        peak = np.bincount((trace.times[mine] // 10).astype(np.int64)).max() / 10
        lines.append(f"  {trace.names[a]}: {by_adapter[a]} of them; {len(mine) / window:.1f} requests/s ({peak:.1f} "
                     f"in its busiest 10 s); served on "
                     f"{np.count_nonzero(pods)} pods, {pods[top]} of its requests on {sim.pods[top].id}; their "
                     f"queue p50 / max {np.nanmedian(sim.queue_s[mine]):.1f} / {np.nanmax(sim.queue_s[mine]):.1f} s")
    return "\n".join(lines)


def plot(table: dict[tuple[str, str], SimResult], scenarios: list[str], policies: list[str], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("--plots needs matplotlib: pip install -r requirements-test.txt")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for field, label, name, log in (("cold_per_1k", "cold loads per 1,000 requests", "fleet_cold_loads.png", False),
                                    ("queue_p99_ms", "queueing delay p99, ms (log)", "fleet_queue_p99.png", True),
                                    ("device_hit_rate", "device-slot hit rate", "fleet_slot_hits.png", False)):
        fig, ax = plt.subplots(figsize=(11, 4.5))
        width = 0.8 / len(policies)
        x = np.arange(len(scenarios))
        for k, pol in enumerate(policies):
            ax.bar(x + k * width, [getattr(table[(s, pol)], field) for s in scenarios], width, label=pol)
        ax.set_xticks(x + width * (len(policies) - 1) / 2, scenarios, fontsize=8)
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.set_title(label)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
