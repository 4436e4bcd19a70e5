"""Where a CPU pod's slow steps come from: the serving mix of benchmarks/serve.py run through the
pod's engine in this process, every step timed and attributed.

Inter-token latency at p99 is set by a few slow steps: with 32 streams a step's delay reaches 32
gaps at once, so the 1% slowest gaps of a 4096-token run are about its slowest step or two. For
each step this records its forward pass's wall time, its shape (tokens, sequences, prefill tokens,
adapter segments) and the garbage collector's pauses inside it; then prints the step-time and ITL percentiles and the
slowest steps with what they held, per round of (LoRA, base only). The engine is the pod's
(``data_plane.pod.build_engine``); there is no gRPC, so the figures are the engine's alone.

    python benchmarks/step_trace.py [--rounds 2] [--dtype auto|float32|bfloat16|bfloat16-matmul]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from cpu_matmul import demo_pod_config  # benchmarks/cpu_matmul.py
from processes import cpu_flags, cpu_model, load_average  # benchmarks/processes.py
from serve import EXTRA_ADAPTER  # benchmarks/serve.py
from stream_load import PROMPTS, percentile_ms  # benchmarks/stream_load.py

from data_plane.demo_adapters import DEMO_ADAPTERS
from data_plane.engine.sequence import SamplingParams
from data_plane.local import prompt_ids
from data_plane.metrics import PodMetrics
from data_plane.model.precision import DTYPE_CHOICES
from data_plane.pod import build_engine


@dataclass
class Step:
    seconds: float
    tokens: int
    seqs: int
    prefill_tokens: int
    segments: int
    gc_ms: float


@dataclass
class Trace:
    steps: list[Step] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    gc_ms: float = 0.0

    def gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_ms += (time.perf_counter() - self._gc_started) * 1e3


def traced(execute, trace: Trace):
    """``execute`` timed and attributed into ``trace``."""

    def run(step):
        gc_ms = trace.gc_ms
        started = time.perf_counter()
        out = execute(step)
        tokens, seqs = step.inputs.input_ids.numel(), len(step.order)
        trace.steps.append(Step(time.perf_counter() - started, tokens, seqs,
                                tokens - sum(o is not None for o in out), adapters(step.inputs.lora),
                                trace.gc_ms - gc_ms))
        return out

    return run


def adapters(meta) -> int:
    """The adapters a step ran: a step without adapter tokens has no LoRA metadata."""
    return len(meta.host_segments) if meta is not None else 0


async def serve_once(engine, requests: list[tuple[list[int], str | None]], new_tokens: int, trace: Trace) -> float:
    async def one(ids, adapter):
        last = None
        async for _ in engine.generate(ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True), adapter):
            now = time.perf_counter()
            if last is not None:
                trace.itl.append(now - last)
            last = now

    started = time.perf_counter()
    await asyncio.gather(*(one(ids, adapter) for ids, adapter in requests))
    return time.perf_counter() - started


def report(label: str, trace: Trace, wall_s: float, tokens: int, slowest: int) -> None:
    times = [s.seconds for s in trace.steps]
    print(f"\n{label}: {tokens / wall_s:.1f} tok/s, {len(times)} steps; step p50 {percentile_ms(times, 0.5)} ms, "
          f"p99 {percentile_ms(times, 0.99)} ms, max {max(times) * 1e3:.0f} ms; ITL p50 "
          f"{percentile_ms(trace.itl, 0.5)} ms, p99 {percentile_ms(trace.itl, 0.99)} ms; garbage collection "
          f"{trace.gc_ms:.0f} ms in all")
    print("| step ms | tokens | sequences | prefill tokens | adapter segments | gc ms |")
    print("|---|---|---|---|---|---|")
    for s in sorted(trace.steps, key=lambda s: -s.seconds)[:slowest]:
        print(f"| {s.seconds * 1e3:.0f} | {s.tokens} | {s.seqs} | {s.prefill_tokens} | {s.segments} "
              f"| {s.gc_ms:.0f} |")


# The serve.py mix on the demo model: the base model, the three demo adapters and a random rank-16 one.
CYCLE = [None, *DEMO_ADAPTERS, EXTRA_ADAPTER]


async def demo_engine(workdir: str, requests: int, dtype: str, freeze_gc: bool = True):
    """The pod's engine on the demo model with serve.py's adapters resident (the random one written to
    ``workdir``), started; and the token ids of ``requests`` prompts."""
    pod = demo_pod_config(requests, Path(workdir), dtype)
    engine = await asyncio.to_thread(build_engine, pod, PodMetrics())
    if freeze_gc:
        gc.freeze()  # as the pod process does once started
    engine.start()
    try:
        ids = [prompt_ids(engine, PROMPTS[i % len(PROMPTS)]) for i in range(requests)]
        await serve_once(engine, [(ids[0], a) for a in CYCLE], 4, Trace())  # loads every adapter, as serve.py
    except BaseException:
        await engine.stop()
        raise
    return engine, ids


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        engine, ids = await demo_engine(tmp, args.requests, args.dtype, args.freeze_gc)
        execute = engine.runner.execute
        try:
            for r in range(1, args.rounds + 1):
                for label, adapters in (("LoRA", CYCLE), ("base only", [None])):
                    trace = Trace()
                    engine.runner.execute = traced(execute, trace)
                    gc.callbacks.append(trace.gc_callback)
                    requests = [(ids[i], adapters[i % len(adapters)]) for i in range(args.requests)]
                    wall = await serve_once(engine, requests, args.new_tokens, trace)
                    gc.callbacks.remove(trace.gc_callback)
                    report(f"round {r}, {label}", trace, wall, args.requests * args.new_tokens, args.slowest)
        finally:
            engine.runner.execute = execute
            await engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slowest", type=int, default=5, help="slowest steps listed per run")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="the pod's precision")
    parser.add_argument("--no-freeze-gc", dest="freeze_gc", action="store_false",
                        help="leave start-up objects to the collector (the pod freezes them)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d')}, {cpu_model()} ({cpu_flags()}), {args.threads} threads, torch "
          f"{torch.__version__}, load average {load_average()}; demo model, {args.requests} requests x "
          f"{args.new_tokens} tokens, --dtype {args.dtype}, gc frozen: {args.freeze_gc}")
    asyncio.run(main_async(args))
    print(f"\nload average at the end {load_average()}")


if __name__ == "__main__":
    main()
