"""float32 against bfloat16 decode matmuls on this CPU, on the demo model: speed and accuracy, in one run.

What ``--dtype auto`` decides at a CPU pod's start-up (float32 or bfloat16-matmul), shown in full: the
start-up measurement's totals (``cpu_linear.choose_precision``), then whole decode steps of ``--seqs`` sequences (the
serving mix of benchmarks/serve.py: base model, the demo adapters and a random rank-16 adapter)
with the reordered weights in each precision, interleaved step by step in one process, and the
deviation of the bfloat16 steps' logits from the float32 ones (largest |Δlogit| against the
largest |logit|, greedy tokens that agree, largest change in the float32 token's log-probability).
Prints markdown for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from processes import cpu_flags, cpu_model, load_average  # benchmarks/processes.py
from serve import EXTRA_ADAPTER  # benchmarks/serve.py
from synthetic import write_random_adapter  # benchmarks/synthetic.py

from data_plane.config import DataPlaneConfig
from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir
from data_plane.engine.engine import Engine
from data_plane.engine.scheduler import ScheduledSeq
from data_plane.engine.sequence import SamplingParams, Sequence
from data_plane.metrics import PodMetrics
from data_plane.model import cpu_linear
from data_plane.model.demo_model import ensure_demo_model
from data_plane.model.llama import Projection
from data_plane.model.precision import Precision
from data_plane.pod import DECODE_ROWS_MEASURED, build_engine

PRECISIONS = (Precision.FLOAT32, Precision.BFLOAT16_MATMUL)


def decode_batch(engine, slots: list[int], seqs: int, context: int) -> list[ScheduledSeq]:
    """``seqs`` sequences one decode token past ``context`` cached ones, adapters round-robin over ``slots``.
    Sequence ``i`` of every such batch has block-table row ``i`` and the same blocks: the batches are
    replayed (``replay``), never scheduled."""
    blocks = -(-(context + 1) // engine.limits.block_size)
    batch = []
    for i in range(seqs):
        table = list(range(i * blocks, (i + 1) * blocks))
        seq = Sequence(f"s{i}", None, [5] * context, SamplingParams(), context + 2, block_table=table, kv_row=i,
                       slot=slots[i % len(slots)])
        seq.num_computed = context - 1
        batch.append(ScheduledSeq(seq, 1))
    return batch


def replay(engine, batch: list[ScheduledSeq]):
    """Runs a hand-built step: its sequences' block tables are written into their rows of the pod's table
    first (past the block manager; a CPU pod's device reads that table itself)."""
    for item in batch:
        table = item.seq.block_table
        engine.blocks.table[item.seq.kv_row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return engine.runner.run(batch)


def demo_pod_config(seqs: int, adapter_dir: Path, dtype: str, compute_threads: int | None = None,
                    **settings) -> DataPlaneConfig:
    """A pod on the demo model for steps of up to ``seqs`` sequences, with room for the demo adapters and
    serve.py's random rank-16 one (written into ``adapter_dir``), all found under its adapter roots; its
    model thread computes on ``compute_threads`` (None: as many as the calling thread); ``settings``: other
    DataPlaneConfig fields."""
    model_dir = ensure_demo_model(quiet=True)
    write_random_adapter(adapter_dir / EXTRA_ADAPTER, json.loads((model_dir / "config.json").read_text()), 16,
                         dtype=torch.float32)
    roots = (demo_adapter_dir(DEMO_ADAPTERS[0]).parent, adapter_dir)
    return DataPlaneConfig(model=model_dir, max_num_seqs=seqs, max_loras=len(DEMO_ADAPTERS) + 1,
                           max_cpu_loras=32, adapter_roots=roots, dtype=dtype,
                           compute_threads=compute_threads or torch.get_num_threads(), **settings)


def build_demo_engine(seqs: int, adapter_dir: Path, dtype: str = "float32", compute_threads: int | None = None,
                      **settings) -> tuple[Engine, list[int]]:
    """The pod's engine of ``demo_pod_config``, every adapter of the mix resident; returns it with the
    slots of the mix: -1 (base) then each adapter's."""
    config = demo_pod_config(seqs, adapter_dir, dtype, compute_threads, **settings)
    engine = build_engine(config, PodMetrics())
    slots = [-1]
    for name in (*DEMO_ADAPTERS, EXTRA_ADAPTER):
        root = next(r for r in config.adapter_roots if (r / name).is_dir())
        engine.lora.load(name, str(root / name))
        slots.append(engine.lora.cache.acquire(name))
    return engine, slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per precision and mix")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        engine, slots = build_demo_engine(args.seqs, Path(tmp))
        model = engine.model
        n = min(args.seqs, DECODE_ROWS_MEASURED)
        choice = cpu_linear.choose_precision(model.matmul_weights(), sorted({1, min(8, n), n}))

        projections = [m for m in model.modules() if isinstance(m, Projection)]
        # the projections in each precision; the output head stays float32, as in the pod
        packs = {p: [cpu_linear.pack(m.weight, p.matmul_dtype) for m in projections] for p in PRECISIONS}

        def use(precision: Precision) -> None:
            for module, packed in zip(projections, packs[precision], strict=True):
                module.packed = packed

        mixes = {"base + 4 adapters": decode_batch(engine, slots, args.seqs, args.context),
                 "base only": decode_batch(engine, [-1], args.seqs, args.context)}
        times: dict[tuple[Precision, str], list[float]] = {}
        for precision in PRECISIONS:  # warm both
            use(precision)
            for batch in mixes.values():
                replay(engine, batch)
        for _ in range(args.steps):
            for precision in PRECISIONS:
                use(precision)
                for mix, batch in mixes.items():
                    started = time.perf_counter()
                    replay(engine, batch)
                    times.setdefault((precision, mix), []).append(time.perf_counter() - started)

        logits = {}
        with torch.inference_mode():
            for precision in PRECISIONS:
                use(precision)
                replay(engine, mixes["base + 4 adapters"])  # writes the mix's table rows
                step = engine.runner.prepare(mixes["base + 4 adapters"])
                hidden = engine.runner.step_runner.forward(step.inputs)
                logits[precision] = model.logits(hidden.index_select(0, step.inputs.sample_rows))
    f32, bf16 = logits[Precision.FLOAT32], logits[Precision.BFLOAT16_MATMUL]
    top = f32.argmax(-1, keepdim=True)
    logprob_change = (f32.log_softmax(-1).gather(1, top) - bf16.log_softmax(-1).gather(1, top)).abs().max()

    print(f"{time.strftime('%Y-%m-%d')}, {cpu_model()} ({cpu_flags()}), {args.threads} threads, torch "
          f"{torch.__version__}, load average {load_average()}; demo model, {args.seqs} decode sequences at "
          f"context {args.context}, median of {args.steps} interleaved steps\n")
    secs = choice.seconds
    print(f"start-up measurement: float32 {secs.get(Precision.FLOAT32, 0) * 1e3:.2f} ms, bfloat16 "
          f"{secs.get(Precision.BFLOAT16_MATMUL, 0) * 1e3:.2f} ms -> {choice.precision.value} ({choice.reason})\n")
    print("| mix | float32 step ms | bfloat16 step ms | bfloat16 / float32 |")
    print("|---|---|---|---|")
    for mix in mixes:
        a, b = (statistics.median(times[(p, mix)]) * 1e3 for p in PRECISIONS)
        print(f"| {mix} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    print(f"\nbfloat16 logits against float32 on the mixed step ({f32.shape[0]} rows): largest |Δlogit| "
          f"{(f32 - bf16).abs().max():.3f} with largest |logit| {f32.abs().max():.1f}; greedy tokens agree on "
          f"{int((f32.argmax(-1) == bf16.argmax(-1)).sum())} of {f32.shape[0]} rows; the float32 token's "
          f"log-probability moves by at most {logprob_change:.3f}")


if __name__ == "__main__":
    main()
