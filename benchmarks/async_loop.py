"""The asynchronous step loop against the synchronous one (``--async-scheduling`` / ``--no-async-scheduling``),
in one process: two engines built alike but for that option serve the same closed batch (every request sent at
once, each generating exactly ``--new-tokens`` tokens, greedy), in interleaved rounds so that drifting load on
a shared machine hits both alike. Reported per batch size: output tokens per second, the median step (the
time from one step's tokens to the next's) and the process's CPU time per output token, each loop's median over
the rounds, and the ratio of tokens per second async / sync per round with its median.

Models: ``demo`` (the demo model, float32) and ``tiny`` (random weights of ``synthetic.TINY``'s shape with the
demo vocabulary: a cheap forward, where the host's share of a step is largest).

    python benchmarks/async_loop.py [--model demo tiny] [--batches 1 16] [--new-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch
from processes import cpu_model, load_average  # benchmarks/processes.py
from synthetic import TINY, write_random_model  # benchmarks/synthetic.py

from data_plane.config import DataPlaneConfig
from data_plane.engine.engine import Engine
from data_plane.engine.sequence import SamplingParams
from data_plane.metrics import PodMetrics
from data_plane.model.demo_model import ensure_demo_model
from data_plane.pod import build_engine

PROMPT_TOKENS = 64


async def serve_once(engine: Engine, batch: int, new_tokens: int) -> tuple[float, float, float]:
    """(output tokens per second, median seconds between two steps' tokens, the process's CPU seconds per
    output token: every thread's, which other processes on a shared machine do not add to) of ``batch``
    requests at once."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    arrivals: list[float] = []

    async def one(i: int) -> int:
        ids = [(7 + 13 * i + 31 * j) % 40000 + 100 for j in range(PROMPT_TOKENS)]
        count = 0
        async for out in engine.generate(ids, params):
            count += len(out.tokens)
            if i == 0:
                arrivals.append(time.perf_counter())
        return count

    started, started_cpu = time.perf_counter(), time.process_time()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(batch))))
    wall, cpu = time.perf_counter() - started, time.process_time() - started_cpu
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return tokens / wall, statistics.median(gaps), cpu / tokens


async def compare(model_dir: Path, batches: list[int], new_tokens: int, rounds: int) -> list[tuple]:
    engines = {}
    for overlapped in (False, True):
        config = DataPlaneConfig(model=model_dir, dtype="float32", max_num_seqs=max(batches), max_loras=1,
                                 max_cpu_loras=1, max_queue_delay=0, prefix_caching=False,
                                 async_scheduling=overlapped)
        engines[overlapped] = build_engine(config, PodMetrics())
        engines[overlapped].start()
    rows = []
    try:
        for batch in batches:
            found: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
            await serve_once(engines[False], batch, 4)  # warm
            await serve_once(engines[True], batch, 4)
            for r in range(rounds):
                for overlapped in ((False, True) if r % 2 == 0 else (True, False)):
                    found[overlapped].append(await serve_once(engines[overlapped], batch, new_tokens))
            rows.append((batch, found))
    finally:
        for engine in engines.values():
            await engine.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=["demo", "tiny"], choices=["demo", "tiny"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, torch {torch.__version__}, load average {load_average()}; "
          f"prompts of {PROMPT_TOKENS} tokens, {args.new_tokens} new tokens each, {args.rounds} interleaved rounds\n")
    print("| model | batch | sync tok/s | async tok/s | async / sync per round | median | sync step ms "
          "| async step ms | sync CPU ms/token | async CPU ms/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.model:
            model_dir = ensure_demo_model(quiet=True) if name == "demo" else \
                write_random_model(Path(tmp) / "tiny", TINY, torch.float32)
            for batch, found in asyncio.run(compare(model_dir, args.batches, args.new_tokens, args.rounds)):
                sync, over = found[False], found[True]
                ratios = [o[0] / s[0] for s, o in zip(sync, over, strict=True)]
                print(f"| {name} | {batch} | {statistics.median(t for t, _, _ in sync):.1f} | "
                      f"{statistics.median(t for t, _, _ in over):.1f} | {', '.join(f'{r:.2f}' for r in ratios)} | "
                      f"{statistics.median(ratios):.2f} | "
                      f"{statistics.median(g for _, g, _ in sync) * 1e3:.2f} | "
                      f"{statistics.median(g for _, g, _ in over) * 1e3:.2f} | "
                      f"{statistics.median(c for _, _, c in sync) * 1e3:.2f} | "
                      f"{statistics.median(c for _, _, c in over) * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
