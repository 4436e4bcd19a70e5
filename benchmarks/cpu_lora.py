"""A CPU pod's step per mix on the demo model, and what its LoRA path adds: the native kernel
(kernels/native_lora.py) and the torch path (kernels/cpu_lora.py) at each row tile.

Whole steps of the pod's engine, run on its model thread as a pod runs them (``--dtype auto``: the
projections' precision chosen by measurement; every other thread on one torch thread), for a few
mixes (decodes at a context of 150 tokens, a prompt's first chunk), each also on the base model alone
(the same rows, no adapter), with the LoRA path set to each of ``--tiles`` in turn (``native``, or a
row tile of the torch path), interleaved step by step in one process. A mix's LoRA cost is its step minus the
base-only step of the same shape. With ``--before-tree`` (a checkout of an earlier version, e.g. made
with ``git worktree add``) the same measurement also runs on that version's pod code, in processes
alternated with this checkout's (``--rounds`` of each); the table gives medians over the rounds.
Adapters: the demo adapters and serve.py's random rank-16 one. Prints markdown for RESULTS.md.

    cd benchmarks && PYTHONPATH=..:../protos python cpu_lora.py [--tiles native 8] [--dtype float32]
        [--before-tree DIR] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from compute_threads import CONTEXT, batch  # benchmarks/compute_threads.py
from cpu_matmul import build_demo_engine, replay  # benchmarks/cpu_matmul.py
from processes import cpu_flags, cpu_model, load_average  # benchmarks/processes.py

from data_plane.engine.threads import available_cpus, compute_on_one_thread
from kernels import cpu_lora

REPO = Path(__file__).resolve().parent.parent


def mixes(adapters: int) -> dict[str, list[tuple[int | None, int, int]]]:
    """Each mix's (adapter index or None, new tokens, cached tokens) per sequence, as ``compute_threads.batch``
    takes them; ``adapters``: how many adapters the mix may use."""
    decode = (1, CONTEXT)
    spread = [(i % adapters, *decode) for i in range(32)]
    return {
        "8 decodes, 1 of an adapter": [(None, *decode)] * 7 + [(0, *decode)],
        f"8 decodes over {adapters} adapters": spread[:8],
        f"32 decodes over {adapters} adapters": sorted(spread, key=lambda r: r[0]),
        "8 base decodes + an adapter's 24-token prompt": [(None, *decode)] * 8 + [(0, 24, 0)],
        "an adapter's 128-token prompt": [(0, 128, 0)],
    }


def timed(engine, steps, clock=time.perf_counter) -> float:
    """Seconds of one replay of ``steps`` by ``clock``, on the calling thread (the model thread)."""
    started = clock()
    replay(engine, steps)
    return clock() - started


NATIVE = "native"  # a --tiles entry: the native kernel instead of the torch path's tiles


def tile_arg(value: str) -> int | str:
    return value if value == NATIVE else int(value)


def measure(tiles: list[int | str], steps: int, dtype: str, cpu_time: bool = False) -> dict:
    """Median ms per mix: its base-only step, and its step with each LoRA path and the shipped one, with
    this process's pod code; ``cpu_time``: on one compute thread, in its CPU time."""
    compute_on_one_thread(asyncio.new_event_loop())  # as a pod starts: the model thread's team is the only one
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        engine, slots = build_demo_engine(32, Path(tmp), dtype, 1 if cpu_time else available_cpus())
        clock = time.thread_time if cpu_time else time.perf_counter
        rule = getattr(engine.model, "row_rule", None)  # the path the pod probed (trees before it: the module's)
        shipped = rule.lora_rows if rule is not None else cpu_lora.ROW_TILE
        if getattr(rule, "lora_native", False):
            shipped = NATIVE
        tiles = list(dict.fromkeys([*tiles, shipped]))
        runs = {}
        for name, mix in mixes(len(slots) - 1).items():
            runs[f"{name}|base"] = (shipped, batch(engine, slots[1:], [(None, *m[1:]) for m in mix]))
            for tile in tiles:
                runs[f"{name}|{tile}"] = (tile, batch(engine, slots[1:], mix))
        try:
            for measured in (False, True):  # a warm-up round, then the measured ones
                for _ in range(steps if measured else 1):
                    for key, (tile, steps_of) in runs.items():
                        use_tile(engine, tile)
                        seconds = engine.on_model_thread(timed, engine, steps_of, clock)
                        if measured:
                            times.setdefault(key, []).append(seconds)
        finally:
            use_tile(engine, shipped)
        precision = engine.model.precision.value
        names = list(mixes(len(slots) - 1))
    return {"shipped": shipped, "precision": precision, "mixes": names,
            "ms": {key: statistics.median(t) * 1e3 for key, t in times.items()}}


