"""What a pod's steps cost on this CPU, per precision: decode steps of 1, 8 and 32 sequences and a
512-token prefill chunk on the demo model with the serving mix of adapters (benchmarks/serve.py:
base model, the three demo adapters, a random rank-16 one). Run with and without ``--fastest`` (one
oneDNN call per projection, which does not keep a row's bits), it measures what the probed rule costs
against the fastest path in the same tree; run on two trees, against the code before it.
benchmarks/RESULTS.md ("Batch invariance") says how the figures there were taken.

Each step kind runs ``--steps`` times after two warm runs; the median and the fastest are reported,
in milliseconds of wall time on ``--threads`` threads, or with ``--cpu-time`` (one thread) of the
thread's CPU time, which other jobs on a shared machine barely change. Prints one markdown row per
step kind.

    python benchmarks/invariance_cost.py --dtype float32 [--steps 15] [--label after] [--cpu-time] [--fastest]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from cpu_matmul import build_demo_engine, decode_batch, replay  # benchmarks/cpu_matmul.py
from processes import cpu_flags, cpu_model, load_average  # benchmarks/processes.py

from data_plane.engine.scheduler import ScheduledSeq
from data_plane.engine.sequence import SamplingParams, Sequence
from data_plane.model import cpu_linear
from data_plane.model.row_rule import Tiling

CONTEXT = 150  # tokens each decode sequence has before its step
PREFILL = 512


def prefill_batch(engine, slot: int, first_block: int) -> list[ScheduledSeq]:
    """One sequence's ``PREFILL``-token chunk, its blocks from ``first_block`` on."""
    blocks = -(-(PREFILL + 1) // engine.limits.block_size)
    seq = Sequence("prefill", None, [5] * PREFILL, SamplingParams(), PREFILL + 2,
                   block_table=list(range(first_block, first_block + blocks)), kv_row=0, slot=slot)
    return [ScheduledSeq(seq, PREFILL)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", help="the pod's precision (--dtype)")
    parser.add_argument("--steps", type=int, default=15, help="timed runs per step kind")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--label", default="", help="the tree measured, for the table")
    parser.add_argument("--cpu-attention", choices=("native", "tiled"), help="the pod's --cpu-attention (default: "
                        "the pod's; a tree older than the option takes none)")
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed in its CPU time")
    parser.add_argument("--fastest", action="store_true", help="the fastest path, not batch-invariant: every "
                        "projection and the head in one unpadded oneDNN call (attention and LoRA as probed), what "
                        "the probed rule's cost is measured against in the same tree")
    args = parser.parse_args()
    if args.cpu_time:
        args.threads = 1
    timer = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        settings = {"cpu_attention": args.cpu_attention} if args.cpu_attention else {}
        engine, slots = build_demo_engine(32, Path(tmp), args.dtype, **settings)
        if args.fastest:  # oneDNN's weights laid out for its cpu_linear tile of rows, every call unpadded
            model = engine.model
            dtypes = {"projection": model.precision.matmul_dtype, "head": model.head_weight.dtype}
            fastest = {path: Tiling(cpu_linear.ROW_TILES[dtype], whole=True, ragged=True)
                       for path, dtype in dtypes.items()}
            model.use_row_rule(replace(model.row_rule, **fastest))
        kinds = {f"decode {n}": decode_batch(engine, slots, n, CONTEXT) for n in (1, 8, 32)}
        first_free = 32 * -(-(CONTEXT + 1) // engine.limits.block_size)
        kinds[f"prefill {PREFILL}"] = prefill_batch(engine, slots[1], first_free)
        times = {}
        for kind, batch in kinds.items():
            for _ in range(2):
                replay(engine, batch)
            runs = []
            for _ in range(args.steps):
                started = timer()
                replay(engine, batch)
                runs.append(timer() - started)
            times[kind] = runs
        precision = getattr(engine.model, "precision", None)
    clock = "CPU time" if args.cpu_time else "wall time"
    print(f"{time.strftime('%Y-%m-%d')}, {cpu_model()} ({cpu_flags()}), {args.threads} threads ({clock}), torch "
          f"{torch.__version__}, load average {load_average()}; demo model, --dtype {args.dtype}"
          f"{f' ({precision.value})' if precision is not None else ''}, {args.steps} runs per step; row rule: "
          f"{getattr(engine.model.row_rule, 'describe', lambda: 'none (a tree before the probe)')()}\n")
    for kind, runs in times.items():
        print(f"| {args.label} | {args.dtype} | {kind} | {statistics.median(runs) * 1e3:.1f} | {min(runs) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
