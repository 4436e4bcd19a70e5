"""Host time of a decode step, everything but the forward: scheduling, building the step's inputs
(metadata, one upload) and the copy of the chosen tokens back, on CPU; and apart from it, sampling.

A tiny model (1 layer, hidden 64) with the demo model's vocabulary (49,152) keeps the forward cheap;
its time (the model's forward and the output projection) is measured and taken out of each step, and
so is the time inside ``sample`` (the sampler's compute, which a GPU pod runs on the device), which is
reported on its own.
Sequences sit at a context of 512 tokens; half of them sample at temperature 0.8 with top-p 0.9 and a
seed, half greedily. One torch thread.

    python benchmarks/step_host.py [--batches 1 64 256] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from processes import cpu_model, load_average  # benchmarks/processes.py

from data_plane.engine import model_runner
from data_plane.engine.block_manager import BlockManager
from data_plane.engine.model_runner import ModelRunner
from data_plane.engine.scheduler import Scheduler, SchedulerLimits
from data_plane.engine.sequence import SamplingParams, Sequence, SequenceStatus
from data_plane.lora.runtime import LoraRuntime
from data_plane.model.config import ModelConfig
from data_plane.model.llama import LlamaForCausalLM

CONTEXT, BLOCK = 512, 16
RAW = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=64, intermediate_size=128,
           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def tiny_model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig.from_dict(RAW))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.use_device("cpu")
    return model.eval()


def host_ms(model: LlamaForCausalLM, batch_size: int, steps: int) -> tuple[list[float], list[float]]:
    """Per step, in milliseconds (the first five steps left out): the wall time of schedule -> run ->
    postprocess minus the time inside the model's forward, output projection and sampler; and the
    sampler's time."""
    lora = LoraRuntime(model, 4, 8, 8, 4096, ())
    per_seq = -(-(CONTEXT + steps + 5) // BLOCK)
    blocks = BlockManager(batch_size * per_seq, BLOCK, batch_size, per_seq)
    runner = ModelRunner(model, lora, model.new_kv_cache(blocks.num_blocks, BLOCK), blocks, batch_size, 4096)
    scheduler = Scheduler(SchedulerLimits(batch_size, 4096), blocks, lora.cache, lambda name: True)
    for i in range(batch_size):
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=i)
        seq = Sequence(f"r{i}", None, [1] * CONTEXT, params, 100_000)
        blocks.allocate(seq, CONTEXT)
        seq.num_computed, seq.status = CONTEXT - 1, SequenceStatus.RUNNING
        scheduler.running.append(seq)
    inside = {"model": 0.0, "sample": 0.0}
    forward, logits, sample = model.forward, model.logits, model_runner.sample

    def timed(fn, key: str):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[key] += time.perf_counter() - started
        return run

    model.forward, model.logits = timed(forward, "model"), timed(logits, "model")
    model_runner.sample = timed(sample, "sample")
    host, sampling = [], []
    try:
        for step in range(steps + 5):
            inside["model"] = inside["sample"] = 0.0
            started = time.perf_counter()
            batch = scheduler.schedule()
            scheduler.postprocess(batch, [tok.id for tok in runner.run(batch)])
            if step >= 5:
                host.append((time.perf_counter() - started - inside["model"] - inside["sample"]) * 1e3)
                sampling.append(inside["sample"] * 1e3)
    finally:
        del model.forward, model.logits
        model_runner.sample = sample
    return host, sampling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = tiny_model()
    print(f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, torch {torch.__version__}, load average {load_average()}; "
          f"context {CONTEXT}, {args.steps} steps each\n")
    print("| batch | host ms p50 | host ms p90 | sampling ms p50 |")
    print("|---|---|---|---|")
    for batch_size in args.batches:
        host, sampling = host_ms(model, batch_size, args.steps)
        host.sort()
        print(f"| {batch_size} | {statistics.median(host):.2f} | {host[int(0.9 * len(host))]:.2f} | "
              f"{statistics.median(sampling):.2f} |")


if __name__ == "__main__":
    main()
