"""Host time of a decode step, everything but the forward: scheduling, building the step's inputs
(metadata, one upload) and the copy of the chosen tokens back, on CPU; and apart from it, sampling.

A tiny model (1 layer, hidden 64) with the demo model's vocabulary (49,152) keeps the forward cheap;
its time (the model's forward and the output projection) is measured and taken out of each step, and
so is the time inside ``sample`` (the sampler's compute, which a GPU pod runs on the device), which is
reported on its own. Host time is given in wall time and in this thread's CPU time: on a machine shared
with other jobs the second leaves out the time the thread waited for a core.
Sequences sit at a context of 512 tokens; half of them sample at temperature 0.8 with top-p 0.9 and a
seed, half greedily. One torch thread. With ``--pending`` each step's tokens are recorded as the
asynchronous loop records them (PENDING at launch, settled once the next step is prepared), so every
decode reads its last token on the device, from the persistent batch's ids; without it, as the
synchronous loop does.

    python benchmarks/step_host.py [--batches 1 64 256] [--steps 30] [--stub-forward] [--pending]
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
from data_plane.engine.sampler import Sampled
from data_plane.engine.scheduler import Scheduler, SchedulerLimits
from data_plane.engine.sequence import PENDING, SamplingParams, Sequence, SequenceStatus
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


def stub_forward(model: LlamaForCausalLM) -> None:
    """Replaces the model's forward and output projection, and the sampler, by stubs of negligible cost:
    zero hidden states, 16 zero logits a row, token 1 for every row."""
    hidden = model.config.hidden_size
    type(model).forward = lambda self, batch: torch.zeros(batch.input_ids.shape[0], hidden)
    type(model).logits = lambda self, rows: torch.zeros(rows.shape[0], 16)

    def sample(logits: torch.Tensor, batch, masks=None) -> Sampled:
        rows = logits.shape[0]
        return Sampled(torch.ones(rows, dtype=torch.int64), torch.zeros(rows), torch.zeros(rows, 0, dtype=torch.int64),
                       torch.zeros(rows, 0), batch.num_logprobs)

    model_runner.sample = sample


def host_ms(model: LlamaForCausalLM, batch_size: int, steps: int,
            pending: bool = False) -> tuple[list[float], list[float], list[float]]:
    """Per step, in milliseconds (the first five steps left out): the wall time of schedule -> run ->
    postprocess minus the time inside the model's forward, output projection and sampler; the same in
    this thread's CPU time (what other processes on a shared machine do not add to); and the sampler's
    wall time."""
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
    inside = {"model": 0.0, "sample": 0.0, "model_cpu": 0.0, "sample_cpu": 0.0}
    forward, logits, sample = model.forward, model.logits, model_runner.sample

    def timed(fn, key: str):
        def run(*args, **kwargs):
            started, started_cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[key] += time.perf_counter() - started
                inside[f"{key}_cpu"] += time.thread_time() - started_cpu
        return run

    model.forward, model.logits = timed(forward, "model"), timed(logits, "model")
    model_runner.sample = timed(sample, "sample")
    host, host_cpu, sampling = [], [], []
    flight = []  # (item, token) of the step launched last, not yet settled (pending)
    try:
        for step in range(steps + 5):
            inside.update(dict.fromkeys(inside, 0.0))
            started, started_cpu = time.perf_counter(), time.thread_time()
            batch = scheduler.schedule()
            if pending:  # as the asynchronous loop: recorded at launch, the step before's tokens settled after
                executed = runner.execute(runner.prepare(batch))
                scheduler.postprocess(batch, [PENDING] * len(batch), ran=False)
                for item, tok in flight:
                    scheduler.settle(item.seq, tok.id)
                flight = list(zip(batch, executed.tokens(), strict=True))
            else:
                scheduler.postprocess(batch, [tok.id for tok in runner.run(batch)])
            if step >= 5:
                host.append((time.perf_counter() - started - inside["model"] - inside["sample"]) * 1e3)
                host_cpu.append((time.thread_time() - started_cpu - inside["model_cpu"] - inside["sample_cpu"]) * 1e3)
                sampling.append(inside["sample"] * 1e3)
    finally:
        del model.forward, model.logits
        model_runner.sample = sample
    return host, host_cpu, sampling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stub-forward", action="store_true",
                        help="the forward, the output projection and the sampler replaced by stubs that return at "
                             "once: the host's bookkeeping alone, without the CPU's cost of freeing the "
                             "[rows, vocab] logits (a GPU pod keeps them on the device); its minimum is also shown")
    parser.add_argument("--pending", action="store_true",
                        help="tokens recorded as the asynchronous loop records them: each decode reads its last "
                             "token on the device")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = tiny_model()
    if args.stub_forward:
        stub_forward(model)
    print(f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, torch {torch.__version__}, load average {load_average()}; "
          f"context {CONTEXT}, {args.steps} steps each" + (", tokens pending a step (asynchronous loop)\n"
                                                            if args.pending else "\n"))
    print("| batch | host ms p50 | host ms p90 | host ms min | host CPU ms p50 | sampling ms p50 |")
    print("|---|---|---|---|---|---|")
    for batch_size in args.batches:
        host, host_cpu, sampling = host_ms(model, batch_size, args.steps, args.pending)
        host.sort()
        print(f"| {batch_size} | {statistics.median(host):.2f} | {host[int(0.9 * len(host))]:.2f} | {host[0]:.2f} | "
              f"{statistics.median(host_cpu):.2f} | {statistics.median(sampling):.2f} |")


if __name__ == "__main__":
    main()
