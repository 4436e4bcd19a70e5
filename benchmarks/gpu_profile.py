"""Where a GPU pod's decode step goes: the serving pod of gpu.py (batch 64, 64 slots of rank 16) under
torch.profiler, for a run of 64 distinct adapters and one of the base model alone.

    python benchmarks/gpu_profile.py [--model 8b|tiny] [--device cuda|cpu] [--new-tokens 24]

Prints, per run, the wall time and the device's busy time over the profiled window divided by the steps
that generated tokens (the window holds the batch's prefill too, so these are not a decode step's alone),
and the operators with the most device time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpu import SERVING, SIZES, prepare, requests  # noqa: E402 (benchmarks/, beside this script)
from gpu_checkpoint import PRESETS  # noqa: E402
from gpu_pods import drive, pod_config, running_pod  # noqa: E402


async def profiled(args, model_dir: Path, root: Path) -> None:
    sizes = SIZES[args.model]
    config, _ = pod_config(model_dir, args.device, args.dtype, max_loras=64, max_cpu_loras=64, max_lora_rank=16,
                           max_num_seqs=sizes.batch, adapter_roots=(root,))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    async with running_pod(config) as engine:
        await drive(engine, "adapter loads", requests(64, sizes, SERVING, seed=10), 2)
        for label, mix in (("64 adapters", SERVING), ("base only", [None])):
            await drive(engine, label, requests(sizes.batch, sizes, mix, seed=500), 8)  # warm
            with profile(activities=activities) as prof:
                run = await drive(engine, label, requests(sizes.batch, sizes, mix, seed=501), args.new_tokens)
            events = prof.key_averages()
            device_us = sum(e.self_device_time_total for e in events)
            steps = args.new_tokens
            print(f"\n== {label}: {run.tokens} tokens in {run.wall_s * 1e3:.0f} ms wall, {steps} steps: "
                  f"{run.wall_s * 1e3 / steps:.2f} ms/step wall, device busy {device_us / 1e3 / steps:.2f} ms/step "
                  "(the batch's prefill included)")
            sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
            print(events.table(sort_by=sort, row_limit=args.rows, max_name_column_width=60))
            if os.environ.get("OUT"):
                prof.export_chrome_trace(str(Path(os.environ["OUT"]) / f"trace-{label.replace(' ', '-')}.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="8b", choices=list(PRESETS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    with tempfile.TemporaryDirectory(prefix="lorafleet-profile-") as tmp:
        model_dir, root = prepare(Path(tmp), PRESETS[args.model], getattr(torch, args.dtype), args.device)
        asyncio.run(profiled(args, model_dir, root))


if __name__ == "__main__":
    main()
