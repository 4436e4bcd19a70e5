"""A CPU pod's step time with one torch thread team against two: the pod's own engine on the demo model,
its steps run on the model thread as the pod runs them, in two kinds of process.

- ``one team``: as the pod starts (``data_plane.engine.threads.compute_on_one_thread`` first), every
  thread but the model thread computes on one torch thread;
- ``two teams``: as pods started before it, the thread that loads the model computes on torch's default
  count too, and its OpenMP team outlives the load beside the model thread's.

A team lasts as long as its thread, so each kind runs in its own process, alternated ``--rounds`` times.
Each process times ``--steps`` interleaved steps of each mix (decodes at a context of 150 tokens, a
prompt's first chunk beside them) and prints the median; the table gives each mix's median over the
rounds, and the mix's time over 8 decodes alone in the same kind of process.

    python benchmarks/compute_threads.py [--rounds 2] [--steps 12]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from cpu_matmul import build_demo_engine, replay  # benchmarks/cpu_matmul.py
from processes import cpu_model, load_average  # benchmarks/processes.py

from data_plane.engine.scheduler import ScheduledSeq
from data_plane.engine.sequence import SamplingParams, Sequence
from data_plane.engine.threads import available_cpus, compute_on_one_thread

KINDS = ("two teams", "one team")
CONTEXT = 150
# mix -> (adapter index or None for the base model, new tokens, cached tokens) per sequence
MIXES = {
    "8 decodes": [(None, 1, CONTEXT)] * 8,
    "8 decodes + 1 adapter decode": [(None, 1, CONTEXT)] * 8 + [(0, 1, CONTEXT)],
    "8 decodes + an adapter's 8-token prompt": [(None, 1, CONTEXT)] * 8 + [(0, 8, 0)],
    "8 decodes + an adapter's 24-token prompt": [(None, 1, CONTEXT)] * 8 + [(0, 24, 0)],
    "32 decodes": [(None, 1, CONTEXT)] * 32,
}


def batch(engine, adapter_slots: list[int], mix: list[tuple[int | None, int, int]]) -> list[ScheduledSeq]:
    """A hand-built step (replayed by ``cpu_matmul.replay``): each sequence its own blocks and table row."""
    size, first, out = engine.limits.block_size, 0, []
    for row, (adapter, new, cached) in enumerate(mix):
        blocks = -(-(cached + new + 1) // size)
        seq = Sequence(f"s{row}", None, [5] * (cached + new), SamplingParams(), cached + new + 1,
                       block_table=list(range(first, first + blocks)), kv_row=row,
                       slot=-1 if adapter is None else adapter_slots[adapter])
        seq.num_computed = cached
        first += blocks
        out.append(ScheduledSeq(seq, new))
    return out


def measure(kind: str, steps: int) -> dict[str, float]:
    """Median ms of each mix's step, run on the engine's model thread, in a process of ``kind``."""
    if kind == "one team":
        compute_on_one_thread(asyncio.new_event_loop())
    with tempfile.TemporaryDirectory() as tmp:
        engine, slots = build_demo_engine(32, Path(tmp), "auto", available_cpus())
        batches = {name: batch(engine, slots[1:], mix) for name, mix in MIXES.items()}
        times: dict[str, list[float]] = {name: [] for name in MIXES}
        for b in batches.values():
            engine.on_model_thread(replay, engine, b)
        for _ in range(steps):
            for name, b in batches.items():
                started = time.perf_counter()
                engine.on_model_thread(replay, engine, b)
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="processes of each kind, alternated")
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each mix per process")
    parser.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)  # one process's measurement
    args = parser.parse_args()
    if args.kind:
        print(json.dumps(measure(args.kind, args.steps)))
        return
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            out = subprocess.run([sys.executable, __file__, "--kind", kind, "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True).stdout
            runs[kind].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, torch {torch.__version__}, {available_cpus()} "
          f"compute threads, load average {load_average()}; demo model at --dtype auto, {args.rounds} processes of "
          f"each kind, median of {args.steps} steps each\n")
    print("| step | two teams ms | one team ms | one / two | two teams, / 8 decodes | one team, / 8 decodes |")
    print("|---|---|---|---|---|---|")
    median = {kind: {name: statistics.median(r[name] for r in runs[kind]) for name in MIXES} for kind in KINDS}
    two, one = median["two teams"], median["one team"]
    for name in MIXES:
        print(f"| {name} | {two[name]:.1f} | {one[name]:.1f} | {one[name] / two[name]:.2f} | "
              f"{two[name] / two['8 decodes']:.2f} | {one[name] / one['8 decodes']:.2f} |")


if __name__ == "__main__":
    main()