def use_tile(engine, tile: int | str) -> None:
    """Every layer's LoRA path set to the native kernel or the torch path's row tile ``tile`` (in trees before
    the probed tile, the module's)."""
    if tile == NATIVE:
        for layer in engine.lora.layers.values():
            layer.backend.use_row_tile(cpu_lora.ROW_TILE, native=True)
        return
    cpu_lora.ROW_TILE = tile
    for layer in engine.lora.layers.values():
        if hasattr(layer.backend, "use_row_tile"):  # a tree older than the probed tile has no such method
            layer.backend.use_row_tile(tile)


def run_in(tree: Path, tiles: list[int | str], steps: int, dtype: str, cpu_time: bool) -> dict:
    """``measure`` in a fresh process on the pod code of ``tree`` (this script's helpers, that tree's modules)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "protos")])}
    out = subprocess.run([sys.executable, __file__, "--measure", "--steps", str(steps), "--dtype", dtype,
                          *(["--cpu-time"] if cpu_time else []), "--tiles", *map(str, tiles)],
                         capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="measured steps per mix, tile and process")
    parser.add_argument("--tiles", type=tile_arg, nargs="*", default=[NATIVE, 8, 16],
                        help="LoRA paths to compare: native, or a row tile of the torch path")
    parser.add_argument("--dtype", default="auto", help="the pod's precision (--dtype)")
    parser.add_argument("--cpu-time", action="store_true", help="one compute thread, timed in its CPU time (which "
                        "other jobs on a shared machine barely change)")
    parser.add_argument("--rounds", type=int, default=2, help="processes per version, alternated")
    parser.add_argument("--before-tree", type=Path, help="a checkout of the earlier version to compare with")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one process's measurement
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.tiles, args.steps, args.dtype, args.cpu_time)))
        return
    trees = {"after": REPO, **({"before": args.before_tree.resolve()} if args.before_tree else {})}
    runs: dict[str, list[dict]] = {version: [] for version in trees}
    for _ in range(args.rounds):
        for version, tree in trees.items():
            runs[version].append(run_in(tree, args.tiles if version == "after" else [], args.steps, args.dtype,
                                        args.cpu_time))

    def ms(version: str, key: str) -> float:
        return statistics.median(run["ms"][key] for run in runs[version])

    after = runs["after"][0]
    threads = "1 compute thread (its CPU time)" if args.cpu_time else f"{available_cpus()} compute threads"
    print(f"{time.strftime('%Y-%m-%d')}, {cpu_model()} ({cpu_flags()}), {threads}, "
          f"torch {torch.__version__}, load average {load_average()}; demo model, --dtype {args.dtype} "
          f"({after['precision']}), context {CONTEXT}; {args.rounds} processes per version, median of "
          f"{args.steps} interleaved steps each; shipped LoRA path {after['shipped']}"
          + (f", before: {runs['before'][0]['shipped']}" if "before" in runs else "") + "\n")
    compare = "before" in runs
    head = ["mix", "base-only step ms", "step ms"]
    if compare:
        head += ["base-only before", "step before", "step after / before"]
    head += [f"LoRA ms {'native' if t == NATIVE else f'at tile {t}'} (of base)" for t in args.tiles]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name in after["mixes"]:
        base, step = ms("after", f"{name}|base"), ms("after", f"{name}|{after['shipped']}")
        cells = [name, f"{base:.1f}", f"{step:.1f}"]
        if compare:
            shipped = runs["before"][0]["shipped"]
            before = ms("before", f"{name}|{shipped}")
            cells += [f"{ms('before', f'{name}|base'):.1f}", f"{before:.1f}", f"{step / before:.2f}"]
        for tile in args.tiles:
            lora = ms("after", f"{name}|{tile}") - base
            cells.append(f"{lora:.1f} ({lora / base:.0%})")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
