"""Serving throughput and latency of a real pod over gRPC, next to transformers + peft, in one run.

Three runs on the same prompts, each submitting every request at once, repeated in interleaved
rounds (``--rounds``) so that drifting load on a shared machine hits all three alike:
- ``lorafleet`` with adapters: a pod process on loopback, requests spread round-robin over the
  adapters (and, on the demo model, the base model);
- ``lorafleet`` base only: the same pod, the same prompts, no adapter;
- ``peft``: transformers + peft, one ``generate(adapter_names=...)`` call over the whole batch with
  the same per-row adapters (left padding, greedy, same number of new tokens).

Models (``--model``):
- ``demo`` (default): the demo model, requests round-robin over the base model, the three demo
  adapters and a random rank-16 adapter on all seven projections;
- ``llama3-8b`` / ``tiny``: random weights of that shape (``benchmarks/synthetic.py``) and
  ``--num-adapters`` distinct random rank-``--rank`` adapters on all seven projections, one per
  request in turn, no base-model rows. ``--model llama3-8b --device cuda --dtype bfloat16
  --requests 64 --num-adapters 64`` is the GPU serving run; ``tiny`` checks the same path on a CPU.

Every request generates exactly ``--new-tokens`` tokens (EOS ignored on every side). Throughput is
output tokens over wall time; TTFT and inter-token latency are measured on the client from
stream arrival times (peft has no stream: its TTFT/ITL columns are empty). Prints markdown rows
for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from processes import PodProcess, cpu_flags, cpu_model, load_average  # benchmarks/processes.py
from stream_load import PROMPTS, Run, drive, percentile_ms  # benchmarks/stream_load.py
from synthetic import PRESETS, write_random_adapter, write_random_model  # benchmarks/synthetic.py

from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir
from data_plane.model.demo_model import ensure_demo_model
from data_plane.model.precision import DTYPE_CHOICES, load_dtype

EXTRA_ADAPTER = "bench-r16"  # a random rank-16 adapter on all seven projections, beside the demo adapters


class PeftRunner:
    """transformers + peft with every adapter loaded once; ``run`` is one timed mixed-adapter generate."""

    def __init__(self, model_dir: Path, roots: dict[str, Path], adapters: list[str | None], prompts: list[str],
                 device: str, dtype: torch.dtype) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        names = sorted({a for a in adapters if a})
        self.model = PeftModel.from_pretrained(base, roots[names[0]] / names[0], adapter_name=names[0])
        for name in names[1:]:
            self.model.load_adapter(roots[name] / name, adapter_name=name)
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                    add_generation_prompt=True) for p in prompts]
        self.batch = self.tokenizer(texts, return_tensors="pt", padding=True).to(device)
        self.row_adapters = [a or "__base__" for a in adapters]
        self._generate({k: v[:2] for k, v in self.batch.items()}, self.row_adapters[:2], 2)  # warm-up

    def _generate(self, batch: dict, row_adapters: list[str], new_tokens: int) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.generate(**batch, adapter_names=row_adapters, max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens, do_sample=False,
                                       pad_token_id=self.tokenizer.pad_token_id)

    def run(self, new_tokens: int) -> Run:
        start = time.perf_counter()
        out = self._generate(self.batch, self.row_adapters, new_tokens)
        if self.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        generated = out.shape[1] - self.batch["input_ids"].shape[1]
        assert generated == new_tokens, f"peft generated {generated} tokens, asked for {new_tokens}"
        return Run("transformers + peft", wall, generated * len(self.row_adapters))


def prepare(args: argparse.Namespace, tmp: Path) -> tuple[Path, dict[str, Path], list[str | None], str]:
    """The model directory, each adapter's root, the cycle of per-request adapters (None = base
    model) and a description of the mix."""
    adapter_root = tmp / "adapters"
    if args.model == "demo":
        model_dir = ensure_demo_model(quiet=True)
        config = json.loads((model_dir / "config.json").read_text())
        write_random_adapter(adapter_root / EXTRA_ADAPTER, config, 16, dtype=torch.float32)
        demo_root = demo_adapter_dir(DEMO_ADAPTERS[0]).parent
        roots = {**{n: demo_root for n in DEMO_ADAPTERS}, EXTRA_ADAPTER: adapter_root}
        return model_dir, roots, [None, *DEMO_ADAPTERS, EXTRA_ADAPTER], "base + 4 adapters"
    dtype = load_dtype(args.dtype, args.device)
    model_dir = write_random_model(tmp / "model", PRESETS[args.model], dtype, device=args.device,
                                   tokenizer_dir=args.tokenizer)
    config = json.loads((model_dir / "config.json").read_text())
    names = [f"r{args.rank}-{i}" for i in range(args.num_adapters)]
    for i, name in enumerate(names):
        write_random_adapter(adapter_root / name, config, args.rank, seed=i + 1, dtype=dtype)
    return model_dir, dict.fromkeys(names, adapter_root), list(names), f"{len(names)} adapters"


def logged_precision(log_path: Path) -> str:
    """What the pod's "precision" log line says it computes in and why."""
    for line in log_path.read_text().splitlines():
        if '"msg": "precision"' in line:
            record = json.loads(line)
            return f"{record['precision']}: {record['reason']}"
    return "none logged"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", choices=["demo", *PRESETS],
                        help="the demo model and adapters, or random weights of a named shape")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES,
                        help="the pod's precision (peft runs in its weights' dtype)")
    parser.add_argument("--tokenizer", type=Path,
                        help="directory with the demo model's tokenizer and config files, for a random-weight "
                             "model where the demo model is not installed (default: the installed demo model)")
    parser.add_argument("--num-adapters", type=int, default=64, help="random adapters (not with --model demo)")
    parser.add_argument("--rank", type=int, default=16, help="their rank (not with --model demo)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the pod and of peft (CPU)")
    parser.add_argument("--skip-peft", action="store_true")
    parser.add_argument("--pod-arg", action="append", default=[], metavar="FLAG",
                        help="a further flag for the pod, e.g. --pod-arg=--cpu-attention=tiled (repeatable)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of (LoRA, base only, peft), interleaved so that drifting machine load "
                             "affects all three alike; medians are reported")
    args = parser.parse_args()
    if args.model == "demo" and (args.device, load_dtype(args.dtype, args.device)) != ("cpu", torch.float32):
        parser.error("--model demo runs on the CPU with float32 weights (--dtype auto, float32 or bfloat16-matmul); "
                     "name a random-weight model for other devices")
    if args.device == "cpu":  # a GPU run leaves the host's threads to torch (writing 15 GB of weights)
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    rounds: list[list[Run]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, roots, cycle, mix = prepare(args, Path(tmp))
        adapters = [cycle[i % len(cycle)] for i in range(args.requests)]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
        names = [a for a in cycle if a]
        peft = None if args.skip_peft else PeftRunner(model_dir, roots, adapters, prompts, args.device,
                                                     load_dtype(args.dtype, args.device))
        pod_args = ["--model", str(model_dir), "--device", args.device, "--dtype", args.dtype,
                    "--max-num-seqs", str(args.requests), "--max-loras", str(len(names)),
                    "--max-cpu-loras", str(max(32, len(names))),
                    # a closed batch, every request sent at once and each one served: no queue-delay refusals
                    "--max-queue-delay", "0"]
        if args.model != "demo":  # slots sized to the adapters: 64 slots of rank 64 would take 21 GB at 8B
            pod_args += ["--max-lora-rank", str(args.rank)]
        if args.device == "cuda" and peft is not None:
            pod_args += ["--gpu-memory-utilization", "0.8"]  # room for peft's generate on the same GPU
        for root in sorted(set(roots.values())):
            pod_args += ["--adapter-root", str(root)]
        pod_args += args.pod_arg
        pod = PodProcess(Path(tmp), *pod_args, name="bench")
        pod.start(timeout_s=1800)
        precision = logged_precision(pod.log_path)
        stub = pod.generation()
        try:
            drive(stub, "warm-up", cycle, [PROMPTS[0]] * len(cycle), 4)  # loads every adapter
            for _ in range(args.rounds):
                runs = [drive(stub, f"lorafleet, {mix}", adapters, prompts, args.new_tokens),
                        drive(stub, "lorafleet, base only", [None] * len(prompts), prompts, args.new_tokens)]
                if peft is not None:
                    runs.append(peft.run(args.new_tokens))
                rounds.append(runs)
                print("round:", ", ".join(f"{r.label} {r.throughput:.1f} tok/s" for r in runs), flush=True)
        finally:
            pod.stop()

    import transformers

    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else f"{cpu_model()} ({platform.machine()}; {cpu_flags()}), {args.threads} threads")
    print(f"\n{time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; model {args.model} {args.dtype}, {args.requests} requests, "
          f"{args.new_tokens} new tokens each, {args.rounds} interleaved rounds, pod --dtype {args.dtype} "
          f"({precision}), load average {load_average()}\n")
    print("| round | run | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for i, runs in enumerate(rounds, 1):
        for r in runs:
            print(f"| {i} | {r.label} | {r.throughput:.1f} | {percentile_ms(r.ttft, 0.5)} "
                  f"| {percentile_ms(r.ttft, 0.99)} | {percentile_ms(r.itl, 0.5)} | {percentile_ms(r.itl, 0.99)} "
                  f"| {r.wall_s:.1f} |")
    lora_base = [runs[0].throughput / runs[1].throughput for runs in rounds]
    print(f"\nLoRA / base-only throughput per round: {', '.join(f'{x:.2f}' for x in lora_base)}; "
          f"median {statistics.median(lora_base):.2f}")
    if peft is not None:
        lora_peft = [runs[0].throughput / runs[2].throughput for runs in rounds]
        print(f"lorafleet (LoRA) / peft throughput per round: {', '.join(f'{x:.2f}' for x in lora_peft)}; "
              f"median {statistics.median(lora_peft):.2f}")


if __name__ == "__main__":
    main()
