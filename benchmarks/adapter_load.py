"""Time from a PEFT adapter directory to ready-in-slot, next to reading the same file's bytes.

For each adapter, one repeat measures, through the pod's own objects (``LoraRuntime`` and its
``AdapterCache``):

- ``read+validate``: ``LoraRuntime.read`` — resolve the directory under the adapter root, read
  ``adapter_config.json``, read ``adapter_model.safetensors`` into host memory and sha256 it as
  its chunks arrive (on another thread), parse its header, check every name, rank and shape
  against the model, group the tensors (views of the read buffer) by slice, check with one min/max
  reduction that every value is finite and fits the serving dtype, wait for the hash and compare it;
- ``insert``: ``AdapterCache.insert`` into the CPU tier;
- ``slot copy``: ``AdapterCache.acquire``, which copies the adapter from the read buffer into a
  free slot of every LoRA layer, converting to the serving dtype and folding the scale into B on
  the way (synchronised on CUDA);
- ``CPU repack`` (CPU slots only, not part of ready-in-slot): the CPU LoRA path's packed copy of
  the new slot (``kernels.cpu_lora``), which the next step that runs a LoRA layer brings up to
  date; timed here by asking every layer's backend for its pack.

Before each repeat the file's pages are dropped from the page cache with
``posix_fadvise(DONTNEED)`` (no root needed; "cold-ish": the disk's own cache and the directory
entries stay warm). ``raw read`` is ``Path.read_bytes`` of the same safetensors file after the
same drop, in the same run. The adapter is unloaded between repeats, untimed.

Adapters: the three committed demo adapters on the demo model (float32, as a CPU pod serves
it), and a random rank-16 adapter of Llama-3-8B shape (hidden 4096, 32 layers, all seven
projections, intermediate 14336, 8 KV heads of dim 128; bfloat16 as an 8B pod serves it)
written to a temporary directory in peft's file layout. The 8B model is our real
``LlamaForCausalLM`` built from an 8B config, whose base weights are zero-stride tensors that
take no memory: nothing in the load path reads base weights, while the LoRA slot buffers, the
adapter reader and the cache are the real ones at full size.

Prints markdown rows (medians of ``--repeats``) for benchmarks/RESULTS.md.
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
from synthetic import LLAMA3_8B, write_random_adapter  # benchmarks/synthetic.py, beside this script

from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir
from data_plane.lora.runtime import LoraRuntime
from data_plane.model import load_model
from data_plane.model.config import ModelConfig
from data_plane.model.demo_model import ensure_demo_model
from data_plane.model.llama import LlamaForCausalLM

HEADER = ("| date | CPU | torch | adapter | dtype | rank | file MB | raw read ms | read+validate ms | insert ms "
          "| slot copy ms | ready-in-slot ms | ready / raw | CPU repack ms |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def drop_page_cache(path: Path) -> None:
    """Asks the kernel to forget ``path``'s cached pages, so the next read goes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def stand_in_model(config: dict, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    """Our model class built from ``config``, every parameter a zero-stride tensor (no memory)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_dict(config))
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            empty = torch.empty_strided(p.shape, (0,) * p.dim(), dtype=dtype, device=device)
            module.register_parameter(name, torch.nn.Parameter(empty, requires_grad=False))
    return model


def time_loads(runtime: LoraRuntime, name: str, adapter_dir: Path, repeats: int, device: str) -> dict[str, float]:
    """Median milliseconds of each phase, and of a raw read of the same file, over ``repeats``."""
    weights = adapter_dir / "adapter_model.safetensors"
    phases: dict[str, list[float]] = {"raw": [], "read": [], "insert": [], "slot": [], "total": [], "repack": []}
    for _ in range(repeats):
        drop_page_cache(weights)
        t0 = time.perf_counter()
        weights.read_bytes()
        phases["raw"].append(time.perf_counter() - t0)

        drop_page_cache(weights)
        t0 = time.perf_counter()
        adapter = runtime.read(name, str(adapter_dir))
        t1 = time.perf_counter()
        runtime.cache.insert(adapter)
        t2 = time.perf_counter()
        runtime.cache.acquire(name)
        if device == "cuda":  # slot copies are asynchronous there
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        phases["read"].append(t1 - t0)
        phases["insert"].append(t2 - t1)
        phases["slot"].append(t3 - t2)
        phases["total"].append(t3 - t0)
        if device == "cpu":
            t4 = time.perf_counter()
            for layer in runtime.layers.values():
                layer.backend.pack()
            phases["repack"].append(time.perf_counter() - t4)
        runtime.cache.release(name)
        runtime.cache.unload(name)
    return {k: 1000 * statistics.median(v) if v else float("nan") for k, v in phases.items()}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def row(label: str, dtype: torch.dtype, rank: int, adapter_dir: Path, ms: dict[str, float], threads: int) -> str:
    size = (adapter_dir / "adapter_model.safetensors").stat().st_size / 1e6
    threads_text = f"{threads} thread{'s' * (threads != 1)}"
    return (f"| {time.strftime('%Y-%m-%d')} | {cpu_name()}, {threads_text} | {torch.__version__} | {label} "
            f"| {str(dtype).removeprefix('torch.')} | {rank} | {size:.2f} | {ms['raw']:.2f} | {ms['read']:.2f} "
            f"| {ms['insert']:.3f} | {ms['slot']:.2f} | {ms['total']:.2f} | {ms['total'] / ms['raw']:.2f}× "
            f"| {ms['repack']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the slots live")
    parser.add_argument("--skip-8b", action="store_true", help="only the demo adapters")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(HEADER)

    demo = load_model(ensure_demo_model(quiet=True), "float32", args.device)
    root = demo_adapter_dir(DEMO_ADAPTERS[0]).parent
    runtime = LoraRuntime(demo, max_loras=2, max_cpu_loras=2, max_rank=64, max_tokens=256, adapter_roots=(root,))
    for name in DEMO_ADAPTERS:
        path = demo_adapter_dir(name)
        ms = time_loads(runtime, name, path, args.repeats, args.device)
        rank = json.loads((path / "adapter_config.json").read_text())["r"]
        print(row(f"{name} (demo model, 135M)", torch.float32, rank, path, ms, args.threads), flush=True)
    del runtime, demo

    if not args.skip_8b:
        with tempfile.TemporaryDirectory(prefix="lorafleet-bench-") as tmp:
            path = Path(tmp) / "llama3-8b-r16"
            write_random_adapter(path, LLAMA3_8B, rank=16)
            model = stand_in_model(LLAMA3_8B, torch.bfloat16, args.device)
            runtime = LoraRuntime(model, max_loras=2, max_cpu_loras=2, max_rank=16, max_tokens=256,
                                  adapter_roots=(Path(tmp),))
            ms = time_loads(runtime, path.name, path, args.repeats, args.device)
            print(row("random r16, all 7 (Llama-3-8B shape)", torch.bfloat16, 16, path, ms, args.threads))


if __name__ == "__main__":
    main()
