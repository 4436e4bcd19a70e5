"""What each CPU LoRA path costs inside a real decode step, A/B in one process.

The serve.py mix runs through the pod's engine (benchmarks/step_trace.py's ``demo_engine``) until a
step decodes all ``--requests`` sequences, with adapters, and one decodes them with the base model
only; both steps are kept and replayed (replaying rewrites the same KV-cache entries). Then, in
interleaved rounds, the LoRA step is replayed with the CPU path tuner restricted to one path at a time
(it still measures that path on torch's threads and on one) and unrestricted (``measured``), and the
base-only step beside them. Printed per variant: the step's wall time (median of the round's replays,
then the median over rounds) and the time spent in the LoRA layers' ``apply``, with the paths the
tuner chose.

    python benchmarks/cpu_lora_step.py [--rounds 4] [--replays 10] [--cpu-matmul auto|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
import time
from collections import Counter

import torch
from processes import cpu_flags, cpu_model, load_average  # benchmarks/processes.py
from step_trace import CYCLE, demo_engine  # benchmarks/step_trace.py

from data_plane.config import CPU_MATMUL_CHOICES
from data_plane.engine.sequence import SamplingParams
from kernels import cpu_tuner, lora_backend


def kept(step):
    """``step`` with its own copy of its inputs, which otherwise live in buffers every later step overwrites."""
    return dataclasses.replace(step, inputs=step.inputs.clone())


async def capture_steps(engine, ids: list[list[int]]) -> dict[str, object]:
    """One prepared step that decodes every sequence, with the mix's adapters and with none."""
    execute, steps = engine.runner.execute, {}

    def keep(label: str):
        def run(step):
            if len(step.order) == len(ids) and step.inputs.input_ids.numel() == len(ids) and label not in steps:
                steps[label] = kept(step)
            return execute(step)
        return run

    async def serve(label: str, adapters: list[str | None]) -> None:
        engine.runner.execute = keep(label)

        async def one(i: int) -> None:
            async for _ in engine.generate(ids[i], SamplingParams(max_tokens=8, ignore_eos=True),
                                           adapters[i % len(adapters)]):
                pass

        await asyncio.gather(*(one(i) for i in range(len(ids))))

    try:
        await serve("LoRA", CYCLE)
        await serve("base only", [None])
    finally:
        engine.runner.execute = execute
    return steps


class ApplyClock:
    """Wall time spent in CpuBackend.apply while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._real = lora_backend.CpuBackend.apply

    def __enter__(self) -> ApplyClock:
        real = self._real

        def timed(backend, y, x, meta):
            started = time.perf_counter()
            real(backend, y, x, meta)
            self.seconds += time.perf_counter() - started

        lora_backend.CpuBackend.apply = timed
        return self

    def __exit__(self, *exc) -> None:
        lora_backend.CpuBackend.apply = self._real


ALL_CANDIDATES = cpu_tuner.candidates


def restrict(path: cpu_tuner.CpuLoraPath | None, step) -> None:
    """A fresh tuner measuring only ``path`` (every candidate for None), and the step's own cached choices dropped."""
    cpu_tuner.PATH_TUNER = cpu_tuner.PathTuner()
    candidates = ALL_CANDIDATES if path is None else (
        lambda *a: [c for c in ALL_CANDIDATES(*a) if c.path is path])
    cpu_tuner.candidates = candidates
    step.inputs.lora.step_cache.paths.clear()


def median_ms(execute, step, replays: int) -> float:
    """The median wall time of ``replays`` replays of ``step``, in milliseconds."""
    times = []
    for _ in range(replays):
        started = time.perf_counter()
        execute(step)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def replay_rounds(args, execute, lora_step, base_step, variants, step_ms, apply_ms, chosen) -> None:
    """Interleaved rounds: the LoRA step under each variant, then the base-only step; figures into the dicts."""
    for _ in range(args.rounds):
        for path in variants:
            label = path.value if path else "measured"
            restrict(path, lora_step)
            for _ in range(3):  # measures the paths, builds packs: not timed
                execute(lora_step)
            with ApplyClock() as clock:
                step_ms.setdefault(label, []).append(median_ms(execute, lora_step, args.replays))
            apply_ms.setdefault(label, []).append(clock.seconds / args.replays * 1e3)
            chosen.setdefault(label, Counter()).update(lora_step.inputs.lora.step_cache.paths.values())
            step_ms.setdefault("base only", []).append(median_ms(execute, base_step, args.replays))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--replays", type=int, default=10, help="timed replays of each step per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-matmul", default="auto", choices=CPU_MATMUL_CHOICES)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu_model()} ({cpu_flags()}), {args.threads} "
          f"threads, torch {torch.__version__}, load average {load_average()}; demo model, serve.py's mix, a "
          f"{args.requests}-sequence decode step, --cpu-matmul {args.cpu_matmul}")

    async def setup():
        engine, ids = await demo_engine(tmp, args.requests, args.cpu_matmul)
        try:
            return engine, await capture_steps(engine, ids)
        finally:
            await engine.stop()

    with tempfile.TemporaryDirectory() as tmp:
        engine, steps = asyncio.run(setup())
    lora_step, base_step = steps["LoRA"], steps["base only"]
    execute = engine.runner.execute
    meta = lora_step.inputs.lora
    buckets = cpu_tuner.bucket(meta.num_tokens), cpu_tuner.bucket(len(meta.host_segments))
    offered = {c.path for c in ALL_CANDIDATES(*buckets, args.threads)}
    variants = [*(p for p in cpu_tuner.CpuLoraPath if p in offered), None]  # the paths the tuner weighs for this step
    step_ms: dict[str, list[float]] = {}
    apply_ms: dict[str, list[float]] = {}
    chosen: dict[str, Counter] = {}
    try:
        replay_rounds(args, execute, lora_step, base_step, variants, step_ms, apply_ms, chosen)
    finally:
        cpu_tuner.candidates = ALL_CANDIDATES
    base = statistics.median(step_ms["base only"])
    print("\n| LoRA path | step ms (median of rounds) | LoRA apply ms | base-only step / this step | runs chosen "
          "per layer shape, all rounds |\n|---|---|---|---|---|")
    for label in [p.value if p else "measured" for p in variants]:
        runs = ", ".join(f"{run.label} x{n}" for run, n in chosen[label].most_common())
        print(f"| {label} | {statistics.median(step_ms[label]):.1f} | {statistics.median(apply_ms[label]):.1f} | "
              f"{base / statistics.median(step_ms[label]):.2f} | {runs} |")
    print(f"| (base only) | {base:.1f} | - | 1.00 | - |")
    print(f"\nload average at the end {load_average()}")


if __name__ == "__main__":
    main()
